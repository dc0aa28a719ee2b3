"""The decisions of the decode-slice benchmark (``bench/decode_slice.py``), as pure functions.

No torch here: what the slice is (shapes per GPU from the planner's presets), how big its KV
pool is (the planner's memory model for a real deployment spec), which requests it admits,
which GPU of the expert-parallel group it plays in each layer, and how one measured slice
scales to the whole model.

Layout modelled (the planner's default and the README's Kimi K2 example): one decode replica of
8 GPUs, attention tensor-parallel over all 8 (each GPU computes 1/8 of the heads and holds the
whole MLA latent cache of every request), MoE expert-parallel over the same 8 (each GPU holds
1/8 of the routed experts whole; the shared expert and the dense MLP are split 8 ways).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.runtime.planner.architecture import Architecture, resolve_architecture
from tessera.runtime.planner.plan import plan_deployment

TENSOR_PARALLEL = 8
EXPERT_PARALLEL = 8
PAGE_SIZE = 64
CONCURRENCY = (1, 8, 16, 32, 64, 128)
# Full context (prompt + generated tokens) of request i is CONTEXT_MIX[i % 4]: chat-turn
# lengths, one quarter each, mean 3,840 tokens. Fixed before any run; never tuned.
CONTEXT_MIX = (1024, 2048, 4096, 8192)
WEIGHT_DTYPES = ("fp8", "int4")
KV_DTYPES = ("bf16", "fp8_e4m3")
# INT4 quantizes the same modules as the FP8 scheme (every linear layer but the embedding,
# lm_head and router), so the two configurations differ in precision only. The planner's
# INT4 default (routed experts only, as in Kimi K2's release) would keep attention in BF16.
QUANTIZED_MODULES = ("attention", "denseMLP", "sharedExperts", "routedExperts")


@dataclass(frozen=True)
class ModelChoice:
    preset: str
    int4_group: int  # the group size of the README example for this model


MODELS: dict[str, ModelChoice] = {
    "kimi-k2": ModelChoice("kimi-k2", 32),  # examples/01-kimi-k2: groupSize 32
    "glm-5": ModelChoice("glm-5", 128),  # examples/02-glm-5: the default group of 128
}


@dataclass(frozen=True)
class SliceShape:
    """One GPU's share of every matrix at TP 8 / EP 8 (attention heads split, experts whole)."""

    hidden: int
    heads: int  # attention heads on this GPU
    q_lora: int
    kv_lora: int
    rope: int
    qk_nope: int
    v_head: int
    index_heads: int  # DSA indexer (replicated); 0: none
    index_dim: int
    experts: int  # routed experts of the whole model
    local_experts: int  # routed experts on this GPU
    top_k: int
    expert_width: int
    shared_width: int  # this GPU's share of the shared expert
    dense_width: int  # this GPU's share of the dense MLP
    vocab_shard: int
    dense_layers: int
    moe_layers: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora + self.rope

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_nope + self.rope)


