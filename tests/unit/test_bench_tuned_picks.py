"""bench/tuned_picks.py: the INT4 tuners' picks survive a JSON round trip, keys and configs
equal to the ones the tuners store, so a later run repeats them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from tessera.kernels.w4a16_gemm import _TUNED, GemmConfig  # noqa: E402
from tessera.kernels.w4a16_moe import MoeConfig  # noqa: E402
from tuned_picks import load_tuned_picks, tuned_picks  # noqa: E402


def test_picks_round_trip_through_json() -> None:
    gemm_key = ("gemm", 16, 2112, 7168, 32, False, torch.bfloat16, "NVIDIA H200")
    moe_key = ("moe_up", 4, 48, (7168,), "int4", "NVIDIA H200")
    gemm = GemmConfig(block_m=8, block_n=32, split_k=8, swap=True)
    moe = (MoeConfig(8, 128, 128, 4, 4, swap=True, split_k=4), MoeConfig(path="gemv", block_m=1))
    saved = dict(_TUNED)
    try:
        _TUNED.clear()
        _TUNED.update({gemm_key: gemm, moe_key: moe})
        text = json.dumps(tuned_picks())
        _TUNED.clear()
        assert load_tuned_picks(json.loads(text)) == 2
        assert _TUNED == {gemm_key: gemm, moe_key: moe}
        assert isinstance(_TUNED[moe_key], tuple) and isinstance(_TUNED[gemm_key], GemmConfig)
    finally:
        _TUNED.clear()
        _TUNED.update(saved)
