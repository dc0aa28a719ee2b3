"""bench/w4a16_bench.py's account of the GEMM tuner's picks under ``--candidates``: each
round's pick by the tuner's own timing, and what that pick costs over the fastest tile by the
bench's timing (cycled weights, no flush)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from w4a16_bench import tuner_pick_costs  # noqa: E402


def test_each_round_picks_its_fastest_and_is_charged_against_the_bench_best() -> None:
    tuner = {"gemv": [5.1, 4.9, 5.0], "triton": [4.8, 5.2, 5.3], "wgmma": [5.5, 5.6, 5.4]}
    bench = {"gemv": 4.8, "triton": 6.0, "wgmma": 5.7}
    got = tuner_pick_costs(tuner, bench)
    assert got["picks"] == ["triton", "gemv", "gemv"]
    assert got["cost_us"] == [6.0 - 4.8, 0.0, 0.0]


def test_a_tuner_that_agrees_with_the_bench_costs_nothing() -> None:
    tuner = {"a": [2.0, 2.1], "b": [3.0, 3.1]}
    assert tuner_pick_costs(tuner, {"a": 1.0, "b": 1.5}) == {"picks": ["a", "a"],
                                                              "cost_us": [0.0, 0.0]}
