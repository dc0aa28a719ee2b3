"""The stream schedule (kernels/mla_stream.py) without its Gluon stage 1: how many programs
it launches, when it is the default, and its merge, fed by a float64 model of what stage 1
writes (each program's run of the batch's tiles, whole requests to the output, cut pieces to
slot 1 where the request begins and slot 0 elsewhere). On the GPU, test_mla_variants.py runs
the kernel itself against the reference with the same cuts."""

import math

import pytest
import torch
from tessera.kernels.paged_decode_split import (
    E4M3_MAX_SPLIT_TOKENS,
    HEADS_STREAM_MAX_BATCH,
    HEADS_STREAM_MIN_TOKENS,
    MLA_FP8_E4M3_STREAM,
    MLA_HEADS_M,
    MLA_HEADS_M_STREAM,
    STREAM_MAX_BATCH,
    STREAM_MIN_TOKENS,
    _stream_merge_kernel,
    pick_config,
    prefers_stream,
    stream_programs,
    with_stream,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_N = 64
SMS = 132  # an H200's


@pytest.mark.parametrize("head_blocks", [1, 2, 3])
@pytest.mark.parametrize(
    ("tokens", "batch"),
    [(1, 1), (4096, 1), (245_760, 64), (2_162_688, 132), (16_777_216, 4096)],
)
def test_stream_runs_stay_within_the_split_cap_in_whole_waves(tokens, batch, head_blocks):
    sms = 132
    programs = stream_programs(tokens, batch, BLOCK_N, E4M3_MAX_SPLIT_TOKENS, head_blocks, sms)
    tiles = math.ceil(tokens / BLOCK_N) + batch  # the most tiles these tokens fill
    assert math.ceil(tiles / programs) * BLOCK_N <= E4M3_MAX_SPLIT_TOKENS
    waves = math.ceil(programs * head_blocks / sms)
    assert programs == waves * sms // head_blocks  # whole waves of one program an SM
    assert waves == 1 or (waves - 1) * sms // head_blocks * E4M3_MAX_SPLIT_TOKENS < tiles * 64
    assert stream_programs(tokens, batch, BLOCK_N, 0, head_blocks, sms) == sms // head_blocks
    two = stream_programs(tokens, batch, BLOCK_N, 0, head_blocks, sms, waves=2)
    assert two == 2 * sms // head_blocks


def test_the_stream_schedule_is_the_default_for_uneven_batches_only():
    """Uneven lengths (the 1k-8k mix: 0.47 of batch x the longest) from STREAM_MIN_TOKENS;
    equal lengths, small batches and unknown totals keep the split plans."""
    mix = [1024, 2048, 4096, 8192] * 16
    assert prefers_stream(sum(mix), len(mix), max(mix))
    assert not prefers_stream(None, len(mix), max(mix))  # SGLang's adapter: no total
    assert not prefers_stream(64 * 8192, 64, 8192)  # equal lengths
    assert not prefers_stream(sum(mix[:16]), 16, 8192)  # 61,440 tokens
    assert sum(mix[:32]) >= STREAM_MIN_TOKENS and prefers_stream(sum(mix[:32]), 32, 8192)
    many = [64, 8192] * (STREAM_MAX_BATCH // 2)  # uneven, but past what the schedule takes
    assert prefers_stream(sum(many), len(many), 8192)
    assert not prefers_stream(sum(many) + 64, len(many) + 1, 8192)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_uneven_batches_take_the_stream_kernel_of_their_head_count(heads, fp8):
    """16 heads: FP8 takes the e4m3 kernel on the stream (BF16 has no stream kernel); 64+
    heads: the heads-as-M kernel on it, BF16 and FP8, for up to HEADS_STREAM_MAX_BATCH
    requests (their ends share the kernel's shared memory)."""
    mix = [1024, 2048, 4096, 8192] * 16
    cfg = pick_config(512, heads, mla=True, fp8=fp8, tokens=sum(mix))
    streamed = with_stream(cfg, sum(mix), len(mix), max(mix), heads, SMS)
    if heads >= 64:
        assert (cfg, streamed) == (MLA_HEADS_M, MLA_HEADS_M_STREAM)
    else:
        assert streamed == (MLA_FP8_E4M3_STREAM if fp8 else cfg)
    assert with_stream(cfg, len(mix) * 8192, len(mix), 8192, heads, SMS) == cfg  # equal lengths
    assert with_stream(cfg, None, len(mix), max(mix), heads, SMS) == cfg  # no total given
    small = mix[:16]  # 61,440 tokens: the heads-as-M kernel's smallest stream batch
    assert sum(small) == HEADS_STREAM_MIN_TOKENS < STREAM_MIN_TOKENS
    want = MLA_HEADS_M_STREAM if heads >= 64 else cfg
    assert with_stream(cfg, sum(small), 16, 8192, heads, SMS) == want
    assert with_stream(cfg, sum(mix[:8]), 8, 8192, heads, SMS) == cfg
    many = [64, 8192] * (HEADS_STREAM_MAX_BATCH // 2 + 1)
    past = with_stream(cfg, sum(many), len(many), 8192, heads, SMS)
    assert past == (cfg if heads >= 64 or not fp8 else MLA_FP8_E4M3_STREAM)


def stage_one(lens, programs, q, k, v):
    """What stage 1 leaves: (the output with the whole requests written, the partial outputs
    ``[programs, heads, 2, dv]`` and their base-2 log-sum-exps), NaN where nothing is written."""
    batch, heads, dv = q.shape[0], q.shape[1], v.shape[-1]
    tiles = [math.ceil(n / BLOCK_N) for n in lens]
    ends = [sum(tiles[: b + 1]) for b in range(batch)]
    per_program = math.ceil(sum(tiles) / programs)
    out = torch.full((batch, heads, dv), float("nan"), dtype=torch.float64)
    part_out = torch.full((programs, heads, 2, dv), float("nan"), dtype=torch.float64)
    part_lse = torch.full((programs, heads, 2), float("nan"), dtype=torch.float64)
    for p in range(programs):
        lo = min(p * per_program, ends[-1])
        hi = min(lo + per_program, ends[-1])
        t = lo
        while t < hi:
            b = sum(e <= t for e in ends)
            first, last = ends[b] - tiles[b], ends[b]
            tokens = slice((t - first) * BLOCK_N, min((min(last, hi) - first) * BLOCK_N, lens[b]))
            scores = torch.einsum("hd,nd->hn", q[b], k[b, tokens])
            o = scores.softmax(-1) @ v[b, tokens]
            if first >= lo and last <= hi:
                out[b] = o
            else:
                slot = int(first >= lo)
                part_out[p, :, slot] = o
                part_lse[p, :, slot] = torch.logsumexp(scores, -1) / math.log(2)
            t = min(last, hi)
    return out, part_out, part_lse


@pytest.mark.parametrize("programs", [1, 3, 8, 40])
@pytest.mark.parametrize("sglang_form", [False, True])
def test_stream_merge_joins_the_cut_requests(programs, sglang_form):
    """Empty requests, requests inside one run, and requests cut across up to all runs: the
    merge writes the cut and empty ones and leaves the whole ones as stage 1 wrote them."""
    lens = [0, 1, 64, 65, 700, 0, 3001, 130, 63, 0]
    heads, dim, dv = 4, 32, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(lens), heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(len(lens), max(lens), dim, generator=gen, dtype=torch.float64) / 4
    v = torch.randn(len(lens), max(lens), dv, generator=gen, dtype=torch.float64)
    out, part_out, part_lse = stage_one(lens, programs, q, k, v)
    ref = torch.zeros(len(lens), heads, dv, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n:
            ref[b] = torch.einsum("hd,nd->hn", q[b], k[b, :n]).softmax(-1) @ v[b, :n]
    starts = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    seq_lens = starts[1:] if sglang_form else torch.tensor(lens, dtype=torch.int32)
    out, part_out, part_lse = (x.float().to(DEVICE) for x in (out, part_out, part_lse))
    _stream_merge_kernel[(len(lens), heads)](
        part_out, part_lse, out, seq_lens.to(DEVICE), starts.to(DEVICE), len(lens), programs,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), out.stride(0), out.stride(1),
        LENS_ARE_ENDS=sglang_form, BLOCK_N=BLOCK_N, BATCH_P2=16, DV=dv,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)
