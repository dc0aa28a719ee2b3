"""Capacity planner: hand-computed cases, presets against public numbers, rules, errors."""

from __future__ import annotations

import dataclasses

import pytest
from tessera.runtime.planner import (
    PRESETS,
    Module,
    PlanError,
    WeightScheme,
    checkpoint_bytes,
    kv_bytes_per_token_per_gpu,
    plan_deployment,
    plan_phase,
    resolve_architecture,
    weight_bytes_per_gpu,
)
from tessera.runtime.planner import plan as plan_module
from tessera.runtime.planner.engine import (
    UNUSABLE_BEFORE_LOAD_BYTES,
    GiB,
    engine_defaults,
    prefill_graph_sizes,
)
from tessera.runtime.planner.kv import kv_sizing_bytes_per_token
from tessera.runtime.planner.weights import matrix_bytes, model_tensors

# A small DeepSeek-style model: MLA with a query latent, 1 dense + 1 MoE layer.
SMALL_MLA = {
    "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100, "num_attention_heads": 4,
    "intermediate_size": 96, "kv_lora_rank": 32, "q_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1,
    "moe_intermediate_size": 32, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
}
# A small dense GQA model: 8 query heads over 2 KV heads of 16.
SMALL_GQA = {
    "hidden_size": 128, "num_hidden_layers": 3, "vocab_size": 1000, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 256,
    "tie_word_embeddings": True,
}


def spec(**phases: dict) -> dict:
    return {
        "model": {"name": "m", "architecture": {"preset": "kimi-k2"}, "contextLength": 32768},
        "nodePool": {"gpu": {"product": "H200", "memoryGiB": 141, "computeCapability": "9.0"}},
        **phases,
    }


FP8_PREFILL = {"tensorParallel": 8, "weights": {"dtype": "fp8"}, "kvCache": {"dtype": "bf16"}}
INT4_DECODE = {"tensorParallel": 8, "weights": {"dtype": "int4"}, "kvCache": {"dtype": "bf16"}}


# ---------------------------------------------------------------- hand-computed: small MLA


def test_small_mla_parameter_count_by_hand():
    arch = resolve_architecture(None, SMALL_MLA)
    embed = lm_head = 100 * 64
    final_norm, layer_norms = 64, 2 * 64 * 2
    # per layer: q_a 16x64, q_a_norm 16, q_b (4*16)x16, kv_a (32+8)x64, kv_a_norm 32,
    # kv_b (4*(8+8))x32, o (64)x(4*8)
    attention = 2 * (1024 + 16 + 1024 + 2560 + 32 + 2048 + 2048)
    dense = 192 * 64 + 64 * 96  # gate_up + down, 1 layer
    router = 4 * 64
    shared = 64 * 64 + 64 * 32
    routed = 4 * (64 * 64 + 64 * 32)
    total = (embed + lm_head + final_norm + layer_norms + attention + dense + router + shared
             + routed)
    assert total == 80032
    assert checkpoint_bytes(arch, WeightScheme.of("bf16")) == 2 * total


def test_small_mla_bf16_bytes_per_gpu_by_hand():
    arch = resolve_architecture(None, SMALL_MLA)
    # TP 2: embedding, lm_head, q_b/kv_b/o, dense, shared and routed experts halve;
    # norms, q_a, kv_a and the router stay whole on every GPU.
    replicated = 128 + 512 + 2 * (2048 + 32 + 5120 + 64) + 512
    split = (12800 + 12800 + 2 * (2048 + 4096 + 4096) + 36864 + 12288 + 49152) // 2
    assert weight_bytes_per_gpu(arch, WeightScheme.of("bf16"), tp=2) == replicated + split
    assert replicated + split == 87872


