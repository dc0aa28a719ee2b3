"""How much of the GPU the FP8 MLA split plan fills when the batch's lengths are not known on the
host (one program an SM, one wave, so request counts that do not divide the SM count leave SMs
idle for the whole kernel), and the default that follows: the stream schedule below
STREAM_MIN_SM_SHARE."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tessera.kernels.paged_decode_split import (
    E4M3_MAX_SPLIT_TOKENS,
    HEADS_STREAM_MAX_BATCH,
    MLA_FP8_E4M3_128,
    MLA_FP8_E4M3_IN_PLACE,
    MLA_FP8_E4M3_STREAM,
    MLA_FP8_WGMMA,
    MLA_HEADS_M,
    MLA_HEADS_M_STREAM,
    SHARE_STREAM_MIN_BATCH,
    STREAM_MIN_SM_SHARE,
    equal_parts_plan,
    pick_config,
    plan_pieces,
    split_plan_sm_share,
    stream_programs,
    with_stream,
)

SMS = 132  # an H200's
LONGEST = 4096  # the longest request, as the bench tells the kernels
CONTEXT = 131072  # the bound SGLang's CUDA-graph buffers give the adapter


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
        share = split_plan_sm_share(cfg, requests, 16, LONGEST, SMS)
        idle = share < STREAM_MIN_SM_SHARE and requests >= SHARE_STREAM_MIN_BATCH
        want = MLA_FP8_E4M3_STREAM if idle else cfg
        assert with_stream(cfg, None, requests, LONGEST, 16, SMS) == want, requests
    # the measured points: 67 and 100 requests to the stream; 64, 128 and 240 stay, and 48 (a
    # share of 0.73, but below 64 requests, where the stream lost at 4k)
    streamed = [n for n in (48, 64, 67, 100, 128, 240)
                if with_stream(cfg, None, n, LONGEST, 16, SMS) == MLA_FP8_E4M3_STREAM]  # fmt: skip
    assert streamed == [67, 100]
    # 8 heads are one 16-head program a request, as 16 are
    assert with_stream(cfg, None, 67, LONGEST, 8, SMS) == MLA_FP8_E4M3_STREAM
    # two waves of the stream's programs, as at 100 x 16k (measured), still take it
    assert stream_programs(100 * 16384, 100, 64, E4M3_MAX_SPLIT_TOKENS, 1, SMS) == 2 * SMS
    assert with_stream(cfg, None, 100, 16384, 16, SMS) == MLA_FP8_E4M3_STREAM


def test_a_bound_far_above_the_lengths_keeps_the_split_plan() -> None:
    """SGLang's graph buffers bound a request by the context: the stream's token cap would
    then plan 9 waves of programs for 67 requests, most of them empty at 4k (never timed)."""
    assert stream_programs(67 * CONTEXT, 67, 64, E4M3_MAX_SPLIT_TOKENS, 1, SMS) == 9 * SMS
    assert with_stream(MLA_FP8_E4M3_128, None, 67, CONTEXT, 16, SMS) == MLA_FP8_E4M3_128
    # the many-heads stream has no token cap: one wave whatever the bound
    assert with_stream(MLA_HEADS_M, None, 67, CONTEXT, 64, SMS) == MLA_HEADS_M_STREAM


@pytest.mark.parametrize("heads", [64, 128])
def test_many_heads_take_their_stream_kernel_where_the_split_plan_leaves_sms_idle(heads) -> None:
    """BF16 and FP8 alike: both run the heads-as-M kernel from 64 heads."""
    for requests in range(1, HEADS_STREAM_MAX_BATCH + 1):
        idle = split_plan_sm_share(MLA_HEADS_M, requests, heads, CONTEXT, SMS) < STREAM_MIN_SM_SHARE
        want = MLA_HEADS_M_STREAM if idle else MLA_HEADS_M
        assert with_stream(MLA_HEADS_M, None, requests, CONTEXT, heads, SMS) == want, requests
    # the measured points (67 requests at 64 and 128 heads, 48 at 128: 96 programs of 132 in
    # one wave), and 66 requests, which fill the SMs with 2 splits (64 heads) or 1 (128)
    for requests in (48, 67):
        assert with_stream(MLA_HEADS_M, None, requests, CONTEXT, heads, SMS) == MLA_HEADS_M_STREAM
    assert with_stream(MLA_HEADS_M, None, 66, CONTEXT, heads, SMS) == MLA_HEADS_M


def test_the_share_rule_leaves_known_totals_and_the_widening_kernel_alone() -> None:
    # a known total of equal lengths keeps the balanced split plan
    assert with_stream(MLA_FP8_E4M3_128, 67 * 4096, 67, 4096, 16, SMS) == MLA_FP8_E4M3_128
    # below the e4m3 kernels' tokens the widening kernel was never timed against the stream
    assert pick_config(512, 16, mla=True, fp8=True, tokens=67 * 1024) == MLA_FP8_WGMMA
    assert with_stream(MLA_FP8_WGMMA, None, 67, 1024, 16, SMS) == MLA_FP8_WGMMA


@pytest.mark.parametrize("max_seq_len,splits,pieces", [
    (4096, 2, 1),  # 2k-token splits: one piece
    (65536, 2, 4),  # 32k-token splits: four pieces of 8k
    (65536, 1, 8),
    (131072, 132, 1),  # one request over every SM: 993 tokens a split
    (20000, 1, 3),  # the last piece takes the rest (3,616 tokens)
])
def test_pieces_keep_the_token_cap_without_more_programs(max_seq_len, splits, pieces) -> None:
    got, piece_len = plan_pieces(max_seq_len, splits, 128, E4M3_MAX_SPLIT_TOKENS, 256)
    assert (got, piece_len) == (pieces, E4M3_MAX_SPLIT_TOKENS)
    split_len = -(-max_seq_len // splits)  # the longest split ...
    split_len = -(-split_len // 128) * 128  # ... in whole tiles
    assert (pieces - 1) * piece_len < split_len <= pieces * piece_len


def test_pieces_stop_at_the_slots_a_request_may_take() -> None:
    # a bound of rows x context (SGLang's whole graph buffer) asks for thousands of pieces
    assert plan_pieces(256 * 131072, 2, 128, E4M3_MAX_SPLIT_TOKENS, 256)[0] == 128
    assert plan_pieces(4096, 2, 128, 0, 256) == (1, 0)  # no cap: one piece


@pytest.mark.parametrize("heads,batch,bound,plan", [
    # told the real longest length: the splits that fill a wave, the cap kept by pieces
    (16, 128, 16384, (1, 2, E4M3_MAX_SPLIT_TOKENS)),
    (16, 132, 32768, (1, 4, E4M3_MAX_SPLIT_TOKENS)),
    (8, 128, 32768, (1, 4, E4M3_MAX_SPLIT_TOKENS)),
    (16, 37, 32768, (3, 2, E4M3_MAX_SPLIT_TOKENS)),
    # told a 128k context (SGLang's graph buffers): pieces, one wave
    (16, 64, CONTEXT, (2, 8, E4M3_MAX_SPLIT_TOKENS)),
    (16, 132, CONTEXT, (1, 16, E4M3_MAX_SPLIT_TOKENS)),
    (16, 8, CONTEXT, (16, 1, 0)),  # 16 splits are the wave already
])
def test_the_token_cap_by_pieces_one_wave_at_any_bound(heads, batch, bound, plan) -> None:
    assert equal_parts_plan(MLA_FP8_E4M3_128, batch, bound, SMS) == plan
    capped = replace(MLA_FP8_E4M3_128, split_tokens_capped=True)
    splits, pieces, _ = equal_parts_plan(capped, batch, bound, SMS)
    assert pieces == 1 and splits * E4M3_MAX_SPLIT_TOKENS >= bound  # every split within the cap
