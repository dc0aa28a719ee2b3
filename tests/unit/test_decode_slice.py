"""The decode-slice benchmark's pure decisions (bench/decode_slice_plan.py): the slice's shapes,
the KV pool from the planner, admission, the routing share the slice computes, and scaling."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import decode_slice_plan as p  # noqa: E402
from tessera.runtime.planner import plan_deployment  # noqa: E402


def test_slice_shapes_are_one_gpus_share_at_tp8_ep8() -> None:
    kimi, glm = p.model_shape("kimi-k2"), p.model_shape("glm-5")
    assert (kimi.heads, kimi.local_experts, kimi.experts, kimi.top_k) == (8, 48, 384, 8)
    assert (kimi.shared_width, kimi.dense_width, kimi.vocab_shard) == (256, 2304, 20480)
    assert (kimi.dense_layers, kimi.moe_layers, kimi.latent_dim) == (1, 60, 576)
    assert kimi.index_heads == 0 and kimi.sm_scale == pytest.approx(192**-0.5)
    assert (glm.heads, glm.local_experts, glm.q_lora) == (8, 32, 2048)
    assert (glm.qk_nope, glm.v_head) == (192, 256)
    assert (glm.dense_layers, glm.moe_layers, glm.index_heads, glm.index_dim) == (3, 75, 32, 128)
    assert glm.vocab_shard == 154880 // 8


def test_pool_is_the_planners_decode_pool_for_the_deployment_spec() -> None:
    spec = p.deployment_spec("kimi-k2", "fp8", "bf16", 32)
    assert spec["decode"]["expertParallel"] == 8 and spec["decode"]["tensorParallel"] == 8
    plan = plan_deployment(spec)
    assert plan.ok
    pool = p.pool_plan("kimi-k2", "fp8", "bf16")
    decode = plan.phases["decode"]
    assert pool.tokens == decode.kv_tokens_per_replica == 126720  # docs/capacity.md's rule
    assert pool.pool_bytes == decode.kv_pool_bytes_per_gpu
    assert pool.pages == pool.tokens // p.PAGE_SIZE
    # an FP8 latent holds twice the tokens in the same pool (MLA, per-tensor scale)
    fp8 = p.pool_plan("kimi-k2", "fp8", "fp8_e4m3")
    assert fp8.pool_bytes == pool.pool_bytes and fp8.tokens // 2 == pytest.approx(pool.tokens, 1)
    # INT4 weights (same modules quantized, group 32) leave far more room than FP8 weights
    int4 = p.pool_plan("kimi-k2", "int4", "bf16")
    assert int4.weights_bytes < pool.weights_bytes / 1.7 and int4.tokens > 7 * pool.tokens
    assert (
        int4.weights_bytes
        < plan_deployment(
            {**spec, "decode": {**spec["decode"], "weights": {"dtype": "int4", "groupSize": 32}}}
        )
        .phases["decode"]
        .weights_bytes_per_gpu
    )  # the planner's INT4 default keeps attention BF16


def test_glm_fp8_pool_counts_tokens_as_sglang_sizes_them() -> None:
    bf16, fp8 = p.pool_plan("glm-5", "fp8", "bf16"), p.pool_plan("glm-5", "fp8", "fp8_e4m3")
    assert 1.7 < fp8.tokens / bf16.tokens < 1.9  # DSA: 1284 vs 708 bytes per layer as counted


def test_context_mix_cycles_and_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    assert p.context_lengths(6) == [1024, 2048, 4096, 8192, 1024, 2048]
    assert p.pages_for(1) == 1 and p.pages_for(64) == 1 and p.pages_for(65) == 2
    lengths = [1024, 2048, 4096]  # 16 + 32 + 64 pages
    assert p.admitted(lengths, 112) == 3
    assert p.admitted(lengths, 111) == 2
    assert p.admitted(lengths, 15) == 0
    assert p.admitted([8192, 64], 100) == 0  # in order: the small one behind does not jump ahead
    assert p.fits(4, 240) and not p.fits(4, 239)  # 3,840 tokens = 240 pages


def test_max_concurrency_follows_the_memory() -> None:
    levels = p.CONCURRENCY
    pages = {kv: p.pool_plan("kimi-k2", "fp8", kv).pages for kv in p.KV_DTYPES}
    # 32 requests of the mix hold 122,880 tokens; 64 hold 245,760
    assert p.max_concurrency(levels, pages["bf16"]) == 32
    assert p.max_concurrency(levels, pages["fp8_e4m3"]) == 64
    assert p.max_concurrency(levels, 10) == 0


def test_routing_shares_partition_every_pair_and_the_critical_gpu_has_the_most_experts() -> None:
    rng = random.Random(3)
    ids, weights = p.draw_routing(rng, tokens=16, experts=384, top_k=8)
    assert all(len(set(row)) == 8 for row in ids)
    assert all(sum(w) == pytest.approx(1) and min(w) > 0 for w in weights)
    shares = p.expert_shares(ids, weights, experts=384, ep=8)
    assert sum(s.pairs for s in shares) == 16 * 8
    for s in shares:
        assert all(0 <= e < 48 for e in s.local_experts)
        for t, e in zip(s.tokens, s.local_experts, strict=True):
            assert s.gpu * 48 + e in ids[t]
    crit = p.critical_share(shares)
    assert crit.distinct_experts == max(s.distinct_experts for s in shares)


def test_critical_share_breaks_ties_by_pairs_then_lowest_gpu() -> None:
    ids = [[0, 2], [0, 3], [2, 3]]  # 4 experts, 2 GPUs: GPU 0 {0} x2, GPU 1 {2, 3} x4
    shares = p.expert_shares(ids, [[0.5, 0.5]] * 3, experts=4, ep=2)
    assert [s.distinct_experts for s in shares] == [1, 2]
    assert p.critical_share(shares).gpu == 1
    even = p.expert_shares([[0, 2]], [[0.5, 0.5]], experts=4, ep=2)
    assert p.critical_share(even).gpu == 0


def test_full_step_scales_the_layer_graph_to_the_models_moe_layers() -> None:
    assert p.full_step_seconds(1.0, 2.0, slice_layers=8, moe_layers=60) == pytest.approx(16.0)
    samples = p.step_samples([1.0, 2.0], [8.0, 16.0], slice_layers=8, moe_layers=4)
    assert samples == [5.0, 10.0]
    with pytest.raises(ValueError):
        p.step_samples([1.0], [1.0, 2.0], 1, 1)


def test_percentile_is_nearest_rank_and_median_averages_the_middle() -> None:
    values = [float(v) for v in range(1, 21)]
    assert p.percentile(values, 95) == 19.0
    assert p.percentile(values, 100) == 20.0
    assert p.percentile([3.0], 95) == 3.0
    assert p.median([3.0, 1.0, 2.0]) == 2.0 and p.median([4.0, 1.0, 2.0, 3.0]) == 2.5


def _row(w: str, kv: str, c: int, tok_s: float | None, step_ms: float = 1.0) -> dict:
    ok = tok_s is not None
    return {"model": "m", "weights": w, "kv": kv, "concurrency": c, "admitted": ok,
            "tok_s": tok_s or 0.0, "step_ms": step_ms, "tok_s_integrity": (tok_s or 0) * 0.998,
            "p95_ms": step_ms, "p95_ms_integrity": step_ms * 1.003}  # fmt: skip


def test_summaries_compare_at_equal_settings() -> None:
    rows = [
        _row("fp8", "bf16", 16, 100, 160), _row("fp8", "bf16", 32, 150, 213),
        _row("fp8", "bf16", 64, None), _row("fp8", "fp8_e4m3", 16, 98, 163),
        _row("fp8", "fp8_e4m3", 32, 147, 218), _row("fp8", "fp8_e4m3", 64, 220, 290),
        _row("int4", "bf16", 16, 150), _row("int4", "bf16", 32, 180),
    ]  # fmt: skip
    kv = p.kv_comparison(rows, "m", "fp8", {"bf16": 32, "fp8_e4m3": 64})
    assert (kv["most_admitted_bf16"], kv["most_admitted_fp8"]) == (32, 64)
    assert kv["admitted_ratio"] == 2.0 and kv["peak_gain"] == pytest.approx(220 / 150 - 1)
    assert kv["peak_established"]
    assert kv["per_request_slowdown"][16] == pytest.approx(163 / 160 - 1)
    # A pool that admits more than was timed: the ratio is the pools', the peak is not one.
    untimed = p.kv_comparison(rows, "m", "fp8", {"bf16": 32, "fp8_e4m3": 90})
    assert untimed["admitted_ratio"] == pytest.approx(90 / 32)
    assert not untimed["peak_established"]
    assert p.kv_comparison(rows, "m", "int4", {"bf16": 32, "fp8_e4m3": 64}) == {}
    gains = p.weights_comparison(rows, "m", "bf16")
    assert gains == {16: pytest.approx(0.5), 32: pytest.approx(0.2)}
    cost = p.integrity_cost(rows)
    assert cost["max_throughput_loss"] == pytest.approx(0.002)
    assert cost["max_p95_increase"] == pytest.approx(0.003)
    table = p.throughput_table(rows, "m", levels=(16, 64, 128))
    assert table[2].startswith("| 16 | 100 | 98 | 150 | -")
    assert table[3] == "| 64 | OOM | 220 | - | - |"


def test_the_exact_most_admitted_is_the_admission_boundary() -> None:
    for pages in (1980, 3961, 6774, 12286):
        n = p.most_admitted(pages)
        assert p.fits(n, pages) and not p.fits(n + 1, pages)


def test_timed_levels_add_the_exact_limit_off_the_grid_within_the_cap() -> None:
    grid = [1, 8, 16, 32, 64, 128]
    # GLM 5's BF16 pool with FP8 weights: 114 requests fit, the grid shows 64
    assert p.most_admitted(6774) == 114
    assert p.timed_levels(grid, 6774, exact_cap=256) == [1, 8, 16, 32, 64, 114]
    assert p.timed_levels(grid, 6774, exact_cap=0) == [1, 8, 16, 32, 64]
    assert p.timed_levels(grid, 12286, exact_cap=128) == grid  # 205: over the cap
    assert p.timed_levels([1, 8, 32], 1980, exact_cap=256) == [1, 8, 32, 34]