def slice_shape(arch: Architecture, tp: int = TENSOR_PARALLEL,
                ep: int = EXPERT_PARALLEL) -> SliceShape:  # fmt: skip
    """The per-GPU slice of an MLA + MoE architecture."""
    if not (arch.is_mla and arch.is_moe):
        raise ValueError("the decode slice models MLA attention with MoE layers")
    if arch.num_attention_heads % tp or arch.n_routed_experts % ep:
        raise ValueError(f"heads and experts must split over TP {tp} / EP {ep}")
    assert arch.kv_lora_rank is not None
    return SliceShape(
        hidden=arch.hidden_size,
        heads=arch.num_attention_heads // tp,
        q_lora=arch.q_lora_rank or 0,
        kv_lora=arch.kv_lora_rank,
        rope=arch.qk_rope_head_dim,
        qk_nope=arch.qk_nope_head_dim,
        v_head=arch.v_head_dim,
        index_heads=arch.index_n_heads,
        index_dim=arch.index_head_dim,
        experts=arch.n_routed_experts,
        local_experts=arch.n_routed_experts // ep,
        top_k=arch.num_experts_per_tok,
        expert_width=arch.moe_intermediate_size,
        shared_width=arch.n_shared_experts * arch.moe_intermediate_size // tp,
        dense_width=arch.intermediate_size // tp,
        vocab_shard=-(-arch.vocab_size // tp),
        dense_layers=arch.dense_layers,
        moe_layers=arch.moe_layers,
    )


def model_shape(name: str) -> SliceShape:
    return slice_shape(resolve_architecture(MODELS[name].preset, {}))


# ---------------------------------------------------------------------------- KV pool


def deployment_spec(preset: str, weights: str, kv_dtype: str, int4_group: int) -> dict[str, Any]:
    """A ModelDeployment spec whose decode pool is the slice's deployment: TP 8 / EP 8 on H200s.

    The prefill pool (FP8 weights, same KV dtype, as in the examples) only makes the spec a
    valid disaggregated one; the decode plan does not depend on it."""
    scheme: dict[str, Any] = {"dtype": weights, "quantize": list(QUANTIZED_MODULES)}
    if weights == "int4":
        scheme["groupSize"] = int4_group
    kv = {"dtype": kv_dtype, "pageSize": PAGE_SIZE}
    return {
        "model": {"name": preset, "architecture": {"preset": preset},
                  "contextLength": max(CONTEXT_MIX)},
        "nodePool": {"gpu": {"product": "H200", "memoryGiB": 141, "computeCapability": "9.0"}},
        "prefill": {"tensorParallel": TENSOR_PARALLEL, "weights": {"dtype": "fp8"}, "kvCache": kv},
        "decode": {"tensorParallel": TENSOR_PARALLEL, "expertParallel": EXPERT_PARALLEL,
                   "weights": scheme, "kvCache": kv},
    }  # fmt: skip


@dataclass(frozen=True)
class PoolPlan:
    """The decode pool of one configuration, from the planner (per GPU)."""

    weights_bytes: int
    pool_bytes: int
    kv_bytes_per_token: int  # all layers, as the pool stores them
    tokens: int  # tokens the pool holds (whole pages)
    mem_fraction_static: float

    @property
    def pages(self) -> int:
        return self.tokens // PAGE_SIZE


def pool_plan(model: str, weights: str, kv_dtype: str) -> PoolPlan:
    choice = MODELS[model]
    spec = deployment_spec(choice.preset, weights, kv_dtype, choice.int4_group)
    decode = plan_deployment(spec).phases["decode"]
    return PoolPlan(
        weights_bytes=decode.weights_bytes_per_gpu,
        pool_bytes=decode.kv_pool_bytes_per_gpu,
        kv_bytes_per_token=decode.kv_bytes_per_token_per_gpu,
        tokens=decode.kv_tokens_per_replica,
        mem_fraction_static=decode.mem_fraction_static,
    )


# ---------------------------------------------------------------------------- admission


def context_lengths(concurrency: int, mix: Sequence[int] = CONTEXT_MIX) -> list[int]:
    """Full context length of each of the first ``concurrency`` requests."""
    return [mix[i % len(mix)] for i in range(concurrency)]


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


def admitted(lengths: Sequence[int], free_pages: int, page_size: int = PAGE_SIZE) -> int:
    """How many requests, in order, get the pages of their full context before one does not."""
    count = 0
    for length in lengths:
        need = pages_for(length, page_size)
        if need > free_pages:
            break
        free_pages -= need
        count += 1
    return count


def fits(concurrency: int, pool_pages: int, mix: Sequence[int] = CONTEXT_MIX,
         page_size: int = PAGE_SIZE) -> bool:  # fmt: skip
    """Whether all ``concurrency`` requests are admitted at once (else: "out of memory")."""
    return admitted(context_lengths(concurrency, mix), pool_pages, page_size) == concurrency


def most_admitted(pool_pages: int, mix: Sequence[int] = CONTEXT_MIX) -> int:
    """The most requests of the mix admitted at once: where a grid of levels hides the limit
    (a pool that holds 114 shows as 64 on the grid 1..128)."""
    n = 0
    while fits(n + 1, pool_pages, mix):
        n += 1
    return n


def timed_levels(grid: Sequence[int], pool_pages: int, exact_cap: int = 0,
                 mix: Sequence[int] = CONTEXT_MIX) -> list[int]:  # fmt: skip
    """The grid's admitted levels, plus the exact most admitted when it is off the grid and at
    most ``exact_cap`` (0: grid only)."""
    levels = [c for c in grid if fits(c, pool_pages, mix)]
    exact = most_admitted(pool_pages, mix)
    if 0 < exact <= exact_cap and exact not in levels:
        levels.append(exact)
    return sorted(levels)


def max_concurrency(levels: Sequence[int], pool_pages: int,
                    mix: Sequence[int] = CONTEXT_MIX) -> int:  # fmt: skip
    """The largest level of ``levels`` that is admitted (0 if none)."""
    return max((c for c in levels if fits(c, pool_pages, mix)), default=0)


# ---------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class ExpertShare:
    """The (token, expert) pairs of one layer that land on one GPU's experts."""

    gpu: int
    tokens: tuple[int, ...]
    local_experts: tuple[int, ...]  # expert index on that GPU
    weights: tuple[float, ...]

    @property
    def pairs(self) -> int:
        return len(self.tokens)

    @property
    def distinct_experts(self) -> int:
        return len(set(self.local_experts))


def draw_routing(rng: random.Random, tokens: int, experts: int,
                 top_k: int) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
    """Uniform random top-k routing: distinct experts per token, weights summing to 1."""
    ids = [rng.sample(range(experts), top_k) for _ in range(tokens)]
    weights = []
    for _ in range(tokens):
        raw = [rng.random() + 0.05 for _ in range(top_k)]
        weights.append([w / sum(raw) for w in raw])
    return ids, weights


def expert_shares(ids: Sequence[Sequence[int]], weights: Sequence[Sequence[float]],
                  experts: int, ep: int) -> list[ExpertShare]:  # fmt: skip
    """Every GPU's share of a routing; GPU g holds experts [g E/ep, (g + 1) E/ep)."""
    per_gpu = experts // ep
    acc: list[tuple[list[int], list[int], list[float]]] = [([], [], []) for _ in range(ep)]
    for t, (row, wrow) in enumerate(zip(ids, weights, strict=True)):
        for e, w in zip(row, wrow, strict=True):
            tok, loc, wts = acc[e // per_gpu]
            tok.append(t)
            loc.append(e % per_gpu)
            wts.append(w)
    return [ExpertShare(g, tuple(t), tuple(e), tuple(w)) for g, (t, e, w) in enumerate(acc)]


def critical_share(shares: Sequence[ExpertShare]) -> ExpertShare:
    """The GPU that finishes the layer last: the most distinct experts (weight bytes streamed),
    then the most pairs. Every layer ends in a collective, so the step waits for it."""
    return max(shares, key=lambda s: (s.distinct_experts, s.pairs, -s.gpu))


# ---------------------------------------------------------------------------- scaling


def full_step_seconds(rest_s: float, layers_s: float, slice_layers: int, moe_layers: int) -> float:
    """The whole model's decode step from the slice: the once-per-step part (embedding, the
    dense layers, final norm, lm_head, integrity check) as measured, plus the measured time of
    ``slice_layers`` distinct MoE layers scaled to the model's ``moe_layers``."""
    return rest_s + layers_s * moe_layers / slice_layers


def step_samples(rest_s: Sequence[float], layers_s: Sequence[float], slice_layers: int,
                 moe_layers: int) -> list[float]:  # fmt: skip
    """Per-replay full-step samples from paired replays of the two graphs."""
    return [full_step_seconds(r, x, slice_layers, moe_layers)
            for r, x in zip(rest_s, layers_s, strict=True)]  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100])."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# ---------------------------------------------------------------------------- summaries