def test_small_mla_kv_bytes_by_hand():
    arch = resolve_architecture(None, SMALL_MLA)
    # (kv_lora_rank 32 + rope 8) per layer x 2 layers; the same on every attention-TP rank
    for tp in (1, 2, 4):
        assert kv_bytes_per_token_per_gpu(arch, "bf16", tp) == 2 * 40 * 2
        assert kv_bytes_per_token_per_gpu(arch, "fp8_e4m3", tp) == 2 * 40


def test_small_mla_phase_plan_by_hand():
    arch = resolve_architecture(None, SMALL_MLA)
    phase = plan_module.PhaseSpec("decode", 1, 2, 1, 1, WeightScheme.of("bf16"), "bf16", 64, 0.5)
    plan = plan_phase(arch, phase, context_length=1000, gpu_memory_bytes=3 * GiB)
    pool = (3 * GiB - UNUSABLE_BEFORE_LOAD_BYTES) // 2 - 87872
    assert plan.kv_pool_bytes_per_gpu == pool
    tokens = pool // 160 // 64 * 64  # whole pages of 64
    assert plan.kv_tokens_per_replica == tokens
    assert plan.max_concurrent_requests == tokens // 1024  # 1000 rounds up to 16 pages
    assert plan.fits


def test_attention_data_parallel_multiplies_pools():
    arch = resolve_architecture(None, SMALL_MLA)
    base = plan_module.PhaseSpec("decode", 1, 4, 1, 1, WeightScheme.of("bf16"), "bf16", 64, 0.5)
    dp = dataclasses.replace(base, attention_data_parallel=4)
    one, four = (plan_phase(arch, p, 1000, 3 * GiB) for p in (base, dp))
    # With attention DP 4 each GPU is its own attention group: its own pool, replicated
    # attention weights (so a slightly smaller pool per GPU) and 4 pools per replica.
    assert four.weights_bytes_per_gpu > one.weights_bytes_per_gpu
    per_gpu = four.kv_pool_bytes_per_gpu // 160 // 64 * 64
    assert four.kv_tokens_per_replica == 4 * per_gpu
    # attention DP keeps the input embedding whole on every GPU (6400 params, vs 1600 at TP 4)
    # and the attention matrices too: q_b, kv_b and o_proj (2 x 5120 params) lose their split
    assert four.weights_bytes_per_gpu - one.weights_bytes_per_gpu == 2 * (
        6400 - 1600 + (2 * 5120 - 2 * 5120 // 4))


# ---------------------------------------------------------------- hand-computed: small GQA


def test_small_gqa_kv_bytes_split_and_replicated_heads():
    arch = resolve_architecture(None, SMALL_GQA)
    # 3 layers x (K + V) x kv heads per rank x 16 x bytes
    assert kv_bytes_per_token_per_gpu(arch, "bf16", 1) == 3 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token_per_gpu(arch, "bf16", 2) == 3 * 2 * 1 * 16 * 2
    # 4 ranks, 2 KV heads: each rank keeps one whole head (replicated)
    assert kv_bytes_per_token_per_gpu(arch, "bf16", 4) == 3 * 2 * 1 * 16 * 2
    assert kv_bytes_per_token_per_gpu(arch, "fp8_e4m3", 2) == 3 * 2 * 1 * 16


def test_small_gqa_weights_by_hand():
    arch = resolve_architecture(None, SMALL_GQA)
    # tied embeddings: no lm_head; per layer q 128x128, k/v 32x128 each, o 128x128,
    # gate_up 512x128, down 128x256, 2 norms of 128; final norm 128
    per_layer = 128 * 128 + 2 * 32 * 128 + 128 * 128 + 512 * 128 + 128 * 256
    params = 1000 * 128 + 3 * (per_layer + 256) + 128
    assert checkpoint_bytes(arch, WeightScheme.of("bf16")) == 2 * params
    # TP 4: k/v have 2 heads, so they split 2 ways, not 4
    split = 1000 * 128 + 3 * (2 * 128 * 128 + 512 * 128 + 128 * 256)
    kv = 3 * 2 * 32 * 128
    norms = 3 * 256 + 128
    assert weight_bytes_per_gpu(arch, WeightScheme.of("bf16"), tp=4) == 2 * (
        split // 4 + kv // 2 + norms)


def test_matrix_bytes_by_hand():
    assert matrix_bytes(256, 384, "bf16") == 256 * 384 * 2
    # FP8: one FP32 scale per 128x128 block: 2 x 3 blocks
    assert matrix_bytes(256, 384, "fp8") == 98304 + 6 * 4
    # INT4 group 128: 2 values per byte, BF16 scale per 128 inputs per row
    assert matrix_bytes(256, 384, "int4", 128) == 49152 + 256 * 3 * 2
    # asymmetric adds a 4-bit zero point per group
    assert matrix_bytes(256, 384, "int4", 128, symmetric=False) == 49152 + 1536 + 384
    assert matrix_bytes(256, 384, "int4", 32) == 49152 + 256 * 12 * 2


def test_engine_defaults_by_hand():
    h200 = 141 * 1024
    # disaggregated decode, TP 8, MLA: 512 + 1.5*2048 + 1024 + 2*512 = 5632 < 10 GiB floor
    d = engine_defaults(h200, 8, 1, "decode", True)
    assert (d.chunked_prefill_size, d.decode_max_bs, d.reserved_mib) == (8192, 512, 10240)
    assert d.mem_fraction_static == round((h200 - 10240) / h200, 3) == 0.929
    # prefill: 512 + 1.5*8192 + 1024 + 1.5 GiB MLA prefill graph
    assert engine_defaults(h200, 8, 1, "prefill", True).reserved_mib == 15360
    # one pool: both graphs
    assert engine_defaults(h200, 8, 1, "single", True).reserved_mib == 16384
    # decode with attention DP 8 (max_bs 512 > 300): + 512*8*3 + 512*8*1.5
    assert engine_defaults(h200, 8, 8, "decode", True).reserved_mib == 5632 + 12288 + 6144
    # 80 GiB, TP 1, GQA, one pool: 512 + 12288 + 128 + 2*256 + 8 per prefill graph size
    assert len(prefill_graph_sizes(8192)) == 8 + 14 + 8 + 8 + 12 + 8
    assert engine_defaults(80 * 1024, 1, 1, "single", False).reserved_mib == 13904


# ---------------------------------------------------------------- presets vs public numbers


def test_presets_match_published_parameter_counts():
    def params(preset: str, mtp: bool = False) -> float:
        arch = resolve_architecture(preset, {})
        return sum(t.rows * t.cols * t.count for t in model_tensors(arch, with_mtp=mtp))

    # DeepSeek-V3 README: 671B main model, 685B on Hugging Face with the MTP module.
    assert params("deepseek-v3") == pytest.approx(671e9, rel=0.005)
    assert params("deepseek-v3", mtp=True) == pytest.approx(685e9, rel=0.005)
    # GLM-5 technical report: 744B total parameters.
    assert params("glm-5") == pytest.approx(744e9, rel=0.005)
    # Kimi K2 model card: 1T total parameters (1.03T counted from the checkpoint).
    assert params("kimi-k2") == pytest.approx(1.03e12, rel=0.01)


def test_preset_overrides_apply():
    arch = resolve_architecture("kimi-k2", {"num_hidden_layers": 2, "n_routed_experts": 8})
    assert (arch.num_hidden_layers, arch.n_routed_experts, arch.kv_lora_rank) == (2, 8, 512)
    assert set(PRESETS) == {"kimi-k2", "deepseek-v3", "glm-5"}


def test_glm5_kv_layout_includes_indexer_and_fp8_scales():
    arch = resolve_architecture("glm-5", {})
    # BF16: (512 + 64) * 2 + indexer keys 128 + 4; FP8: 512 + 16 + 64 * 2 + 132; 78 layers
    assert kv_bytes_per_token_per_gpu(arch, "bf16", 8) == 78 * (1152 + 132)
    assert kv_bytes_per_token_per_gpu(arch, "fp8_e4m3", 8) == 78 * (656 + 132)
    # ...but SGLang sizes the FP8 pool with 576-byte latents
    assert kv_sizing_bytes_per_token(arch, "fp8_e4m3", 8) == 78 * (576 + 132)
    assert kv_sizing_bytes_per_token(arch, "bf16", 8) == 78 * (1152 + 132)


def test_fp8_dsa_pool_over_budget_is_a_warning():
    s = spec(single={"weights": {"dtype": "int4"}, "kvCache": {"dtype": "fp8_e4m3"}})
    s["model"]["architecture"] = {"preset": "glm-5"}
    plan = plan_deployment(s)
    single = plan.phases["single"]
    tokens = single.kv_pool_bytes_per_gpu // (78 * 708) // 64 * 64
    assert single.kv_tokens_per_replica == tokens
    assert single.kv_bytes_over_budget_per_gpu == tokens * 78 * 80
    assert plan.ok and "KVPoolOverBudget" in reasons(plan)


# ---------------------------------------------------------------- rules and findings


def reasons(plan) -> set[str]:
    return {f.reason for f in plan.findings}


def test_kimi_disaggregated_fits_and_reports_status():
    plan = plan_deployment(spec(prefill=FP8_PREFILL, decode=INT4_DECODE))
    assert plan.ok and set(plan.phases) == {"prefill", "decode"}
    status = plan.to_status()
    decode = status["decode"]["capacity"]
    assert decode["kvTokensPerReplica"] == plan.phases["decode"].kv_tokens_per_replica > 0
    assert decode["maxConcurrentRequests"] == decode["kvTokensPerReplica"] // 32768
    assert set(decode["maxConcurrentRequestsAt"]) == {"4096", "32768", "131072"}
    assert status["prefill"]["precision"] == {"weights": "fp8", "kvCache": "bf16"}
    assert plan.condition("PrecisionValid").status
    assert plan.condition("CapacityPlanned").reason == "Fits"


def test_int4_weights_free_memory_for_kv():
    plan = plan_deployment(spec(prefill=FP8_PREFILL, decode=INT4_DECODE))
    fp8, int4 = plan.phases["prefill"], plan.phases["decode"]
    assert int4.weights_bytes_per_gpu < 0.6 * fp8.weights_bytes_per_gpu
    assert int4.kv_pool_bytes_per_gpu > 5 * fp8.kv_pool_bytes_per_gpu


def test_fp8_kv_needs_compute_capability_8_9():
    s = spec(single={"weights": {"dtype": "int4"}, "kvCache": {"dtype": "fp8_e4m3"}})
    s["nodePool"]["gpu"]["computeCapability"] = "8.0"
    plan = plan_deployment(s)
    cond = plan.condition("PrecisionValid")
    assert not cond.status and cond.reason == "FP8KVCacheUnsupported"
    assert "8.9" in cond.message and "8.0" in cond.message
    s["nodePool"]["gpu"]["computeCapability"] = "8.9"
    assert "FP8KVCacheUnsupported" not in reasons(plan_deployment(s))


def test_int4_prefill_is_a_warning():
    plan = plan_deployment(spec(prefill=INT4_DECODE, decode=INT4_DECODE))
    assert plan.ok and "Int4WeightsOnPrefill" in reasons(plan)
    cond = plan.condition("PrecisionValid")
    assert cond.status and "slower" in cond.message


def test_mla_kv_dtypes_convert_at_the_handover_and_stage_on_the_prefill(monkeypatch):
    fp8_decode = {**INT4_DECODE, "kvCache": {"dtype": "fp8_e4m3"}}
    plan = plan_deployment(spec(prefill=FP8_PREFILL, decode=fp8_decode))
    assert plan.ok, plan.findings
    # 4 transfer workers x 8192 tokens x 61 layers x 576 FP8 latent bytes
    assert plan.phases["prefill"].handover_staging_bytes_per_gpu == 4 * 8192 * 61 * 576
    assert plan.phases["decode"].handover_staging_bytes_per_gpu == 0
    fp8_prefill = {**FP8_PREFILL, "kvCache": {"dtype": "fp8_e4m3"}}
    back = plan_deployment(spec(prefill=fp8_prefill, decode=INT4_DECODE))
    assert back.ok and back.phases["prefill"].handover_staging_bytes_per_gpu == (
        4 * 8192 * 61 * 1152)
    same = plan_deployment(spec(prefill=FP8_PREFILL, decode=INT4_DECODE))
    assert same.phases["prefill"].handover_staging_bytes_per_gpu == 0
    monkeypatch.setattr(plan_module, "KV_HANDOFF_CONVERSIONS", frozenset())
    plan = plan_deployment(spec(prefill=FP8_PREFILL, decode=fp8_decode))
    assert not plan.ok and plan.condition("PrecisionValid").reason == "KVCacheDtypeMismatch"


def test_gqa_kv_dtype_mismatch_is_refused():
    gqa = {"tensorParallel": 1, "weights": {"dtype": "bf16"}}
    manifest = spec(prefill={**gqa, "kvCache": {"dtype": "bf16"}},
                    decode={**gqa, "kvCache": {"dtype": "fp8_e4m3"}})
    manifest["model"]["architecture"] = {"config": SMALL_GQA}
    manifest["model"]["contextLength"] = 4096
    cond = plan_deployment(manifest).condition("PrecisionValid")
    assert cond.reason == "KVCacheDtypeMismatch" and "MLA latents only" in cond.message


def test_weights_that_do_not_fit_give_the_numbers():
    plan = plan_deployment(spec(single={"weights": {"dtype": "bf16"}}))
    cond = plan.condition("CapacityPlanned")
    assert not cond.status and cond.reason == "InsufficientGPUMemory"
    for number in ("240.76 GiB", "0.887", "141.0 GiB GPU"):
        assert number in cond.message
    single = plan.phases["single"]
    assert (single.kv_pool_bytes_per_gpu, single.kv_tokens_per_replica, single.fits) == (
        0, 0, False)


def test_context_longer_than_the_pool_is_an_error():
    s = spec(single={"weights": {"dtype": "fp8"}, "kvCache": {"dtype": "bf16"}})
    s["model"]["contextLength"] = 262144
    plan = plan_deployment(s)
    assert plan.condition("CapacityPlanned").reason == "ContextExceedsKVCache"
    assert plan.phases["single"].weights_fit and not plan.phases["single"].fits


def test_quantization_groups_must_split_evenly():
    # Kimi experts are 2048 wide: TP 32 leaves 64 per rank, less than a 128 group.
    s = spec(single={"tensorParallel": 32, "weights": {"dtype": "int4", "groupSize": 128}})
    assert "QuantGroupMisaligned" in reasons(plan_deployment(s))
    s["single"]["weights"]["groupSize"] = 32
    assert "QuantGroupMisaligned" not in reasons(plan_deployment(s))
    # expert parallel keeps whole experts per rank group: TP 32 = EP 8 x MoE-TP 4
    s["single"]["weights"]["groupSize"] = 128
    s["single"]["expertParallel"] = 8
    assert "QuantGroupMisaligned" not in reasons(plan_deployment(s))


def test_invalid_parallelism_is_reported():
    def messages(ep: int) -> str:
        s = spec(single={"tensorParallel": 8, "expertParallel": ep, "weights": {"dtype": "fp8"}})
        s["model"]["architecture"] = {"config": {**SMALL_MLA, "n_routed_experts": 12}}
        plan = plan_deployment(s)
        return " ".join(f.message for f in plan.findings if f.reason == "InvalidParallelism")

    assert "12 routed experts" in messages(8)  # 12 experts over EP 8
    assert "12 routed experts" not in messages(4)
    assert "4 attention heads" in messages(4)  # 4 heads over 8 attention-TP ranks


def test_indexer_models_need_page_size_64():
    s = spec(single={"weights": {"dtype": "fp8"}, "kvCache": {"pageSize": 1}})
    s["model"]["architecture"] = {"preset": "glm-5"}
    assert "PageSizeUnsupported" in reasons(plan_deployment(s))


def test_context_beyond_the_model_is_a_warning():
    s = spec(single={"weights": {"dtype": "int4"}, "kvCache": {"dtype": "fp8_e4m3"}})
    s["model"]["contextLength"] = 300000  # Kimi K2: max_position_embeddings 262144
    plan = plan_deployment(s)
    assert "ContextBeyondModel" in reasons(plan)
    # a custom architecture without max_position_embeddings gets no such warning
    s["model"]["architecture"] = {"config": SMALL_MLA}
    assert "ContextBeyondModel" not in reasons(plan_deployment(s))


def test_mem_fraction_override_is_used():
    s = spec(single={"weights": {"dtype": "int4"}, "memFractionStatic": 0.8})
    assert plan_deployment(s).phases["single"].mem_fraction_static == 0.8


def test_quantized_modules_are_configurable():
    arch = resolve_architecture("kimi-k2", {})
    experts_only = WeightScheme.of("int4")
    everything = WeightScheme.of("int4", quantized=[Module.ROUTED_EXPERTS, Module.ATTENTION,
                                                    Module.SHARED_EXPERTS, Module.DENSE_MLP])
    assert weight_bytes_per_gpu(arch, everything, 8) < weight_bytes_per_gpu(arch, experts_only, 8)
    s = spec(single={"weights": {"dtype": "int4", "quantize": ["routedExperts", "attention"]}})
    assert plan_deployment(s).phases["single"].spec.weights.quantized == {
        Module.ROUTED_EXPERTS, Module.ATTENTION}


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda s: s["model"]["architecture"].update(preset="llama-9"), "unknown architecture preset"),
    (lambda s: s["model"]["architecture"].update(config={"n_routed_expert": 8}),
     "n_routed_expert"),
    (lambda s: s["model"]["architecture"].update(config={"hidden_size": -1}),
     "non-negative integer"),
    (lambda s: s["model"]["architecture"].update(preset=None, config={"hidden_size": 64}),
     "missing"),
    (lambda s: s.update(single={}), "either both spec.prefill and spec.decode"),
    (lambda s: s.pop("decode"), "either both"),
    (lambda s: s["decode"]["weights"].update(dtype="int3"), "weights.dtype"),
    (lambda s: s["decode"]["weights"].update(groupSize=64), "groupSize"),
    (lambda s: s["decode"]["kvCache"].update(dtype="fp8_e5m2"), "kvCache.dtype"),
    (lambda s: s["decode"].update(tensorParallel=0), "tensorParallel"),
    (lambda s: s["decode"].update(expertParallel=3), "must divide tensorParallel"),
    (lambda s: s["decode"].update(attentionDataParallel=16), "must divide tensorParallel"),
    (lambda s: s["decode"].update(memFractionStatic=1.5), "memFractionStatic"),
    (lambda s: s["decode"]["weights"].update(quantize=["experts"]), "weights.quantize"),
    (lambda s: s["nodePool"]["gpu"].update(computeCapability="hopper"), "computeCapability"),
    (lambda s: s["nodePool"]["gpu"].update(memoryGiB=0), "memoryGiB"),
])
def test_bad_input_raises_a_clear_error(mutate, needle):
    s = spec(prefill={**FP8_PREFILL, "weights": {"dtype": "fp8"}},
             decode={**INT4_DECODE, "weights": {"dtype": "int4"}, "kvCache": {"dtype": "bf16"}})
    mutate(s)
    with pytest.raises(PlanError, match=needle):
        plan_deployment(s)
