"""ModelDeployment spec -> per-phase capacity plan and the findings behind two conditions.

`plan_deployment(spec)` is the one entry point: the operator calls it for admission and
status, the runtime's preflight and `tessera plan` call it too. Malformed specs raise
`PlanError`; a well-formed spec that cannot work yields error findings, so the operator can
report every problem at once in the `PrecisionValid` and `CapacityPlanned` conditions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from tessera.runtime.capabilities import FP8_KV_MIN_COMPUTE_CAPABILITY, KV_HANDOFF_CONVERSIONS
from tessera.runtime.config import FORMATS_FOR_DTYPE, DecodeAttentionImpl, KernelImpl
from tessera.runtime.fetch.source import is_remote
from tessera.runtime.planner.architecture import Architecture, resolve_architecture
from tessera.runtime.planner.decode_attention import flashmla_problem
from tessera.runtime.planner.engine import (
    GiB,
    engine_defaults,
    pool_tokens,
    static_budget_bytes,
)
from tessera.runtime.planner.errors import PlanError
from tessera.runtime.planner.kv import (
    KV_DTYPES,
    handover_staging_bytes_per_gpu,
    kv_bytes_per_token_per_gpu,
    kv_sizing_bytes_per_token,
)
from tessera.runtime.planner.weights import (
    FP8_BLOCK,
    QUANTIZABLE,
    Module,
    WeightScheme,
    checkpoint_bytes,
    weight_bytes_per_gpu,
)

# Defaults for optional spec fields, the same as the ModelDeployment CRD's, except that a
# missing memFractionStatic means SGLang's own rule (engine.py).
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GPU = {"product": "H200", "memoryGiB": 141, "computeCapability": "9.0",
               "perNode": DEFAULT_GPUS_PER_NODE}
DEFAULT_REPLICAS = 1
DEFAULT_TENSOR_PARALLEL = 8
DEFAULT_EXPERT_PARALLEL = 1
DEFAULT_ATTENTION_DATA_PARALLEL = 1
DEFAULT_WEIGHTS_DTYPE = "bf16"
DEFAULT_INT4_GROUP_SIZE = 128
DEFAULT_KV_DTYPE = "bf16"
DEFAULT_PAGE_SIZE = 64  # FlashMLA and SGLang's DSA models use 64-token pages
DEFAULT_CONTEXT_LENGTH = 131072

# Context lengths of the comparison table and of status.
TABLE_CONTEXTS = (4096, 32768, 131072)

Severity = Literal["error", "warning"]
ConditionType = Literal["PrecisionValid", "CapacityPlanned"]
PRECISION: ConditionType = "PrecisionValid"
CAPACITY: ConditionType = "CapacityPlanned"


@dataclass(frozen=True)
class Finding:
    severity: Severity
    reason: str  # CamelCase, for a condition's reason
    message: str  # what is wrong and what to change
    condition: ConditionType


@dataclass(frozen=True)
class Condition:
    type: ConditionType
    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class PhaseSpec:
    """One pool of identical SGLang servers, defaults applied."""

    name: str  # prefill | decode | single
    replicas: int
    tensor_parallel: int
    expert_parallel: int
    attention_data_parallel: int
    weights: WeightScheme
    kv_dtype: str
    page_size: int
    mem_fraction_static: float | None  # None: SGLang's default rule
    nodes: int = 1  # nodes one replica spans (tensor_parallel over the node's GPUs)
    # kernels.decodeAttention as the spec says it; None: the measured winner (decode_attention.py)
    decode_attention: DecodeAttentionImpl | None = None
    w4a16: KernelImpl | None = None  # kernels.w4a16 likewise (w4a16.py)
    weights_format: str | None = None  # weights.format as the spec says it

    @property
    def checkpoint_format(self) -> str:
        """The weights' checkpoint format; unset, the first that can hold the dtype (int4:
        compressed-tensors)."""
        return self.weights_format or FORMATS_FOR_DTYPE[self.weights.dtype][0]

    @property
    def attention_tp(self) -> int:
        return self.tensor_parallel // self.attention_data_parallel


@dataclass(frozen=True)
class PhasePlan:
    spec: PhaseSpec
    context_length: int
    mem_fraction_static: float
    weights_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int  # what a token occupies
    kv_pool_bytes_per_gpu: int  # the budget SGLang sizes the pool from; never negative
    # What the pool really takes beyond that budget (FP8 DSA pools only, see kv.py).
    kv_bytes_over_budget_per_gpu: int
    kv_tokens_per_replica: int
    max_concurrent_requests: int  # at context_length
    concurrency_at: dict[int, int]  # context length -> concurrent requests (TABLE_CONTEXTS)
    weights_fit: bool
    fits: bool  # the weights fit and one request of context_length fits
    # Prefill only: staging to convert its KV into the decode's dtype at the handover; it comes
    # out of the memory SGLang keeps beside the static pool (activations, CUDA graphs).
    handover_staging_bytes_per_gpu: int = 0

    def to_status(self) -> dict[str, Any]:
        s = self.spec
        return {
            "precision": {"weights": s.weights.dtype, "kvCache": s.kv_dtype},
            "capacity": {
                "gpusPerReplica": s.tensor_parallel,
                "nodesPerReplica": s.nodes,
                "memFractionStatic": self.mem_fraction_static,
                "weightsGiBPerGPU": _gib(self.weights_bytes_per_gpu),
                "kvPoolGiBPerGPU": _gib(self.kv_pool_bytes_per_gpu),
                "kvBytesPerTokenPerGPU": self.kv_bytes_per_token_per_gpu,
                "kvTokensPerReplica": self.kv_tokens_per_replica,
                "contextLength": self.context_length,
                "maxConcurrentRequests": self.max_concurrent_requests,
                "maxConcurrentRequestsAt": {str(k): v for k, v in self.concurrency_at.items()},
                "fits": self.fits,
                "handoverStagingGiBPerGPU": _gib(self.handover_staging_bytes_per_gpu),
            },
        }


@dataclass(frozen=True)
class DeploymentPlan:
    architecture: Architecture
    context_length: int
    gpu_memory_bytes: int
    phases: dict[str, PhasePlan]
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def condition(self, type_: ConditionType) -> Condition:
        """The condition `type_` as the findings decide it: False on any error, with the
        first error's reason and every error's message; True with warnings in the message."""
        own = [f for f in self.findings if f.condition == type_]
        errors = [f for f in own if f.severity == "error"]
        if errors:
            return Condition(type_, False, errors[0].reason, " ".join(f.message for f in errors))
        message = " ".join(f.message for f in own) or _OK_MESSAGE[type_]
        return Condition(type_, True, _OK_REASON[type_], message)

    def to_status(self) -> dict[str, Any]:
        """JSON-able per-phase precision and capacity for the ModelDeployment status."""
        return {name: p.to_status() for name, p in self.phases.items()}


_OK_REASON = {PRECISION: "PrecisionSupported", CAPACITY: "Fits"}
_OK_MESSAGE = {PRECISION: "Every phase's weight and KV-cache precision is supported.",
               CAPACITY: "Every phase fits its GPUs at the requested context length."}


def plan_deployment(spec: Mapping[str, Any]) -> DeploymentPlan:
    """The capacity plan and findings for a ModelDeployment `spec` (the CRD's spec dict)."""
    _require_mapping(spec, "spec")
    arch = _architecture(spec)
    context = _positive_int(_mapping(spec, "model"), "contextLength", "spec.model",
                            default=DEFAULT_CONTEXT_LENGTH)
    gpu = {**DEFAULT_GPU, **_mapping(_mapping(spec, "nodePool"), "gpu", "spec.nodePool")}
    memory_bytes = int(_positive_number(gpu, "memoryGiB", "spec.nodePool.gpu") * GiB)
    capability = _compute_capability(gpu.get("computeCapability"))
    per_node = _positive_int(gpu, "perNode", "spec.nodePool.gpu", default=DEFAULT_GPUS_PER_NODE)

    phases = [_phase_spec(name, spec[name], arch, per_node) for name in _phase_names(spec)]
    findings: list[Finding] = []
    plans: dict[str, PhasePlan] = {}
    for phase in phases:
        findings += _phase_rules(phase, arch, capability)
        plan = plan_phase(arch, phase, context, memory_bytes)
        findings += _capacity_findings(plan, memory_bytes)
        plans[phase.name] = plan
    findings += _handoff_rules(plans, arch)
    findings += _download_findings(spec, phases, arch)
    if "prefill" in plans and "decode" in plans:
        staging = handover_staging_bytes_per_gpu(
            arch, plans["prefill"].spec.kv_dtype, plans["decode"].spec.kv_dtype)
        plans["prefill"] = replace(plans["prefill"], handover_staging_bytes_per_gpu=staging)
    if arch.max_position_embeddings is not None and context > arch.max_position_embeddings:
        findings.append(Finding(
            "warning", "ContextBeyondModel",
            f"contextLength {context} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}; quality past it is not what the model was "
            "trained for.", CAPACITY))
    return DeploymentPlan(arch, context, memory_bytes, plans, findings)


def plan_phase(arch: Architecture, phase: PhaseSpec, context_length: int,
               gpu_memory_bytes: int) -> PhasePlan:
    """Memory and capacity of one phase: weights, KV pool, tokens and concurrency."""
    fraction = phase.mem_fraction_static
    if fraction is None:
        fraction = engine_defaults(gpu_memory_bytes / (1 << 20), phase.tensor_parallel,
                                   phase.attention_data_parallel, phase.name,
                                   arch.is_mla).mem_fraction_static
    weights = weight_bytes_per_gpu(arch, phase.weights, phase.tensor_parallel,
                                   phase.attention_data_parallel)
    per_token = kv_bytes_per_token_per_gpu(arch, phase.kv_dtype, phase.attention_tp)
    sizing = kv_sizing_bytes_per_token(arch, phase.kv_dtype, phase.attention_tp)
    pool = static_budget_bytes(gpu_memory_bytes, fraction) - weights
    # Each attention-DP rank has its own pool; within one, MLA latents are replicated and GQA
    # heads are split, so per_token already is one GPU's share of a token.
    gpu_tokens = pool_tokens(pool, sizing, phase.page_size)
    tokens = gpu_tokens * phase.attention_data_parallel

    def concurrency(length: int) -> int:
        return tokens // _round_up(length, phase.page_size)

    return PhasePlan(
        spec=phase,
        context_length=context_length,
        mem_fraction_static=fraction,
        weights_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=per_token,
        kv_pool_bytes_per_gpu=max(pool, 0),
        kv_bytes_over_budget_per_gpu=gpu_tokens * (per_token - sizing),
        kv_tokens_per_replica=tokens,
        max_concurrent_requests=concurrency(context_length),
        concurrency_at={n: concurrency(n) for n in TABLE_CONTEXTS},
        weights_fit=pool > 0,
        fits=pool > 0 and concurrency(context_length) >= 1,
    )


# Precision variants `tessera plan` puts side by side: (weights dtype, KV dtype).
PRECISION_VARIANTS = (("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8_e4m3"),
                      ("int4", "bf16"), ("int4", "fp8_e4m3"))


def compare_precisions(spec: Mapping[str, Any]) -> dict[str, list[PhasePlan]]:
    """Each phase of `spec` planned under every precision variant (parallelism, page size
    and group size kept), for the side-by-side table."""
    plan = plan_deployment(spec)
    out: dict[str, list[PhasePlan]] = {}
    for name, chosen in plan.phases.items():
        base = chosen.spec
        out[name] = [
            chosen if (w, kv) == (base.weights.dtype, base.kv_dtype) else
            plan_phase(plan.architecture,
                       replace(base, kv_dtype=kv,
                               weights=WeightScheme.of(w, base.weights.group_size,
                                                       base.weights.symmetric)),
                       plan.context_length, plan.gpu_memory_bytes)
            for w, kv in PRECISION_VARIANTS
        ]
    return out


# ---------------------------------------------------------------------------- rules


def _phase_rules(phase: PhaseSpec, arch: Architecture,
                 capability: tuple[int, int]) -> list[Finding]:
    out: list[Finding] = []
    p, ep = phase.name, phase.expert_parallel

    def parallel(message: str) -> None:
        out.append(Finding("error", "InvalidParallelism", f"{p}: {message}", CAPACITY))

    if arch.is_moe and arch.n_routed_experts % ep:
        parallel(f"expertParallel {ep} must divide the {arch.n_routed_experts} routed experts.")
    if arch.num_attention_heads % phase.attention_tp:
        parallel(f"the {arch.num_attention_heads} attention heads do not split over "
                 f"{phase.attention_tp} attention-TP ranks; pick tensorParallel / "
                 "attentionDataParallel that divides them.")

    if phase.kv_dtype == "fp8_e4m3" and capability < FP8_KV_MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, FP8_KV_MIN_COMPUTE_CAPABILITY))
        have = ".".join(map(str, capability))
        out.append(Finding(
            "error", "FP8KVCacheUnsupported",
            f"{p}: an FP8 KV cache needs GPU compute capability {need} or newer, the node "
            f"pool's GPU has {have}; use kvCache.dtype bf16 or a newer GPU pool.", PRECISION))
    if p == "prefill" and phase.weights.dtype == "int4":
        out.append(Finding(
            "warning", "Int4WeightsOnPrefill",
            "prefill: INT4 weights save memory but prefill is compute-bound and unpacking "
            "makes it slower (about 15%); fp8 weights are the usual prefill choice.",
            PRECISION))
    if arch.has_indexer and phase.page_size != 64:
        out.append(Finding(
            "error", "PageSizeUnsupported",
            f"{p}: SGLang runs models with a sparse-attention indexer with 64-token pages "
            f"whatever the flag says; set kvCache.pageSize to 64 (got {phase.page_size}) so the "
            "plan and the engine agree.", PRECISION))
    if phase.decode_attention == "flashmla":
        problem = flashmla_problem(arch, phase.page_size)
        if problem is not None:
            out.append(Finding(
                "error", "DecodeAttentionUnsupported",
                f"{p}: kernels.decodeAttention flashmla: {problem}; leave decodeAttention unset "
                "(the operator picks the fastest measured that runs here) or set it to sglang.",
                PRECISION))
    return out + _alignment_rules(phase, arch)


