"""Tensor classes, target selection and the compressed-tensors ignore list."""

from __future__ import annotations

import re

import pytest
from tessera.runtime.quantize.tensors import (
    check_selection,
    classify,
    fused_module,
    ignore_list,
    is_selected,
    parse_targets,
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.3.mlp.experts.17.gate_proj.weight", "routed_experts"),
        ("model.layers.3.mlp.experts.17.down_proj.weight_scale_inv", "routed_experts"),
        ("model.layers.61.mlp.experts.255.up_proj.weight", "routed_experts"),
        ("model.layers.3.mlp.shared_experts.down_proj.weight", "shared_experts"),
        ("model.layers.0.mlp.gate_proj.weight", "dense_mlp"),
        ("model.layers.3.mlp.gate.weight", "router"),
        ("model.layers.3.mlp.gate.e_score_correction_bias", "router"),
        ("model.layers.5.self_attn.indexer.weights_proj.weight", "router"),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "attention"),
        ("model.layers.0.self_attn.q_a_proj.weight_scale_inv", "attention"),
        ("model.layers.0.self_attn.kv_b_proj.weight", "attention"),
        ("model.layers.5.self_attn.indexer.wq_b.weight", "attention"),
        ("model.layers.0.self_attn.q_a_layernorm.weight", "attention"),
        ("lm_head.weight", "lm_head"),
        ("model.layers.61.shared_head.head.weight", "lm_head"),
        ("model.layers.61.eh_proj.weight", "mtp_projection"),
        ("model.embed_tokens.weight", "embedding"),
        ("model.layers.61.embed_tokens.weight", "embedding"),
        ("model.layers.0.input_layernorm.weight", "norm"),
        ("model.layers.61.enorm.weight", "norm"),
        ("model.norm.weight", "norm"),
        ("model.rotary_emb.inv_freq", "other"),
    ],
)
def test_classify_real_names(name: str, expected: str) -> None:
    assert classify(name).name == expected


@pytest.mark.parametrize(
    ("module", "fused"),
    [
        ("model.layers.3.mlp.experts.7.down_proj", "model.layers.3.mlp.experts"),
        ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gate_up_proj"),
        ("model.layers.3.mlp.shared_experts.up_proj",
         "model.layers.3.mlp.shared_experts.gate_up_proj"),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa",
         "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa"),
        ("model.layers.0.self_attn.kv_b_proj", "model.layers.0.self_attn.kv_b_proj"),
    ],
)
def test_fused_module(module: str, fused: str) -> None:
    assert fused_module(module) == fused


def test_selection_takes_2d_weights_of_quantizable_classes_only() -> None:
    targets = parse_targets(["routed_experts", "re:.*"])
    assert is_selected("model.layers.3.mlp.experts.0.up_proj.weight", (128, 256), targets)
    assert is_selected("model.layers.0.self_attn.o_proj.weight", (256, 128), targets)
    assert not is_selected("model.layers.3.mlp.experts.0.up_proj.weight_scale_inv", (1, 2),
                           targets)
    assert not is_selected("model.layers.3.mlp.gate.weight", (8, 256), targets)
    assert not is_selected("lm_head.weight", (1024, 256), targets)
    assert not is_selected("model.layers.0.input_layernorm.weight", (256,), targets)


@pytest.mark.parametrize(
    ("target", "message"),
    [("experts", "neither a quantizable tensor class"),
     ("lm_head", "neither a quantizable tensor class"),
     ("re:(", "not a valid regex")],
)
def test_bad_targets_say_what_is_accepted(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_targets([target])


def test_a_partly_quantized_fused_layer_is_refused() -> None:
    selected = {
        "model.layers.0.self_attn.q_a_proj.weight": True,
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": False,
    }
    with pytest.raises(ValueError, match="fused_qkv_a_proj_with_mqa"):
        check_selection(selected)
    experts = {f"model.layers.3.mlp.experts.{e}.gate_proj.weight": e != 1 for e in range(4)}
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts"):
        check_selection(experts)


def test_ignore_list_regex_per_left_out_class_names_for_partial_ones() -> None:
    selected = {
        "model.layers.1.mlp.experts.0.gate_proj.weight": True,
        "model.layers.2.mlp.experts.0.gate_proj.weight": False,  # layer 2 left out
        "model.layers.1.mlp.shared_experts.down_proj.weight": False,
        "model.layers.1.self_attn.o_proj.weight": False,
        "lm_head.weight": False,
    }
    assert ignore_list(selected) == sorted([
        "model.layers.2.mlp.experts",
        "model.layers.2.mlp.experts.0.gate_proj",
        r"re:.*\.mlp\.shared_experts\..*",
        r"re:.*\.self_attn\..*",
        r"re:(.*\.)?(lm_head|shared_head\.head)$",
    ])
