"""How much of the GPU the FP8 MLA split plan fills when the batch's lengths are not known on the
host (one program an SM, one wave, so request counts that do not divide the SM count leave SMs
idle for the whole kernel), and the default that follows: the stream schedule below
STREAM_MIN_SM_SHARE."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tessera.kernels.paged_decode_split import (
    MLA_FP8_E4M3_128,
    MLA_FP8_E4M3_IN_PLACE,
    MLA_FP8_E4M3_STREAM,
    MLA_FP8_WGMMA,
    MLA_HEADS_M,
    STREAM_MIN_SM_SHARE,
    pick_config,
    split_plan_sm_share,
    with_stream,
)

SMS = 132  # an H200's
TABLE = 32768  # SGLang's adapter passes the table's length, not the longest request


@pytest.mark.parametrize("requests,share", [(64, 128 / 132), (128, 128 / 132), (44, 1.0),
                                            (48, 96 / 132), (67, 67 / 132), (133, 133 / 264)])
def test_the_one_wave_plan_leaves_sms_idle_at_unaligned_request_counts(requests, share) -> None:
    assert split_plan_sm_share(MLA_FP8_E4M3_128, requests, 16, 4096, SMS) == pytest.approx(share)


def test_more_waves_fill_what_one_leaves_idle() -> None:
    three_waves = replace(MLA_FP8_E4M3_128, programs_per_sm=3)  # 8 splits of 48 requests
    assert split_plan_sm_share(three_waves, 48, 16, 4096, SMS) == pytest.approx(384 / 396)


def test_128_heads_take_two_programs_a_request() -> None:
    assert split_plan_sm_share(MLA_HEADS_M, 48, 128, 4096, SMS) == pytest.approx(96 / 132)


@pytest.mark.parametrize("cfg", [MLA_FP8_E4M3_128, MLA_FP8_E4M3_IN_PLACE])
def test_lengths_unknown_take_the_stream_where_the_split_plan_leaves_sms_idle(cfg) -> None:
    for requests in range(1, 300):
        share = split_plan_sm_share(cfg, requests, 16, TABLE, SMS)
        want = MLA_FP8_E4M3_STREAM if share < STREAM_MIN_SM_SHARE else cfg
        assert with_stream(cfg, None, requests, TABLE, 16, SMS) == want, requests
    # the measured points: 67 and 48 requests to the stream, 64 and 128 stay
    assert [with_stream(cfg, None, n, TABLE, 16, SMS) == MLA_FP8_E4M3_STREAM
            for n in (48, 64, 67, 128)] == [True, False, True, False]  # fmt: skip
    # 8 heads are one 16-head program a request, as 16 are
    assert with_stream(cfg, None, 67, TABLE, 8, SMS) == MLA_FP8_E4M3_STREAM


def test_the_share_rule_leaves_known_totals_and_small_batches_alone() -> None:
    # a known total of equal lengths keeps the balanced split plan
    assert with_stream(MLA_FP8_E4M3_128, 67 * 4096, 67, 4096, 16, SMS) == MLA_FP8_E4M3_128
    # below the e4m3 kernels' tokens the widening kernel was never timed against the stream
    assert pick_config(512, 16, mla=True, fp8=True, tokens=67 * 1024) == MLA_FP8_WGMMA
    assert with_stream(MLA_FP8_WGMMA, None, 67, 1024, 16, SMS) == MLA_FP8_WGMMA
