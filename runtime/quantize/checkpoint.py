"""A source checkpoint directory, read from its config.json, index and shard headers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.runtime.quantize import fp8
from tessera.runtime.quantize.shardio import TensorSpec, read_specs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    directory: Path
    config: dict[str, Any]
    shards: dict[str, list[TensorSpec]]  # shard file -> its tensors, in file order
    location: dict[str, str]  # tensor name -> shard file
    specs: dict[str, TensorSpec]  # tensor name -> its spec

    def fingerprint(self) -> str:
        """Changes when the shard files, their tensors or their sizes change."""
        sha = hashlib.sha256()
        for file, specs in self.shards.items():
            sha.update(f"{file}:{(self.directory / file).stat().st_size}".encode())
            for s in specs:
                sha.update(f"{s.name}:{s.dtype}:{s.shape}".encode())
        return sha.hexdigest()


def read_checkpoint(directory: Path) -> Checkpoint:
    """Reads headers only; raises ValueError naming what is missing or unsupported."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} has no config.json: point at a Hugging Face model folder")
    config = json.loads(config_path.read_text())
    _check_source_quantization(config.get("quantization_config"))
    if (directory / INDEX).is_file():
        weight_map: dict[str, str] = json.loads((directory / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise ValueError(f"{directory} has neither {INDEX} nor {SINGLE}")
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise ValueError(f"{len(missing)} shard(s) listed in the index are missing, e.g. "
                         f"{missing[0]}: finish downloading the checkpoint")
    shards = {f: read_specs(directory / f) for f in files}
    location = {s.name: f for f, specs in shards.items() for s in specs}
    by_name = {s.name: s for specs in shards.values() for s in specs}
    return Checkpoint(directory, config, shards, location, by_name)


def _check_source_quantization(qc: dict[str, Any] | None) -> None:
    if qc is None:
        return
    block = qc.get("weight_block_size")
    if qc.get("quant_method") == "fp8" and block == [fp8.BLOCK, fp8.BLOCK]:
        return
    raise ValueError(
        f"source quantization_config {qc} is not supported: tessera quantize reads BF16 "
        f"checkpoints or FP8 ones with {fp8.BLOCK}x{fp8.BLOCK} block scales (weight_scale_inv)"
    )
