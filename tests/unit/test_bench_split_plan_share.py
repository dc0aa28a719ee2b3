"""bench/fp8_kv_decode.py's record of how much of the GPU the FP8 MLA split plan fills when the
batch's lengths are not known on the host: one program an SM, one wave, so request counts that
do not divide the SM count leave SMs idle for the whole kernel."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fp8_kv_decode import split_plan_sm_share  # noqa: E402
from tessera.kernels.paged_decode_split import MLA_FP8_E4M3_128, MLA_HEADS_M  # noqa: E402

SMS = 132  # an H200's


@pytest.mark.parametrize("requests,share", [(64, 128 / 132), (128, 128 / 132), (44, 1.0),
                                            (48, 96 / 132), (67, 67 / 132), (133, 133 / 264)])
def test_the_one_wave_plan_leaves_sms_idle_at_unaligned_request_counts(requests, share) -> None:
    assert split_plan_sm_share(MLA_FP8_E4M3_128, requests, 16, 4096, SMS) == pytest.approx(share)


def test_more_waves_fill_what_one_leaves_idle() -> None:
    three_waves = replace(MLA_FP8_E4M3_128, programs_per_sm=3)  # 8 splits of 48 requests
    assert split_plan_sm_share(three_waves, 48, 16, 4096, SMS) == pytest.approx(384 / 396)


def test_128_heads_take_two_programs_a_request() -> None:
    assert split_plan_sm_share(MLA_HEADS_M, 48, 128, 4096, SMS) == pytest.approx(96 / 132)
