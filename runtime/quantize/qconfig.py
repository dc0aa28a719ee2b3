"""The `quantization_config` SGLang reads to load a compressed-tensors W4A16 checkpoint."""

from __future__ import annotations

from typing import Any


def quantization_config(ignore: list[str], group_size: int) -> dict[str, Any]:
    """compressed-tensors, `pack-quantized`: symmetric INT4 weights in groups along K,
    activations left in 16 bits, every Linear except those in `ignore`."""
    weights = {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
        "group_size": group_size, "dynamic": False, "actorder": None,
        "block_structure": None, "observer": "minmax", "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"], "weights": weights,
                "input_activations": None, "output_activations": None,
            },
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def output_config(source: dict[str, Any], ignore: list[str], group_size: int) -> dict[str, Any]:
    """The source config.json with its (FP8) quantization_config replaced; unquantized
    weights are written in BF16, so that is the model's dtype."""
    return {
        **source,
        "torch_dtype": "bfloat16",
        "quantization_config": quantization_config(ignore, group_size),
    }