Row = Mapping[str, Any]


def _ok(rows: Sequence[Row], model: str, weights: str, kv: str) -> dict[int, Row]:
    mine = [r for r in rows if (r["model"], r["weights"], r["kv"]) == (model, weights, kv)]
    return {r["concurrency"]: r for r in mine if r["admitted"]}


def kv_comparison(rows: Sequence[Row], model: str, weights: str,
                  admits: Mapping[str, int]) -> dict[str, Any]:  # fmt: skip
    """FP8 vs BF16 KV with the same weights: the most requests each pool admits (``admits``,
    by KV dtype, from ``most_admitted``), peak throughput over the timed levels, and the
    per-request step time at each concurrency both timed. The peak gain is established only
    where both configurations were timed at their most admitted level (throughput still grows
    there, so an untimed limit hides the true peak)."""
    bf16, fp8 = _ok(rows, model, weights, "bf16"), _ok(rows, model, weights, "fp8_e4m3")
    if not bf16 or not fp8:
        return {}

    def peak(ok: dict[int, Row]) -> dict[str, Any]:
        c = max(ok, key=lambda k: ok[k]["tok_s"])
        return {"concurrency": c, "tok_s": ok[c]["tok_s"]}

    p_bf16, p_fp8 = peak(bf16), peak(fp8)
    both = sorted(set(bf16) & set(fp8))
    return {
        "most_admitted_bf16": admits["bf16"], "most_admitted_fp8": admits["fp8_e4m3"],
        "admitted_ratio": admits["fp8_e4m3"] / admits["bf16"],
        "peak_bf16": p_bf16, "peak_fp8": p_fp8,
        "peak_gain": p_fp8["tok_s"] / p_bf16["tok_s"] - 1,
        "peak_established": admits["bf16"] in bf16 and admits["fp8_e4m3"] in fp8,
        "per_request_slowdown": {c: fp8[c]["step_ms"] / bf16[c]["step_ms"] - 1 for c in both},
    }  # fmt: skip