def _alignment_rules(phase: PhaseSpec, arch: Architecture) -> list[Finding]:
    """Quantized matrices split by TP must split on whole quantization groups/blocks."""
    scheme = phase.weights
    block = scheme.group_size if scheme.dtype == "int4" else FP8_BLOCK
    moe_tp = phase.tensor_parallel // phase.expert_parallel
    widths = {
        Module.ROUTED_EXPERTS: (arch.moe_intermediate_size, moe_tp) if arch.is_moe else None,
        Module.SHARED_EXPERTS: (arch.n_shared_experts * arch.moe_intermediate_size,
                                phase.tensor_parallel) if arch.n_shared_experts else None,
        Module.DENSE_MLP: (arch.intermediate_size, phase.tensor_parallel)
        if arch.dense_layers else None,
    }
    out = []
    for module, width in widths.items():
        if width is None or scheme.dtype_of(module) == "bf16":
            continue
        size, ranks = width
        if size % ranks or (size // ranks) % block:
            out.append(Finding(
                "error", "QuantGroupMisaligned",
                f"{phase.name}: {module.value} width {size} split over {ranks} ranks gives "
                f"{size / ranks:g} per rank, not a multiple of the {scheme.dtype} "
                f"{'group' if scheme.dtype == 'int4' else 'block'} of {block}; lower "
                "tensorParallel, raise expertParallel, or use a smaller groupSize.", PRECISION))
    return out


def _capacity_findings(plan: PhasePlan, memory_bytes: int) -> list[Finding]:
    s = plan.spec
    if not plan.weights_fit:
        budget = static_budget_bytes(memory_bytes, plan.mem_fraction_static)
        return [Finding(
            "error", "InsufficientGPUMemory",
            f"{s.name}: weights need {_gib(plan.weights_bytes_per_gpu)} GiB per GPU but the "
            f"static budget is {_gib(budget)} GiB (memFractionStatic "
            f"{plan.mem_fraction_static} of what is free on a {_gib(memory_bytes)} GiB GPU), "
            "leaving nothing for the KV cache; raise tensorParallel or use smaller weights "
            "(fp8, int4).", CAPACITY)]
    if not plan.fits:
        return [Finding(
            "error", "ContextExceedsKVCache",
            f"{s.name}: one replica holds {plan.kv_tokens_per_replica} KV tokens, fewer than "
            f"one request at contextLength {plan.context_length}; lower contextLength, use an "
            "fp8_e4m3 KV cache or smaller weights, or raise tensorParallel.", CAPACITY)]
    if plan.kv_bytes_over_budget_per_gpu:
        over = plan.kv_bytes_over_budget_per_gpu
        return [Finding(
            "warning", "KVPoolOverBudget",
            f"{s.name}: SGLang counts FP8 sparse-attention KV latents at 576 bytes but stores "
            f"656, so the pool takes {_gib(over)} GiB per GPU more than its budget, out of the "
            "memory kept for activations and CUDA graphs; if the servers run out of memory, "
            f"set memFractionStatic to {plan.mem_fraction_static - over / memory_bytes:.3f}.",
            CAPACITY)]
    return []


def _download_findings(spec: Mapping[str, Any], phases: list[PhaseSpec],
                       arch: Architecture) -> list[Finding]:
    """hf/s3/gs weights without a cache claim are downloaded by every pod at every start."""
    out = []
    for phase in phases:
        weights = spec[phase.name].get("weights") or {}
        uri = str(weights.get("uri", ""))
        if not is_remote(uri) or (weights.get("cache") or {}).get("pvc"):
            continue
        size = checkpoint_bytes(arch, phase.weights)
        out.append(Finding(
            "warning", "WeightsDownloadedPerReplica",
            f"{phase.name}: every replica ({phase.replicas}) downloads about {size / 1e9:.0f} GB "
            f"from {uri} at each start (no weights.cache) onto its node's local disk, which each "
            "pod requests (ephemeral-storage); name a claim in weights.cache.pvc to fetch once "
            "and mount it read-only.", CAPACITY))
    return out


def _handoff_rules(plans: Mapping[str, PhasePlan], arch: Architecture) -> list[Finding]:
    if "prefill" not in plans or "decode" not in plans:
        return []
    pair = (plans["prefill"].spec.kv_dtype, plans["decode"].spec.kv_dtype)
    if pair[0] == pair[1] or (pair in KV_HANDOFF_CONVERSIONS and arch.is_mla):
        return []
    why = ("the handover conversion handles MLA latents only and this model's attention is "
           "GQA/MHA" if pair in KV_HANDOFF_CONVERSIONS else
           "this runtime has no conversion for that pair")
    return [Finding(
        "error", "KVCacheDtypeMismatch",
        f"prefill stores its KV cache as {pair[0]} and decode as {pair[1]}, but {why}; use "
        "the same kvCache.dtype in both phases.", PRECISION)]


# ---------------------------------------------------------------------------- spec reading


def _architecture(spec: Mapping[str, Any]) -> Architecture:
    model = _mapping(spec, "model", "spec", required=True)
    architecture = _mapping(model, "architecture", "spec.model", required=True)
    preset = architecture.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise PlanError(f"spec.model.architecture.preset must be a string, got {preset!r}")
    return resolve_architecture(preset, _mapping(architecture, "config",
                                                 "spec.model.architecture"))


def _phase_names(spec: Mapping[str, Any]) -> list[str]:
    present = [n for n in ("prefill", "decode", "single") if spec.get(n) is not None]
    if present in (["prefill", "decode"], ["single"]):
        return present
    raise PlanError(
        f"spec has phase(s) {present or 'none'}; give either both spec.prefill and "
        "spec.decode (disaggregated) or only spec.single (one pool)")


def nodes_per_replica(tensor_parallel: int, gpus_per_node: int) -> int:
    """Nodes one replica spans: one while its GPUs fit a node, else whole nodes."""
    return max(1, tensor_parallel // gpus_per_node)


def _phase_spec(name: str, raw: Any, arch: Architecture, gpus_per_node: int) -> PhaseSpec:
    path = f"spec.{name}"
    _require_mapping(raw, path)
    weights = _mapping(raw, "weights", path)
    kv = _mapping(raw, "kvCache", path)
    dtype = weights.get("dtype", DEFAULT_WEIGHTS_DTYPE)
    group = _positive_int(weights, "groupSize", f"{path}.weights",
                          default=DEFAULT_INT4_GROUP_SIZE)
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise PlanError(f"{path}.weights.symmetric must be true or false, got {symmetric!r}")
    quantize = weights.get("quantize")
    modules = None if quantize is None else _modules(quantize, f"{path}.weights.quantize")
    try:
        scheme = WeightScheme.of(dtype, group, symmetric, modules)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    kv_dtype = kv.get("dtype", DEFAULT_KV_DTYPE)
    if kv_dtype not in KV_DTYPES:
        raise PlanError(f"{path}.kvCache.dtype {kv_dtype!r} is not one of {list(KV_DTYPES)}")
    fraction = raw.get("memFractionStatic")
    if fraction is not None and (isinstance(fraction, bool)
                                 or not isinstance(fraction, int | float)
                                 or not 0 < fraction < 1):
        raise PlanError(f"{path}.memFractionStatic must be a number between 0 and 1 "
                        f"(exclusive), got {fraction!r}")
    tp = _positive_int(raw, "tensorParallel", path, default=DEFAULT_TENSOR_PARALLEL)
    ep = _positive_int(raw, "expertParallel", path, default=DEFAULT_EXPERT_PARALLEL)
    dp = _positive_int(raw, "attentionDataParallel", path,
                       default=DEFAULT_ATTENTION_DATA_PARALLEL)
    for key, n in (("expertParallel", ep), ("attentionDataParallel", dp)):
        if tp % n:
            raise PlanError(f"{path}.{key} {n} must divide tensorParallel {tp}: SGLang runs it "
                            "inside the tensor-parallel group")
    if tp > gpus_per_node and tp % gpus_per_node:
        raise PlanError(f"{path}.tensorParallel {tp} spans nodes of {gpus_per_node} GPUs "
                        "(nodePool.gpu.perNode) but is not a multiple of it: a replica wider "
                        "than one node takes whole nodes")
    return PhaseSpec(
        name=name,
        replicas=_positive_int(raw, "replicas", path, default=DEFAULT_REPLICAS, minimum=0),
        tensor_parallel=tp,
        expert_parallel=ep,
        attention_data_parallel=dp,
        weights=scheme,
        kv_dtype=kv_dtype,
        page_size=_positive_int(kv, "pageSize", f"{path}.kvCache", default=DEFAULT_PAGE_SIZE),
        mem_fraction_static=None if fraction is None else float(fraction),
        nodes=nodes_per_replica(tp, gpus_per_node),
        decode_attention=_kernel_switch(raw, path, "decodeAttention", DecodeAttentionImpl),
        w4a16=_kernel_switch(raw, path, "w4a16", KernelImpl),
        weights_format=weights.get("format"),
    )


def _kernel_switch(raw: Mapping[str, Any], path: str, name: str, impls: Any) -> Any:
    """`kernels.<name>` as the spec sets it (one of the Literal `impls`), or None when unset."""
    value = _mapping(raw, "kernels", path).get(name)
    if value is not None and value not in get_args(impls):
        raise PlanError(f"{path}.kernels.{name} {value!r} is not one of {list(get_args(impls))}")
    return value


def _modules(raw: Any, path: str) -> list[Module]:
    names = {m.value: m for m in QUANTIZABLE}
    if not isinstance(raw, list) or any(n not in names for n in raw):
        raise PlanError(f"{path} must be a list of {sorted(names)}, got {raw!r}")
    return [names[n] for n in raw]


def _compute_capability(raw: Any) -> tuple[int, int]:
    text = str(raw)
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and (not dot or minor.isdigit())):
        raise PlanError(f"spec.nodePool.gpu.computeCapability must look like \"9.0\", "
                        f"got {raw!r}")
    return int(major), int(minor or 0)


def _require_mapping(value: Any, path: str) -> None:
    if not isinstance(value, Mapping):
        raise PlanError(f"{path} must be a mapping, got {type(value).__name__}")


def _mapping(parent: Mapping[str, Any], key: str, path: str = "spec",
             required: bool = False) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None:
        if required:
            raise PlanError(f"{path}.{key} is required")
        return {}
    _require_mapping(value, f"{path}.{key}")
    return value


def _positive_int(parent: Mapping[str, Any], key: str, path: str, default: int,
                  minimum: int = 1) -> int:
    value = parent.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{path}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_number(parent: Mapping[str, Any], key: str, path: str) -> float:
    value = parent.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PlanError(f"{path}.{key} must be a positive number, got {value!r}")
    return float(value)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _gib(n: float) -> float:
    return round(n / GiB, 2)
