"""What the converter will write: a pure function of the source's headers and the options.

Each source shard becomes one output shard of the same name, so a shard is the unit of work,
of resumption and of checksumming. Every output tensor's name, dtype and shape is known before
any tensor is read, which lets the writer stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from tessera.kernels import w4a16_format
from tessera.runtime.quantize.checkpoint import Checkpoint
from tessera.runtime.quantize.options import Options
from tessera.runtime.quantize.shardio import TensorSpec
from tessera.runtime.quantize.tensors import (
    SCALE_SUFFIX,
    check_selection,
    classify,
    ignore_list,
    is_selected,
    module_of,
    parse_targets,
)


class Action(Enum):
    COPY = "copy"  # written as read
    DEQUANTIZE = "dequantize"  # FP8 + scales -> BF16 (SGLang reads unquantized layers as BF16)
    QUANTIZE = "quantize"  # -> INT4 pack-quantized


@dataclass(frozen=True)
class Step:
    source: str
    scale: str | None  # the FP8 weight's weight_scale_inv, read alongside
    action: Action
    outputs: tuple[TensorSpec, ...]
    tensor_class: str
    source_bytes: int  # weight and scale as stored in the source


@dataclass(frozen=True)
class Plan:
    shards: dict[str, tuple[Step, ...]]
    ignore: list[str]  # compressed-tensors `ignore` list

    def weight_map(self) -> dict[str, str]:
        return {o.name: file for file, steps in self.shards.items()
                for step in steps for o in step.outputs}

    def specs(self, file: str) -> list[TensorSpec]:
        return [o for step in self.shards[file] for o in step.outputs]


def packed_specs(module: str, n: int, k: int, group_size: int) -> tuple[TensorSpec, ...]:
    """The tensors `w4a16_format.to_compressed_tensors` yields for a symmetric [n, k] weight."""
    return (
        TensorSpec(f"{module}.weight_packed", torch.int32, (n, k // w4a16_format.PACK)),
        TensorSpec(f"{module}.weight_scale", torch.bfloat16, (n, k // group_size)),
        TensorSpec(f"{module}.weight_shape", torch.int32, (2,)),
    )


def make_plan(ckpt: Checkpoint, options: Options) -> Plan:
    """Raises ValueError, naming the tensor, for anything the converter cannot handle."""
    targets = parse_targets(options.targets)
    scales = {n for n in ckpt.location if n.endswith(SCALE_SUFFIX)}
    orphans = sorted(s for s in scales if s.removesuffix("_scale_inv") not in ckpt.location)
    if orphans:
        raise ValueError(f"{orphans[0]} has no weight beside it: the checkpoint is incomplete")
    selected = {}
    for name in ckpt.location:
        if name in scales:
            continue
        spec = ckpt.specs[name]
        if classify(name).ignore is not None and name.endswith(".weight") and len(spec.shape) == 2:
            selected[name] = is_selected(name, spec.shape, targets)
    if not any(selected.values()):
        raise ValueError(f"targets {list(options.targets)} match no Linear weight in "
                         f"{ckpt.directory}: nothing would be quantized")
    check_selection(selected)

    shards = {}
    for file, specs in ckpt.shards.items():
        shards[file] = tuple(_step(ckpt, spec, selected.get(spec.name, False), options)
                             for spec in specs if spec.name not in scales)
    return Plan(shards, ignore_list(selected))


def _step(ckpt: Checkpoint, spec: TensorSpec, quantize: bool, options: Options) -> Step:
    name = spec.name
    scale = name + "_scale_inv" if name + "_scale_inv" in ckpt.location else None
    is_fp8 = spec.dtype == torch.float8_e4m3fn
    if is_fp8 != (scale is not None):
        raise ValueError(f"{name} is {spec.dtype} but {'has' if scale else 'lacks'} a "
                         "weight_scale_inv: only FP8 weights with block scales are supported")
    source_bytes = spec.nbytes + (ckpt.specs[scale].nbytes if scale else 0)
    tensor_class = classify(name).name
    if quantize:
        n, k = spec.shape
        if k % options.group_size:
            raise ValueError(f"{name} has {k} input features, not a multiple of the group size "
                             f"{options.group_size}: leave it out of the targets")
        outputs = packed_specs(module_of(name), n, k, options.group_size)
        return Step(name, scale, Action.QUANTIZE, outputs, tensor_class, source_bytes)
    if is_fp8:
        outputs = (TensorSpec(name, torch.bfloat16, spec.shape),)
        return Step(name, scale, Action.DEQUANTIZE, outputs, tensor_class, source_bytes)
    return Step(name, None, Action.COPY, (spec,), tensor_class, source_bytes)


def size_by_class(plan: Plan) -> dict[str, tuple[int, int]]:
    """tensor class -> (bytes before, bytes after)."""
    sizes: dict[str, tuple[int, int]] = {}
    for steps in plan.shards.values():
        for step in steps:
            before, after = sizes.get(step.tensor_class, (0, 0))
            sizes[step.tensor_class] = (
                before + step.source_bytes, after + sum(o.nbytes for o in step.outputs))
    return sizes
