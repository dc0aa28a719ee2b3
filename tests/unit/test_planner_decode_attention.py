"""Decode attention per phase: the measured winner when unset, the spec's choice when set,
FlashMLA refused where it cannot run."""

from __future__ import annotations

import pytest
from tessera.runtime.planner import plan_deployment
from tessera.runtime.planner.decode_attention import (
    MEASURED_MLA_HEADS,
    MLA_DECODE_WINNER,
    choose_decode_attention,
    measured_heads,
)
from tessera.runtime.planner.errors import PlanError

# A Llama-style GQA model: 64 query heads over 8 KV heads of 128.
GQA = {
    "hidden_size": 8192, "num_hidden_layers": 4, "vocab_size": 32000, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 28672,
}


def spec(architecture: dict, phase: str = "single", **fields) -> dict:
    kv = {"dtype": fields.pop("kv", "bf16"), "pageSize": fields.pop("page_size", 64)}
    body = {"tensorParallel": 8, "weights": {"dtype": "fp8"}, "kvCache": kv, **fields}
    phases = {phase: body} if phase == "single" else {
        "prefill": {**body, "kvCache": kv}, "decode": {**body, "kvCache": kv}}
    return {
        "model": {"name": "m", "architecture": architecture, "contextLength": 8192},
        "nodePool": {"gpu": {"product": "H200", "memoryGiB": 141, "computeCapability": "9.0"}},
        **phases,
    }


def choice(s: dict, phase: str = "single"):
    plan = plan_deployment(s)
    return choose_decode_attention(plan.architecture, plan.phases[phase].spec)


KIMI, DEEPSEEK, GLM5 = ({"preset": p} for p in ("kimi-k2", "deepseek-v3", "glm-5"))


@pytest.mark.parametrize("architecture, phase, fields, impl, because", [
    # MLA, 64-token pages: FlashMLA measured fastest at every head count and KV dtype.
    (KIMI, "single", {}, "flashmla", "at 8 query heads per GPU (this phase runs 8)"),
    (KIMI, "decode", {"kv": "fp8_e4m3"}, "flashmla", "fp8_e4m3 KV at 8"),
    (KIMI, "decode", {"attentionDataParallel": 8}, "flashmla", "at 64 query heads"),
    (KIMI, "decode", {"attentionDataParallel": 2}, "flashmla", "at 16 query heads per GPU "
     "(this phase runs 16)"),
    (DEEPSEEK, "single", {"attentionDataParallel": 8, "kv": "fp8_e4m3"}, "flashmla",
     "at 128 query heads"),
    (DEEPSEEK, "decode", {"attentionDataParallel": 2}, "flashmla", "at 64 query heads per "
     "GPU (this phase runs 32)"),
    # Where FlashMLA cannot run or nothing was measured, SGLang keeps its own choice.
    (KIMI, "prefill", {}, "sglang", "does not decode"),
    (KIMI, "decode", {"page_size": 16}, "sglang", "64-token pages"),
    (GLM5, "single", {}, "sglang", "dsa backend"),
    ({"config": GQA}, "single", {}, "sglang", "FA3) was not measured"),
    # An explicit choice wins over the measurements.
    (KIMI, "decode", {"kernels": {"decodeAttention": "tessera"}}, "tessera", "set in the spec"),
    (KIMI, "decode", {"kernels": {"decodeAttention": "sglang"}}, "sglang", "set in the spec"),
    ({"config": GQA}, "single", {"kernels": {"decodeAttention": "tessera"}}, "tessera",
     "set in the spec"),
])
def test_decode_attention_per_phase(architecture, phase, fields, impl, because):
    got = choice(spec(architecture, phase, **fields), phase)
    assert got.impl == impl
    assert because in got.reason


@pytest.mark.parametrize("heads, measured", [
    (1, 8), (8, 8), (9, 16), (16, 16), (32, 64), (64, 64), (128, 128), (256, 128)])
def test_unmeasured_head_counts_take_the_next_measured(heads, measured):
    assert measured_heads(heads) == measured


def test_the_table_covers_both_kv_dtypes_at_every_measured_head_count():
    assert MEASURED_MLA_HEADS == (8, 16, 64, 128)
    assert {(kv, h) for kv in ("bf16", "fp8_e4m3") for h in MEASURED_MLA_HEADS} == set(
        MLA_DECODE_WINNER)


@pytest.mark.parametrize("architecture, page_size, needle", [
    ({"config": GQA}, 64, "GQA/MHA attention"),
    (GLM5, 64, "dsa backend"),
    (KIMI, 32, "64-token pages and this phase has 32 (kvCache.pageSize)"),
])
def test_flashmla_where_it_cannot_run_is_refused(architecture, page_size, needle):
    s = spec(architecture, "decode", page_size=page_size,
             kernels={"decodeAttention": "flashmla"})
    plan = plan_deployment(s)
    refusals = [f for f in plan.findings if f.reason == "DecodeAttentionUnsupported"]
    assert [f.condition for f in refusals] == ["PrecisionValid", "PrecisionValid"]  # both phases
    assert all(f.severity == "error" and needle in f.message for f in refusals)
    assert not plan.condition("PrecisionValid").status


def test_flashmla_on_an_mla_model_with_64_token_pages_is_accepted():
    plan = plan_deployment(spec(KIMI, "decode", kernels={"decodeAttention": "flashmla"}))
    assert not [f for f in plan.findings if f.reason == "DecodeAttentionUnsupported"]


def test_unknown_decode_attention_is_a_plan_error():
    with pytest.raises(PlanError, match="kernels.decodeAttention 'fa3' is not one of"):
        plan_deployment(spec(KIMI, kernels={"decodeAttention": "fa3"}))
