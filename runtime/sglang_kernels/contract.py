"""The pinned SGLang contract the adapter is written against, and the check of an installed SGLang.

The adapter replaces or calls a handful of SGLang callables. If an SGLang upgrade renames, adds or
reorders one of their parameters, the adapter would pass arguments to the wrong place, so the
runtime checks every one of them before SGLang starts and refuses to start on any difference.
The check compares names and order of parameters (not defaults: SGLang retunes those freely).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.runtime.config import ENGINE_VERSION
from tessera.runtime.preflight import installed_engine_version


class ContractError(RuntimeError):
    """The installed SGLang is not the one the adapter was written for; the message says how."""


@dataclass(frozen=True)
class Target:
    """One SGLang callable: ``module`` + ``qualname`` (``Class.method`` for methods), and the
    names of its parameters in order (``self`` included for methods)."""

    family: str  # the kernel family whose patch relies on it ("decode_attention", "w4a16")
    module: str
    qualname: str
    params: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass(frozen=True)
class Seam:
    """Source text a patch relies on in a module it does not touch (read, never imported): e.g.
    that SGLang's Triton backend looks ``decode_attention_fwd`` up when it is built, so a patch of
    the kernel module made before then is what it runs."""

    family: str
    module: str
    lines: tuple[str, ...]  # each must appear, stripped, as a line of the module's source


@dataclass(frozen=True)
class Contract:
    version: str
    targets: tuple[Target, ...]
    seams: tuple[Seam, ...] = ()

    def for_families(self, families: frozenset[str]) -> Contract:
        """The part of the contract that the patches of ``families`` rely on."""
        return Contract(
            self.version,
            tuple(t for t in self.targets if t.family in families),
            tuple(s for s in self.seams if s.family in families),
        )


DECODE_ATTENTION_MODULE = "sglang.kernels.ops.attention.decode_attention"
WNA16_MODULE = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16"
WNA16_MOE_MODULE = (
    "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe"
)

DECODE_ATTENTION_FWD = Target(
    "decode_attention",
    DECODE_ATTENTION_MODULE,
    "decode_attention_fwd",
    (
        "q",
        "k_buffer",
        "v_buffer",
        "o",
        "kv_indptr",
        "kv_indices",
        "attn_logits",
        "attn_lse",
        "num_kv_splits",
        "max_kv_splits",
        "sm_scale",
        "k_scale",
        "v_scale",
        "logit_cap",
        "sinks",
        "xai_temperature_len",
        "has_mla",
        "use_pdl",
        "page_size",
        "score_mod",
        "aux_tensors",
        "enable_lean",
        "lean_Mp",
        "lean_Lp",
        "lean_Op",
        "lean_locks",
        "uneven_batch",
    ),
)

TRITON_BACKEND_SEAM = Seam(
    "decode_attention",
    "sglang.srt.layers.attention.triton_backend",
    (
        "from sglang.kernels.ops.attention.decode_attention import (",
        "decode_attention_fwd,",
        "self.decode_attention_fwd = torch.compiler.disable(decode_attention_fwd)",
    ),
)

PINNED = Contract(
    version=ENGINE_VERSION,
    seams=(TRITON_BACKEND_SEAM,),
    targets=(
        DECODE_ATTENTION_FWD,
        Target(
            "w4a16",
            WNA16_MODULE,
            "CompressedTensorsWNA16.__init__",
            ("self", "strategy", "num_bits", "group_size", "symmetric", "actorder"),
        ),
        Target(
            "w4a16",
            WNA16_MODULE,
            "CompressedTensorsWNA16.create_weights",
            (
                "self",
                "layer",
                "output_size",
                "input_size",
                "output_partition_sizes",
                "input_size_per_partition",
                "params_dtype",
                "weight_loader",
                "kwargs",
            ),
        ),
        Target(
            "w4a16",
            WNA16_MODULE,
            "CompressedTensorsWNA16.process_weights_after_loading",
            ("self", "layer"),
        ),
        Target(
            "w4a16",
            WNA16_MODULE,
            "CompressedTensorsWNA16.apply_weights",
            ("self", "layer", "x", "bias"),
        ),
        Target(
            "w4a16",
            WNA16_MOE_MODULE,
            "CompressedTensorsWNA16MoE.__init__",
            ("self", "quant_config", "weight_quant", "num_gpu_experts"),
        ),
        Target(
            "w4a16",
            WNA16_MOE_MODULE,
            "CompressedTensorsWNA16MoE.create_weights",
            (
                "self",
                "layer",
                "num_experts",
                "hidden_size",
                "intermediate_size_per_partition",
                "params_dtype",
                "extra_weight_attrs",
            ),
        ),
        Target(
            "w4a16",
            WNA16_MOE_MODULE,
            "CompressedTensorsWNA16MoE.process_weights_after_loading",
            ("self", "layer"),
        ),
        Target(
            "w4a16",
            WNA16_MOE_MODULE,
            "CompressedTensorsWNA16MoE.create_moe_runner",
            ("self", "layer", "moe_runner_config"),
        ),
        Target(
            "w4a16",
            WNA16_MOE_MODULE,
            "CompressedTensorsWNA16MoE.apply_weights",
            ("self", "layer", "dispatch_output"),
        ),
    ),
)


def signature_problem(target: Target, actual: tuple[str, ...] | None) -> str | None:
    """What differs between the pinned parameters and the installed ones (None: they agree)."""
    if actual is None:
        return f"{target.name} is missing"
    if actual == target.params:
        return None
    missing = [p for p in target.params if p not in actual]
    added = [p for p in actual if p not in target.params]
    parts = []
    if missing:
        parts.append(f"lost {', '.join(missing)}")
    if added:
        parts.append(f"gained {', '.join(added)}")
    if not parts:
        parts.append("reordered")
    return (
        f"{target.name}: parameters {', '.join(parts)} (pinned ({', '.join(target.params)}), "
        f"installed ({', '.join(actual)}))"
    )


def resolve(module: str, qualname: str, import_module: Callable[[str], Any]) -> Any | None:
    """The object at ``module.qualname``, or None when the module or an attribute is missing."""
    try:
        obj = import_module(module)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def installed_params(
    target: Target, import_module: Callable[[str], Any] = importlib.import_module
) -> tuple[str, ...] | None:
    obj = resolve(target.module, target.qualname, import_module)
    if obj is None:
        return None
    return tuple(inspect.signature(obj).parameters)


def seam_problem(seam: Seam, source: str | None) -> str | None:
    """What the module's source lacks (None: every pinned line is there)."""
    if source is None:
        return f"{seam.module} is missing"
    present = {line.strip() for line in source.splitlines()}
    missing = [line for line in seam.lines if line not in present]
    if not missing:
        return None
    return f"{seam.module} no longer has: {' | '.join(missing)}"


