"""What each checkpoint tensor is, which ones get quantized, and what SGLang must be told to skip.

Names follow the DeepSeek V3 family (DeepSeek V3/R1, Kimi K2, GLM 5):
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, `...mlp.shared_experts.*`,
`...self_attn.{q_a_proj,kv_a_proj_with_mqa,kv_b_proj,...}`, `...self_attn.indexer.*` (GLM 5).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

SCALE_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class TensorClass:
    name: str
    pattern: re.Pattern[str]  # over tensor names; the first class that matches wins
    ignore: str | None  # compressed-tensors `ignore` entry over module names; None: not a Linear
    quantizable: bool = False  # SGLang builds these Linears with the checkpoint's quant config


TENSOR_CLASSES: tuple[TensorClass, ...] = (
    TensorClass("routed_experts", re.compile(r".*\.mlp\.experts\.\d+\.\w+_proj\."),
                r"re:.*\.mlp\.experts(\..*)?$", quantizable=True),
    TensorClass("shared_experts", re.compile(r".*\.mlp\.shared_experts\."),
                r"re:.*\.mlp\.shared_experts\..*", quantizable=True),
    TensorClass("dense_mlp", re.compile(r".*\.mlp\.(gate|up|down)_proj\."),
                r"re:.*\.mlp\.(gate|up|gate_up|down)_proj$", quantizable=True),
    # Linears SGLang always builds in 16 bits (the MoE router, the GLM 5 indexer's per-head
    # weights, the output heads, the MTP projection); listed in `ignore` for other loaders
    TensorClass("router", re.compile(r".*\.(mlp\.gate|indexer\.weights_proj)\."),
                r"re:.*\.(mlp\.gate|indexer\.weights_proj)$"),
    TensorClass("attention", re.compile(r".*\.self_attn\."), r"re:.*\.self_attn\..*",
                quantizable=True),
    TensorClass("lm_head", re.compile(r"(^lm_head\.|.*\.shared_head\.head\.)"),
                r"re:(.*\.)?(lm_head|shared_head\.head)$"),
    TensorClass("mtp_projection", re.compile(r".*\.eh_proj\."), r"re:.*\.eh_proj$"),
    TensorClass("embedding", re.compile(r"(.*\.)?embed_tokens\."), None),
    TensorClass("norm", re.compile(r".*norm\.(weight|bias)$"), None),
    TensorClass("other", re.compile(r".*"), None),
)
CLASSES_BY_NAME = {c.name: c for c in TENSOR_CLASSES}
DEFAULT_TARGETS: tuple[str, ...] = ("routed_experts",)

# Modules SGLang fuses into one layer: their parts must be quantized together.
_FUSED = (
    (re.compile(r"^(.*\.mlp\.experts)\.\d+\.\w+_proj$"), r"\1"),
    (re.compile(r"^(.*)\.(gate|up)_proj$"), r"\1.gate_up_proj"),
    (re.compile(r"^(.*)\.(q_a_proj|kv_a_proj_with_mqa)$"), r"\1.fused_qkv_a_proj_with_mqa"),
)


def classify(tensor_name: str) -> TensorClass:
    return next(c for c in TENSOR_CLASSES if c.pattern.match(tensor_name))


def module_of(tensor_name: str) -> str:
    """`a.b.weight_scale_inv` -> `a.b`: the module a tensor belongs to."""
    return tensor_name.rsplit(".", 1)[0]


def fused_module(module: str) -> str:
    """The layer SGLang builds this module into (the MoE layer for an expert)."""
    for pattern, replacement in _FUSED:
        if pattern.match(module):
            return pattern.sub(replacement, module)
    return module


def parse_targets(targets: Iterable[str]) -> tuple[re.Pattern[str], ...]:
    """`routed_experts` (a tensor class) or `re:<regex over weight names>` -> patterns."""
    patterns = []
    for target in targets:
        if target.startswith("re:"):
            try:
                patterns.append(re.compile(target[3:]))
            except re.error as err:
                raise ValueError(f"target {target!r} is not a valid regex: {err}") from None
        elif target in CLASSES_BY_NAME and CLASSES_BY_NAME[target].quantizable:
            patterns.append(CLASSES_BY_NAME[target].pattern)
        else:
            linear = [c.name for c in TENSOR_CLASSES if c.quantizable]
            raise ValueError(
                f"target {target!r} is neither a quantizable tensor class ({', '.join(linear)}) "
                "nor a regex written as 're:<regex>'"
            )
    return tuple(patterns)


def is_selected(name: str, shape: tuple[int, ...], targets: tuple[re.Pattern[str], ...]) -> bool:
    """A 2-D `.weight` of a quantizable class that a target matches."""
    return (
        name.endswith(".weight")
        and len(shape) == 2
        and classify(name).quantizable
        and any(t.match(name) for t in targets)
    )


def check_selection(selected: dict[str, bool]) -> None:
    """Parts of one fused layer must agree, or SGLang cannot load the layer.

    `selected` maps every Linear weight name to whether it will be quantized.
    """
    by_layer: dict[str, set[bool]] = {}
    for name, chosen in selected.items():
        by_layer.setdefault(fused_module(module_of(name)), set()).add(chosen)
    mixed = sorted(layer for layer, choices in by_layer.items() if len(choices) > 1)
    if mixed:
        raise ValueError(
            f"{len(mixed)} fused layer(s) would be only partly quantized, e.g. {mixed[0]!r}: "
            "SGLang loads each fused layer (a MoE layer's experts, gate+up, q_a+kv_a) in one "
            "format; widen or narrow the targets so each is all in or all out"
        )


def ignore_list(selected: dict[str, bool]) -> list[str]:
    """The compressed-tensors `ignore` list for the Linear weights left unquantized.

    A class left out entirely is one regex. A class quantized in part lists each left-out
    module by name, and its fused layer's name too: SGLang asks about a fused layer by its
    own name (`...fused_qkv_a_proj_with_mqa`) and about a MoE layer by expert 0's names.
    """
    by_class: dict[str, dict[str, bool]] = {}
    for name, chosen in selected.items():
        by_class.setdefault(classify(name).name, {})[name] = chosen
    entries = set()
    for class_name, members in by_class.items():
        if not any(members.values()):
            entries.add(str(CLASSES_BY_NAME[class_name].ignore))
            continue
        for name, chosen in members.items():
            if not chosen:
                entries.update((module_of(name), fused_module(module_of(name))))
    return sorted(entries)
