"""INT4 kernels per phase: the measured winner when unset (tessera's dense GEMMs beside
SGLang's Marlin MoE on expert-parallel decode pools), the spec's choice when set."""

from __future__ import annotations

import pytest
from tessera.runtime.planner import plan_deployment
from tessera.runtime.planner.errors import PlanError
from tessera.runtime.planner.w4a16 import choose_w4a16

INT4_DENSE = ["attention", "denseMLP", "sharedExperts", "routedExperts"]


def spec(phase: str = "decode", weights: dict | None = None, **fields) -> dict:
    body = {"tensorParallel": 8, "expertParallel": 8, "kvCache": {"dtype": "fp8_e4m3"},
            "weights": weights or {"dtype": "int4", "groupSize": 32, "quantize": INT4_DENSE},
            **fields}  # fmt: skip
    prefill = {"tensorParallel": 8, "kvCache": {"dtype": "fp8_e4m3"}, "weights": {"dtype": "fp8"}}
    phases = {phase: body} if phase == "single" else {"prefill": prefill, "decode": body}
    return {
        "model": {"name": "m", "architecture": {"preset": "kimi-k2"}, "contextLength": 8192},
        "nodePool": {"gpu": {"product": "H200", "memoryGiB": 141, "computeCapability": "9.0"}},
        **phases,
    }


def choice(s: dict, phase: str = "decode"):
    return choose_w4a16(plan_deployment(s).phases[phase].spec)


GPTQ = {"dtype": "int4", "groupSize": 32, "quantize": INT4_DENSE, "format": "gptq"}


@pytest.mark.parametrize("s, phase, impl, because", [
    # decode, EP 8, INT4 dense linears in compressed-tensors (the default format for int4)
    (spec(), "decode", "tessera", "Marlin MoE for the experts"),
    # nothing measured, or nothing for tessera to run: SGLang keeps Marlin
    (spec(expertParallel=1), "decode", "sglang", "no expert parallelism"),
    (spec("single"), "single", "sglang", "prefill-sized GEMMs"),
    (spec(), "prefill", "sglang", "fp8 weights"),
    (spec(weights={"dtype": "int4", "groupSize": 32}), "decode", "sglang",
     "no INT4 linear layers"),
    (spec(weights={"dtype": "int4", "groupSize": 32, "quantize": ["routedExperts", "embedding"]}),
     "decode", "sglang", "no INT4 linear layers"),
    (spec(weights=GPTQ), "decode", "sglang", "int4 in gptq"),
    # an explicit choice wins over the measurements
    (spec(kernels={"w4a16": "sglang"}), "decode", "sglang", "set in the spec"),
    (spec("single", kernels={"w4a16": "tessera"}), "single", "tessera", "set in the spec"),
])  # fmt: skip
def test_w4a16_per_phase(s, phase, impl, because):
    got = choice(s, phase)
    assert got.impl == impl
    assert because in got.reason


def test_an_unknown_provider_is_a_plan_error_that_names_the_choices():
    with pytest.raises(PlanError, match=r"decode.kernels.w4a16 'marlin' is not one of"):
        plan_deployment(spec(kernels={"w4a16": "marlin"}))