def weights_comparison(rows: Sequence[Row], model: str, kv: str) -> dict[int, float]:
    """INT4 vs FP8 weights, same KV dtype: throughput gain at each concurrency both admit."""
    fp8, int4 = _ok(rows, model, "fp8", kv), _ok(rows, model, "int4", kv)
    return {c: int4[c]["tok_s"] / fp8[c]["tok_s"] - 1 for c in sorted(set(fp8) & set(int4))}


def integrity_cost(rows: Sequence[Row]) -> dict[str, float]:
    """Worst-case integrity-on cost over every admitted point: throughput loss and p95 rise."""
    ok = [r for r in rows if r["admitted"]]
    if not ok:
        return {}
    return {
        "max_throughput_loss": max(1 - r["tok_s_integrity"] / r["tok_s"] for r in ok),
        "max_p95_increase": max(r["p95_ms_integrity"] / r["p95_ms"] - 1 for r in ok),
        "median_throughput_loss": median([1 - r["tok_s_integrity"] / r["tok_s"] for r in ok]),
    }


CONFIGS = tuple((w, kv) for w in WEIGHT_DTYPES for kv in KV_DTYPES)


def config_label(weights: str, kv: str) -> str:
    return f"{weights.upper()} w / {'FP8' if kv == 'fp8_e4m3' else 'BF16'} KV"


def throughput_table(rows: Sequence[Row], model: str, levels: Sequence[int] = CONCURRENCY,
                     key: str = "tok_s", fmt: str = "{:,.0f}") -> list[str]:  # fmt: skip
    """Markdown table: one row per concurrency, one column per configuration (by default tok/s
    per replica of 8 GPUs), "OOM" where the KV pool does not admit the level."""
    head = "| concurrency | " + " | ".join(config_label(w, kv) for w, kv in CONFIGS) + " |"
    lines = [head, "|---:|" + "---:|" * len(CONFIGS)]
    index = {(r["weights"], r["kv"], r["concurrency"]): r for r in rows if r["model"] == model}
    for c in levels:
        cells = []
        for w, kv in CONFIGS:
            r = index.get((w, kv, c))
            cells.append("-" if r is None else fmt.format(r[key]) if r["admitted"] else "OOM")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines
