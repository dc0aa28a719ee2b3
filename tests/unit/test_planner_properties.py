"""Capacity planner properties over random architectures and deployments (hypothesis)."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tessera.runtime.planner import (
    Module,
    WeightScheme,
    kv_bytes_per_token_per_gpu,
    plan_deployment,
    plan_phase,
    resolve_architecture,
    weight_bytes_per_gpu,
)
from tessera.runtime.planner.engine import GiB
from tessera.runtime.planner.kv import kv_sizing_bytes_per_token
from tessera.runtime.planner.plan import PhaseSpec

EVERY_LINEAR = [Module.ATTENTION, Module.DENSE_MLP, Module.SHARED_EXPERTS,
                Module.ROUTED_EXPERTS]
TPS = (1, 2, 4, 8, 16, 32)


@st.composite
def architectures(draw):
    """MLA (optionally with a DSA indexer) or GQA, dense or MoE; widths are multiples of 128
    as in real models, so every quantization group and block is whole."""
    heads = draw(st.sampled_from([8, 16, 32, 64]))
    config = {
        "hidden_size": 128 * draw(st.integers(1, 24)),
        "num_hidden_layers": draw(st.integers(1, 8)),
        "vocab_size": 128 * draw(st.integers(1, 64)),
        "num_attention_heads": heads,
        "intermediate_size": 128 * draw(st.integers(1, 32)),
        "first_k_dense_replace": draw(st.integers(0, 2)),
    }
    if draw(st.booleans()):
        config |= {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                   "v_head_dim": 128, "q_lora_rank": draw(st.sampled_from([None, 1536]))}
        if draw(st.booleans()):
            config |= {"index_n_heads": 32, "index_head_dim": 128}
    else:
        config |= {"num_key_value_heads": draw(st.sampled_from([1, 2, 4, 8])),
                   "head_dim": draw(st.sampled_from([64, 128]))}
    if draw(st.booleans()):
        config |= {"n_routed_experts": 32 * draw(st.integers(1, 8)),
                   "n_shared_experts": draw(st.integers(0, 2)),
                   "moe_intermediate_size": 128 * draw(st.integers(1, 16)),
                   "num_experts_per_tok": 8}
    return resolve_architecture(None, config)


def phase(tp: int, weights: str = "bf16", kv: str = "bf16", fraction: float | None = 0.9,
          dp: int = 1) -> PhaseSpec:
    return PhaseSpec("decode", 1, tp, 1, dp, WeightScheme.of(weights), kv, 64, fraction)


@settings(max_examples=60, deadline=None)
@given(architectures(), st.sampled_from(TPS[:-1]), st.sampled_from(["bf16", "fp8_e4m3"]),
       st.integers(4, 200))
def test_more_gpus_never_give_fewer_tokens(arch, tp, kv, memory_gib):
    # At a fixed memFractionStatic, for any architecture and memory size.
    fewer = plan_phase(arch, phase(tp, kv=kv), 4096, memory_gib * GiB)
    more = plan_phase(arch, phase(2 * tp, kv=kv), 4096, memory_gib * GiB)
    assert more.kv_tokens_per_replica >= fewer.kv_tokens_per_replica
    assert more.weights_bytes_per_gpu <= fewer.weights_bytes_per_gpu


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["kimi-k2", "deepseek-v3", "glm-5"]), st.sampled_from(["single", "decode"]),
       st.sampled_from(["bf16", "fp8", "int4"]), st.sampled_from(["bf16", "fp8_e4m3"]))
def test_more_gpus_never_give_fewer_tokens_under_sglangs_own_fraction(preset, mode, weights, kv):
    # SGLang reserves 1 GiB more per 8 TP ranks, which a model as large as the presets always
    # earns back in weights per GPU.
    def tokens(tp: int) -> int:
        phase = {"tensorParallel": tp, "weights": {"dtype": weights}, "kvCache": {"dtype": kv}}
        spec = {"model": {"architecture": {"preset": preset}, "contextLength": 4096},
                mode: phase, **({"prefill": phase} if mode == "decode" else {})}
        return plan_deployment(spec).phases[mode].kv_tokens_per_replica

    counts = [tokens(tp) for tp in TPS]
    assert counts == sorted(counts)


@settings(max_examples=60, deadline=None)
@given(architectures(), st.sampled_from(TPS), st.integers(8, 200))
def test_fp8_kv_holds_about_twice_the_tokens(arch, tp, memory_gib):
    bf16 = kv_bytes_per_token_per_gpu(arch, "bf16", tp)
    fp8 = kv_bytes_per_token_per_gpu(arch, "fp8_e4m3", tp)
    if arch.has_indexer:
        # FP8 latents carry FP32 scales and BF16 rope; the indexer keys are FP8 either way.
        scales_and_rope = 16 + 64
        indexer = 132
        layers = arch.num_hidden_layers
        assert fp8 - indexer * layers == (bf16 - indexer * layers) // 2 + scales_and_rope * layers
    else:
        assert 2 * fp8 == bf16
    a = plan_phase(arch, phase(tp, kv="bf16"), 4096, memory_gib * GiB)
    b = plan_phase(arch, phase(tp, kv="fp8_e4m3"), 4096, memory_gib * GiB)
    # Same pool, tokens in whole pages of 64: the ratio is the ratio of SGLang's sizing cells
    # (the stored bytes, except FP8 DSA latents, sized at 576 bytes) up to one page.
    pool = a.kv_pool_bytes_per_gpu
    assert b.kv_pool_bytes_per_gpu == pool
    fp8_cell = kv_sizing_bytes_per_token(arch, "fp8_e4m3", tp)
    assert abs(b.kv_tokens_per_replica - pool // fp8_cell) < 64
    assert abs(a.kv_tokens_per_replica - pool // bf16) < 64
    if not arch.has_indexer:
        assert 2 * a.kv_tokens_per_replica <= b.kv_tokens_per_replica
        assert b.kv_tokens_per_replica <= 2 * a.kv_tokens_per_replica + 2 * 64


@settings(max_examples=60, deadline=None)
@given(architectures(), st.sampled_from(TPS), st.sampled_from([32, 128]), st.booleans())
def test_int4_below_fp8_below_bf16_per_gpu(arch, tp, group, symmetric):
    def per_gpu(dtype: str) -> int:
        scheme = WeightScheme.of(dtype, group, symmetric,
                                 None if dtype == "bf16" else EVERY_LINEAR)
        return weight_bytes_per_gpu(arch, scheme, tp)

    assert per_gpu("int4") < per_gpu("fp8") < per_gpu("bf16")


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["kimi-k2", "deepseek-v3", "glm-5"]), st.sampled_from(TPS),
       st.sampled_from(["bf16", "fp8", "int4"]), st.sampled_from(["bf16", "fp8_e4m3"]),
       st.integers(16, 300), st.integers(1, 1 << 20), st.sampled_from([1, 2, 4, 8]),
       st.one_of(st.none(), st.floats(0.1, 0.95)))
def test_plan_never_reports_negative_room(preset, tp, weights, kv, memory_gib, context, dp,
                                          fraction):
    assume(tp % dp == 0)  # anything else is rejected as a malformed spec
    single = {"tensorParallel": tp, "attentionDataParallel": dp, "weights": {"dtype": weights},
              "kvCache": {"dtype": kv}}
    if fraction is not None:
        single["memFractionStatic"] = fraction
    plan = plan_deployment({
        "model": {"name": "m", "architecture": {"preset": preset}, "contextLength": context},
        "nodePool": {"gpu": {"memoryGiB": memory_gib}},
        "single": single,
    })
    p = plan.phases["single"]
    assert p.kv_pool_bytes_per_gpu >= 0 and p.kv_tokens_per_replica >= 0
    assert p.max_concurrent_requests >= 0 and min(p.concurrency_at.values()) >= 0
    assert p.kv_tokens_per_replica % p.spec.page_size == 0
    status = p.to_status()["capacity"]
    assert status["kvPoolGiBPerGPU"] >= 0 and status["kvTokensPerReplica"] >= 0
    if not p.weights_fit:
        assert p.kv_tokens_per_replica == 0 and not plan.ok
        assert plan.condition("CapacityPlanned").reason == "InsufficientGPUMemory"