def module_source(module: str) -> str | None:
    """A module's source text, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def contract_problems(
    contract: Contract,
    installed_version: str | None,
    import_module: Callable[[str], Any] = importlib.import_module,
) -> list[str]:
    """Every way the installed SGLang differs from ``contract`` (empty: it matches)."""
    if installed_version is None:
        return ["SGLang is not installed"]
    problems = []
    if installed_version != contract.version:
        problems.append(
            f"SGLang {installed_version} is installed, the adapter is pinned to {contract.version}"
        )
    for target in contract.targets:
        problem = signature_problem(target, installed_params(target, import_module))
        if problem is not None:
            problems.append(problem)
    for seam in contract.seams:
        problem = seam_problem(seam, module_source(seam.module))
        if problem is not None:
            problems.append(problem)
    return problems


def verify(contract: Contract = PINNED, installed_version: str | None = None) -> None:
    """Raise :class:`ContractError` unless the installed SGLang matches ``contract``."""
    found = installed_engine_version() if installed_version is None else installed_version
    problems = contract_problems(contract, found)
    if problems:
        raise ContractError(
            f"tessera's SGLang kernel adapter cannot start: the installed SGLang does not match "
            f"the contract it was written for (SGLang {contract.version}): "
            + "; ".join(problems)
            + ". Use the runtime image built for this tessera version, or set "
            "kernels.decode_attention and kernels.w4a16 to 'sglang' to run SGLang's own kernels."
        )
