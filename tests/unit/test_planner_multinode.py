"""The planner for replicas wider than one node: TP 16 and 32, expert parallel across nodes."""

from __future__ import annotations

import pytest
from tessera.runtime.planner import PlanError, nodes_per_replica, plan_deployment
from tessera.runtime.planner.cli import render
from tessera.runtime.planner.plan import compare_precisions

GiB = 1 << 30


def kimi(tp: int, ep: int = 1, dp: int = 1, per_node: int = 8, weights: dict | None = None
         ) -> dict:
    return {
        "model": {"name": "m", "architecture": {"preset": "kimi-k2"}, "contextLength": 65536},
        "nodePool": {"gpu": {"perNode": per_node}},
        "prefill": {"tensorParallel": tp, "expertParallel": ep, "attentionDataParallel": dp,
                    "weights": weights or {"dtype": "fp8"}, "kvCache": {"dtype": "fp8_e4m3"}},
        "decode": {"tensorParallel": 8, "weights": {"dtype": "int4"},
                   "kvCache": {"dtype": "fp8_e4m3"}},
    }


@pytest.mark.parametrize("tp, per_node, nodes", [(1, 8, 1), (8, 8, 1), (16, 8, 2), (32, 8, 4),
                                                 (32, 4, 8)])
def test_nodes_per_replica(tp: int, per_node: int, nodes: int) -> None:
    assert nodes_per_replica(tp, per_node) == nodes


def test_kimi_fp8_prefill_at_tp16_gains_the_kv_room_tp8_lacks() -> None:
    tp8, tp16, tp32 = (plan_deployment(kimi(tp)).phases["prefill"] for tp in (8, 16, 32))
    assert (tp8.spec.nodes, tp16.spec.nodes, tp32.spec.nodes) == (1, 2, 4)
    # The weights halve per GPU with each doubling (within the replicated parts' share).
    assert 120 * GiB < tp8.weights_bytes_per_gpu < 121 * GiB
    assert 60 * GiB < tp16.weights_bytes_per_gpu < 62 * GiB
    assert 30 * GiB < tp32.weights_bytes_per_gpu < 32 * GiB
    # At TP 8 the KV pool is 3.4 GiB per GPU: one 64k-token request at a time. At TP 16 it is
    # 62 GiB, and MLA's latent is replicated over the TP ranks, so every GiB is new tokens.
    assert tp8.kv_pool_bytes_per_gpu < 4 * GiB and tp8.max_concurrent_requests == 1
    assert tp16.kv_pool_bytes_per_gpu > 60 * GiB and tp16.max_concurrent_requests == 29
    assert tp32.kv_pool_bytes_per_gpu > 88 * GiB and tp32.max_concurrent_requests == 42
    # But FP8 at TP 32 cuts the experts' 2048 columns 64 wide, half a 128 block: expert
    # parallel fixes the routed experts, not the shared one, so FP8 stops at TP 16.
    for ep in (1, 32):
        fp8_tp32 = plan_deployment(kimi(32, ep=ep))
        assert {f.reason for f in fp8_tp32.findings} == {"QuantGroupMisaligned"}
        assert any("sharedExperts width 2048 split over 32" in f.message
                   for f in fp8_tp32.findings)
    assert tp16.kv_bytes_per_token_per_gpu == tp8.kv_bytes_per_token_per_gpu
    # Per GPU spent, TP 16 holds about 9x the tokens of TP 8.
    assert tp16.kv_tokens_per_replica / 16 > 9 * tp8.kv_tokens_per_replica / 8


def test_expert_parallel_across_nodes_splits_the_same_bytes() -> None:
    """EP 16 on TP 16: each GPU holds 24 of the 384 routed experts whole instead of a
    sixteenth of each; the bytes per GPU are the same and the plan is admitted."""
    int4 = {"dtype": "int4", "groupSize": 32}  # 32-wide groups still split at TP 32
    for tp, weights in ((16, None), (32, int4)):
        tp_only = plan_deployment(kimi(tp, weights=weights)).phases["prefill"]
        wide = plan_deployment(kimi(tp, ep=tp, weights=weights))
        assert wide.ok, wide.findings
        assert wide.phases["prefill"].weights_bytes_per_gpu == tp_only.weights_bytes_per_gpu
    # Attention DP across the nodes too: every DP rank has its own pool.
    with_dp = plan_deployment(kimi(16, ep=16, dp=16))
    assert with_dp.ok, with_dp.findings
    tp16 = plan_deployment(kimi(16)).phases["prefill"]
    assert with_dp.phases["prefill"].kv_tokens_per_replica > 10 * tp16.kv_tokens_per_replica


def test_status_and_table_name_the_nodes() -> None:
    spec = kimi(16)
    plan = plan_deployment(spec)
    assert plan.to_status()["prefill"]["capacity"]["nodesPerReplica"] == 2
    assert plan.to_status()["decode"]["capacity"]["nodesPerReplica"] == 1
    text = render("kimi", spec | {"model": {**spec["model"], "architecture": {
        "preset": "kimi-k2"}}}, plan, compare_precisions(spec))
    assert "prefill: 1 replica(s) x 16 GPUs over 2 nodes" in text
    assert "decode: 1 replica(s) x 8 GPUs (EP" in text


def test_a_replica_must_take_whole_nodes() -> None:
    with pytest.raises(PlanError, match="tensorParallel 12 spans nodes of 8 GPUs"):
        plan_deployment(kimi(12, ep=4))
