"""Paged decode attention (GQA and MLA, BF16 and FP8 pages) against float64 references.

Every case draws fresh random data and a shuffled page table, and passes an output filled with
NaN, so an unwritten element fails. Tolerances (BENCHMARKS.md): the FP8 kernels against
attention over the dequantized cache, atol 1e-2 and rel-L2 <= 5e-3; FP8 against BF16 KV on
N(0, 1) data, rel-L2 <= 6e-2 and 1 - cosine <= 2e-3. The BF16 kernels multiply bf16
probabilities with bf16 V (as SGLang's and flash attention's kernels do); on the few-token
requests here that alone reaches rel-L2 5e-3, so they get bf16's 1e-2.
"""

import math

import pytest
import torch
from tessera.kernels.fp8_kv_quant import write_kv_fp8_ref
from tessera.kernels.paged_decode_bf16 import (
    paged_decode_bf16,
    paged_decode_bf16_ref,
    paged_decode_mla_bf16,
    paged_decode_mla_bf16_ref,
)
from tessera.kernels.paged_decode_fp8 import (
    paged_decode_fp8,
    paged_decode_fp8_ref,
    paged_decode_mla_fp8,
    paged_decode_mla_fp8_ref,
)
from tessera.kernels.paged_decode_split import (
    E4M3_IN_PLACE_MIN_TOKENS,
    E4M3_MAX_SPLIT_TOKENS,
    E4M3_MIN_TOKENS,
    MAX_SPLITS,
    MLA_FP8_E4M3,
    MLA_FP8_E4M3_128,
    MLA_FP8_E4M3_IN_PLACE,
    MLA_FP8_TRITON,
    MLA_FP8_WGMMA,
    MLA_HEADS_M,
    DecodeConfig,
    _merge_at_once_kernel,
    _merge_kernel,
    cap_split_tokens,
    merge_dims_a_program,
    pick_config,
    plan_balanced_splits,
    plan_balanced_waves,
    plan_splits,
)
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REL_L2 = {"bf16": 1e-2, "fp8": 5e-3}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_table(lens: list[int], page_size: int, sglang_form: bool) -> tuple[PageTable, int]:
    """Requests of ``lens`` tokens on shuffled pages (plus spare pages nobody owns)."""
    counts = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(counts) + 3
    perm = torch.randperm(num_pages).tolist()
    pages, at = [], 0
    for c in counts:
        pages.append(perm[at : at + c])
        at += c
    table = PageTable.from_page_lists(pages, lens, page_size, DEVICE)
    if sglang_form:  # token-level kv_indptr / kv_indices, as SGLang's triton backend has them
        slots = [table.token_slots(b) for b in range(len(lens))]
        indptr = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
        indices = torch.cat(slots).to(torch.int32)
        table = PageTable.from_sglang(indptr, indices, table.seq_lens, page_size)
    return table, num_pages


def quantized(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 copy of a paged BF16 cache with per-(token, head) scales (byte-exact with the
    kernel, see test_fp8_kv_quant; the reference is faster under the interpreter)."""
    cache = torch.empty(rows.shape, dtype=FP8_DTYPE, device=rows.device)
    scale = torch.empty(rows.shape[:-1], device=rows.device)
    slots = torch.arange(rows.shape[0] * rows.shape[1], device=rows.device)
    write_kv_fp8_ref(rows.flatten(0, 1), cache, scale, slots)
    return cache, scale


def poisoned(batch: int, heads: int, dim: int) -> torch.Tensor:
    return torch.full((batch, heads, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel_l2: float) -> None:
    assert out.isfinite().all(), "unwritten or non-finite output"
    err = out.float() - ref
    # atol 1e-2, plus rtol 1e-2: a bf16 output of magnitude 2..4 is already rounded by 2^-8.
    worst = (err.abs() - 1e-2 * ref.abs()).max()
    assert worst <= 1e-2, f"max |err| - 1e-2 |ref| = {worst:.3g}"
    rel = err.norm() / ref.norm()
    assert rel <= rel_l2, f"rel-L2 {rel:.3g}"


def lengths_known(lens: list[int], balanced: bool) -> dict:
    """The balanced split plan's arguments (the batch's total and longest length), or none."""
    return {"max_seq_len": max(lens), "total_tokens": sum(lens)} if balanced else {}


def run_gqa(kv_dtype, lens, page_size, heads, kv_heads, dim, sglang_form=False, max_len=None,
            balanced=False, config=None):  # fmt: skip
    table, num_pages = random_table(lens, page_size, sglang_form)
    known = lengths_known(lens, balanced) or {"max_seq_len": max_len}
    q = torch.randn(len(lens), heads, dim, device=DEVICE).bfloat16()
    k = torch.randn(num_pages, page_size, kv_heads, dim, device=DEVICE).bfloat16()
    v = torch.randn(num_pages, page_size, kv_heads, dim, device=DEVICE).bfloat16()
    sm_scale = dim**-0.5
    out = poisoned(len(lens), heads, dim)
    if kv_dtype == "bf16":
        paged_decode_bf16(q, k, v, table, sm_scale, out=out, config=config, **known)
        ref = paged_decode_bf16_ref(q, k, v, table, sm_scale)
    else:
        (k8, ks), (v8, vs) = quantized(k), quantized(v)
        paged_decode_fp8(q, k8, v8, ks, vs, table, sm_scale, out=out, config=config, **known)
        ref = paged_decode_fp8_ref(q, k8, v8, ks, vs, table, sm_scale)
    assert_close(out, ref, REL_L2[kv_dtype])
    return out, paged_decode_bf16_ref(q, k, v, table, sm_scale)


def run_mla(kv_dtype, lens, page_size, heads, latent=512, config=None, balanced=False,
            sglang_form=False):  # fmt: skip
    table, num_pages = random_table(lens, page_size, sglang_form)
    known = lengths_known(lens, balanced)
    q = torch.randn(len(lens), heads, latent + 64, device=DEVICE).bfloat16()
    kv = torch.randn(num_pages, page_size, 1, latent + 64, device=DEVICE).bfloat16()
    sm_scale = (128 + 64) ** -0.5
    out = poisoned(len(lens), heads, latent)
    if kv_dtype == "bf16":
        paged_decode_mla_bf16(q, kv, table, sm_scale, out=out, config=config, **known)
        ref = paged_decode_mla_bf16_ref(q, kv, table, sm_scale)
    else:
        kv8, s = quantized(kv)
        paged_decode_mla_fp8(q, kv8, s, table, sm_scale, out=out, config=config, **known)
        ref = paged_decode_mla_fp8_ref(q, kv8, s, table, sm_scale)
    assert_close(out, ref, REL_L2[kv_dtype])


def test_lengths_read_from_sglang_indptr_match_explicit_lengths():
    """SGLang's table alone (lengths = kv_indptr differences, taken by the kernel): the same
    output as with the lengths given, also when kv_indptr runs past the batch (SGLang's
    buffers are sized for the largest CUDA-graph batch)."""
    lens, page_size, heads, kv_heads, dim = [37, 1, 70], 16, 4, 2, 64
    explicit, num_pages = random_table(lens, page_size, sglang_form=True)
    padded = torch.cat([explicit.indptr, explicit.indptr[-1:].repeat(4)])
    from_indptr = PageTable.from_sglang_indptr(padded, explicit.indices, len(lens), page_size)
    assert from_indptr.lengths().tolist() == lens
    q = torch.randn(len(lens), heads, dim, device=DEVICE).bfloat16()
    k, v = (torch.randn(num_pages, page_size, kv_heads, dim, device=DEVICE).bfloat16()
            for _ in range(2))  # fmt: skip
    outs = [paged_decode_bf16(q, k, v, t, dim**-0.5, out=poisoned(len(lens), heads, dim))
            for t in (explicit, from_indptr)]  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[1], paged_decode_bf16_ref(q, k, v, from_indptr, dim**-0.5), REL_L2["bf16"])


def test_a_table_bounds_its_batch_tokens_without_a_sync():
    """``max_tokens`` (the kernel choice's bound when the total is not given) covers the
    batch's total in both forms, and for SGLang's token slots is that total."""
    lens = [37, 1, 70]
    for sglang_form in (False, True):
        table, _ = random_table(lens, 16, sglang_form=sglang_form)
        assert sum(lens) <= table.max_tokens <= sum(-(-n // 16) * 16 for n in lens)
    slots = PageTable.from_sglang_indptr(table.indptr, table.indices, len(lens), 16)
    assert slots.max_tokens == table.indices.numel() == sum(lens)


def test_lengths_as_ends_need_token_slots():
    table, _ = random_table([5, 9], 4, sglang_form=False)
    with pytest.raises(ValueError, match="seq_lens_are_ends needs token slots"):
        PageTable(table.indptr, table.indices, table.indptr[1:], 4, 1, seq_lens_are_ends=True)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize(
    ("lens", "page_size", "heads", "kv_heads", "dim", "sglang_form"),
    [
        ([37, 1, 70], 16, 4, 2, 64, False),
        ([5, 130], 1, 2, 2, 128, True),  # MHA, page size 1 (SGLang's default)
        ([9, 66], 4, 8, 1, 256, True),
    ],
)
def test_gqa_matches_reference(kv_dtype, lens, page_size, heads, kv_heads, dim, sglang_form):
    run_gqa(kv_dtype, lens, page_size, heads, kv_heads, dim, sglang_form)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize(
    ("heads", "config"),
    [
        (16, None),  # the default: latent in quarters
        (20, DecodeConfig(32, 16, 4, 2)),  # one 576-wide tile (the generic kernel), 2 head blocks
        (64, None),  # 64 heads a program
    ],
)
def test_mla_matches_reference(kv_dtype, heads, config):
    run_mla(kv_dtype, [3, 41], 16, heads=heads, config=config)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_mla_pages_wider_than_tiles(kv_dtype):
    """64-token pages hold several tiles: the kernel reads one page entry per tile."""
    run_mla(kv_dtype, [3, 100, 130], 64, heads=16)


def test_whole_wave_split_plan_never_starts_a_second_wave():
    for programs in (1, 8, 63, 64, 65, 132, 400, 1000):
        splits = plan_splits(programs, 1 << 20, 32, 132, 3, whole_waves=True)
        assert programs * splits <= max(3 * 132, programs)
        assert programs * (splits + 1) > 3 * 132 or splits == 64  # and fills it
    # short contexts keep at least four tiles a split
    assert plan_splits(8, 1000, 32, 132, 3, whole_waves=True) == 8
    # the default (bandwidth-bound kernels) rounds up
    assert plan_splits(64, 1 << 20, 32, 132) == 9


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_balanced_splits_match_reference(kv_dtype):
    """Mixed lengths with the batch's total known: the long request gets several fixed-size
    splits, the short ones one (some splits of the grid are past their request's end)."""
    run_mla(kv_dtype, [3, 41, 300, 700], 16, heads=16, balanced=True)
    small_tiles = DecodeConfig(16, 16, 4, 2)  # 64-token splits at least: several for 170
    run_gqa(kv_dtype, [37, 1, 170], 8, 4, 2, 64, balanced=True, config=small_tiles)


def test_a_max_seq_len_below_the_longest_request_drops_no_tokens():
    """The plan trusts ``max_seq_len``; if it is short, the last split takes the rest."""
    table, num_pages = random_table([300, 40], 16, sglang_form=False)
    q = torch.randn(2, 16, 576, device=DEVICE).bfloat16()
    kv = torch.randn(num_pages, 16, 1, 576, device=DEVICE).bfloat16()
    out = poisoned(2, 16, 512)
    paged_decode_mla_bf16(q, kv, table, 0.07, out=out, max_seq_len=130, total_tokens=340)
    assert_close(out, paged_decode_mla_bf16_ref(q, kv, table, 0.07), REL_L2["bf16"])


def test_e4m3_splits_never_exceed_their_token_cap():
    """The e4m3 kernels' error grows with a split's tiles, so both plans get more splits
    rather than longer ones; other kernels are left alone."""
    cap = E4M3_MAX_SPLIT_TOKENS
    assert MLA_FP8_E4M3.max_split_tokens == cap == MLA_FP8_E4M3_IN_PLACE.max_split_tokens
    assert MLA_FP8_WGMMA.max_split_tokens == 0
    # equal parts: 128 requests of 16k got one split each
    assert cap_split_tokens(1, 0, 16384, cap, 64) == (2, 0)
    assert cap_split_tokens(4, 0, 16384, cap, 64) == (4, 0)  # already short enough
    assert cap_split_tokens(1, 0, 16384, 0, 64) == (1, 0)  # no cap
    # balanced: the fixed length shrinks and the splits follow it
    assert cap_split_tokens(1, 16384, 16384, cap, 64) == (2, cap)
    assert cap_split_tokens(3, 4096, 9000, cap, 64) == (3, 4096)
    # past MAX_SPLITS splits of the cap, the longest request sets the length
    splits, length = cap_split_tokens(1, 10**6, 10**6, cap, 64)
    assert splits <= 64 and splits * length >= 10**6 and length % 64 == 0
    for length_now in (1, 8191, 8192, 8193, 100_000):
        splits, _ = cap_split_tokens(1, 0, length_now, cap, 64)
        part = math.ceil(math.ceil(length_now / splits) / 64) * 64  # split_range's parts
        assert part <= cap


def test_balanced_plan_gives_every_split_the_same_tokens():
    # GLM 5's slice at 205 requests of the 1k-8k mix on 132 SMs x 3 programs
    splits, split_len = plan_balanced_splits(784_384, 8192, 32, 396)
    assert split_len == 1984 and splits == 5  # 784,384 / 396 = 1,981 -> whole 32-token tiles
    # at least four tiles a split, at most 64 splits a request
    assert plan_balanced_splits(100, 100, 32, 396) == (1, 128)
    assert plan_balanced_splits(1 << 30, 1 << 20, 32, 1) == (1, 1 << 20)
    splits, split_len = plan_balanced_splits(1, 1 << 20, 32, 396)
    assert splits == 64 and split_len * 64 >= 1 << 20


def test_two_wave_plans_only_where_one_wave_overflows_by_much():
    """The 1k-8k mix (lengths 1024, 2048, 4096, 8192 in turn) on 132 SMs: the one-wave plan of
    16 requests fits one wave (120 programs) and that of 32 overflows it a little (152
    programs): both keep one wave; those of 64 and 256 overflow it by a third or more (counted
    from the lengths, which the planner does not see) and get the two-wave plan."""
    mix = (1024, 2048, 4096, 8192)
    for requests, waves in ((16, 1), (32, 1), (64, 2), (256, 2)):
        lens = [mix[i % 4] for i in range(requests)]
        plan = plan_balanced_waves(sum(lens), 8192, 64, 132, requests, 2)
        assert plan == plan_balanced_splits(sum(lens), 8192, 64, 132 * waves), requests
        one_wave_len = plan_balanced_splits(sum(lens), 8192, 64, 132)[1]
        programs = sum(-(-n // one_wave_len) for n in lens)
        assert (programs <= 1.2 * 132) == (waves == 1), (requests, programs)
    assert plan_balanced_waves(10**6, 8192, 64, 132, 256, 1) == plan_balanced_splits(
        10**6, 8192, 64, 132
    )


@pytest.mark.parametrize("at_once", [False, True])
def test_merge_skips_splits_past_a_request_end(at_once):
    """Stage 2 reads no output of a split whose log-sum-exp is -inf (the Gluon kernels leave it
    unwritten): NaN there changes nothing, and a request with no tokens at all merges to 0.
    Both forms: a split after the other, and every split at once over slices of the dims."""
    batch, heads, splits, dv = 2, 3, 5, 64
    part_out = torch.randn(batch, heads, splits, dv, device=DEVICE)
    part_lse = torch.randn(batch, heads, splits, device=DEVICE)
    part_lse[0, :, 2:] = float("-inf")  # request 0: its last three splits are empty
    part_out[0, :, 2:] = float("nan")
    part_lse[1] = float("-inf")  # request 1: no tokens
    part_out[1] = float("nan")
    out = torch.empty(batch, heads, dv, device=DEVICE)
    strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2), out.stride(0),
               out.stride(1))  # fmt: skip
    if at_once:
        _merge_at_once_kernel[(batch, heads, 4)](
            part_out, part_lse, out, splits, *strides, DV=dv, BLOCK_DV=16, SPLITS_P2=8,
        )  # fmt: skip
    else:
        _merge_kernel[(batch, heads)](
            part_out, part_lse, out, heads, splits, *strides, DV=dv, SPLITS_P2=8, num_warps=2
        )  # fmt: skip
    weights = torch.softmax(part_lse[0, :, :2] * math.log(2), dim=-1)  # lse is in log2 units
    expected = (weights[..., None] * part_out[0, :, :2]).sum(1)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_merge_at_once_tiles_stay_within_64_registers_a_thread():
    assert merge_dims_a_program(4, 512) == 512  # few splits: a program a head, as before
    assert merge_dims_a_program(64, 512) == 128
    assert merge_dims_a_program(132, 512) == 32  # one request over every SM: 16 programs a head
    assert merge_dims_a_program(1024, 512) == 16  # (past what any plan makes: rows stay 64 B)
    assert merge_dims_a_program(2, 32) == 32


def test_split_plans_take_their_tile_and_split_limits():
    """One request of 1k on 132 SMs, one 64-token program an SM: four tiles a split give 4
    programs, one tile 16; one of 32k is held to ``max_splits``."""
    assert plan_splits(1, 1024, 64, 132, 1, whole_waves=True) == 4
    assert plan_splits(1, 1024, 64, 132, 1, whole_waves=True, min_tiles=1) == 16
    assert plan_splits(1, 32768, 64, 132, 1, whole_waves=True, min_tiles=1) == 64
    assert plan_splits(1, 32768, 64, 132, 1, True, min_tiles=1, max_splits=256) == 132
    assert plan_balanced_splits(1024, 1024, 64, 132) == (4, 256)
    assert plan_balanced_splits(1024, 1024, 64, 132, min_tiles=1) == (16, 64)
    splits, split_len = plan_balanced_splits(32768, 32768, 64, 132, 1, max_splits=256)
    assert (splits, split_len) == (128, 256) and splits * split_len >= 32768
    assert plan_balanced_waves(1024, 1024, 64, 132, 1, 2, min_tiles=1) == (16, 64)
    assert cap_split_tokens(100, 0, 10**6, 8192, 64, max_splits=256) == (123, 0)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("balanced", [False, True])
def test_one_tile_splits_and_the_at_once_merge_match_reference(kv_dtype, balanced):
    """Splits of one tile merged at once, planned for 64 programs an SM so that the long
    request gets 69 of them (past ``MAX_SPLITS``, and 8 merge programs a head)."""
    config = DecodeConfig(16, 16, 4, 2, True, 64, whole_waves=True, min_split_tiles=1,
                          max_splits=128, merge_at_once=True)  # fmt: skip
    assert plan_splits(3, 1100, 16, 8, 64, True, 1, 128) == 69  # (the CPU's 8 "SMs")
    assert plan_balanced_splits(1171, 1100, 16, 8 * 64, 1, 128) == (69, 16)
    run_mla(kv_dtype, [1, 70, 1100], 16, heads=16, config=config, balanced=balanced)
    gqa = DecodeConfig(16, 16, 4, 2, min_split_tiles=1, max_splits=128, merge_at_once=True)
    run_gqa(kv_dtype, [37, 1, 170], 8, 4, 2, 64, balanced=balanced, config=gqa)


def test_mla_defaults_follow_the_dtype_and_head_count():
    bf16, fp8 = pick_config(512, 16, mla=True), pick_config(512, 16, mla=True, fp8=True)
    assert bf16.latent_quarters and fp8.latent_quarters
    assert (bf16.programs_per_sm, bf16.max_registers) == (4, None)
    assert fp8 == MLA_FP8_E4M3_128  # the Gluon kernel; MLA_FP8_TRITON where it cannot run
    assert (MLA_FP8_TRITON.programs_per_sm, MLA_FP8_TRITON.max_registers) == (3, 168)
    # the widening Gluon kernel from the shortest batch (one-tile splits fill the SMs)
    assert pick_config(512, 16, mla=True, fp8=True, tokens=64) == MLA_FP8_WGMMA
    tokens_in_place = E4M3_IN_PLACE_MIN_TOKENS
    assert pick_config(512, 16, mla=True, fp8=True, tokens=tokens_in_place - 1) == MLA_FP8_WGMMA
    assert pick_config(512, 16, mla=True, fp8=True, tokens=tokens_in_place) == MLA_FP8_E4M3_IN_PLACE
    in_place = pick_config(512, 16, mla=True, fp8=True, tokens=E4M3_MIN_TOKENS - 1)
    assert in_place == MLA_FP8_E4M3_IN_PLACE
    assert pick_config(512, 16, mla=True, fp8=True, tokens=E4M3_MIN_TOKENS) == MLA_FP8_E4M3_128
    longest = pick_config(512, 16, mla=True, fp8=True, tokens=1 << 21)
    assert longest == MLA_FP8_E4M3_128 and longest.block_n == 128
    # the 16-heads kernels split as short as one tile, up to 256 a request, merged at once
    for config in (bf16, MLA_FP8_WGMMA, MLA_FP8_E4M3_IN_PLACE, MLA_FP8_E4M3_128, fp8):
        assert (config.min_split_tiles, config.max_splits, config.merge_at_once) == (1, 256, True)
    # one request of 1k at BF16: 32 one-tile splits, where four-tile ones gave 8
    assert plan_splits(1, 1024, bf16.block_n, 132, bf16.programs_per_sm, bf16.whole_waves,
                       bf16.min_split_tiles, bf16.max_splits) == 32  # fmt: skip
    assert MLA_HEADS_M.max_splits == MAX_SPLITS and not MLA_HEADS_M.merge_at_once
    # 64+ heads: the Gluon heads-as-M kernel, both dtypes, every batch (MLA_HEADS_TRITON where
    # it cannot run: the interpreter runs it in test_mla_matches_reference's 64 heads)
    for heads, fp8, tokens in ((64, False, 1024), (128, True, 64 * 4096), (64, True, None)):
        assert pick_config(512, heads, mla=True, fp8=fp8, tokens=tokens) == MLA_HEADS_M


def test_per_tensor_scales_read_through_a_stride_0_view():
    table, num_pages = random_table([21, 3], 8, sglang_form=True)
    q = torch.randn(2, 4, 64, device=DEVICE).bfloat16()
    k, v = (torch.randn(num_pages, 8, 2, 64, device=DEVICE).bfloat16() * 3 for _ in range(2))
    ks, vs = torch.tensor(0.02, device=DEVICE), torch.tensor(0.01, device=DEVICE)
    k8, v8 = (torch.empty(k.shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2))
    slots = torch.arange(num_pages * 8, device=DEVICE)
    write_kv_fp8_ref(k.flatten(0, 1), k8, ks, slots)
    write_kv_fp8_ref(v.flatten(0, 1), v8, vs, slots)
    out = poisoned(2, 4, 64)
    paged_decode_fp8(q, k8, v8, ks, vs, table, 0.125, out=out)
    assert_close(out, paged_decode_fp8_ref(q, k8, v8, ks, vs, table, 0.125), REL_L2["fp8"])


def test_splits_longer_than_the_request_and_empty_requests_give_zeros():
    # max_seq_len far above the real lengths makes most splits empty; request 1 has no tokens
    out, _ = run_gqa("bf16", [7, 0, 19], 4, 4, 2, 64, max_len=4096)
    assert (out[1] == 0).all()


def test_fp8_close_to_bf16_kv():
    out, bf16_ref = run_gqa("fp8", [300, 77], 16, 8, 2, 128)
    err = (out.float() - bf16_ref).norm() / bf16_ref.norm()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), bf16_ref.flatten(), dim=0)
    assert err <= 6e-2
    assert 1 - cos <= 2e-3


def test_bad_input_says_what_is_wrong():
    table, num_pages = random_table([5, 9], 4, sglang_form=False)
    q = torch.randn(2, 4, 64, device=DEVICE).bfloat16()
    k = torch.randn(num_pages, 4, 2, 64, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="q must be bfloat16"):
        paged_decode_bf16(q.float(), k, k, table, 0.1)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        paged_decode_bf16(q[:, :3], k, k, table, 0.1)
    with pytest.raises(ValueError, match="q has 1 requests but the page table 2"):
        paged_decode_bf16(q[:1], k, k, table, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_bf16(q[..., :48], k[..., :48], k[..., :48], table, 0.1)
    with pytest.raises(ValueError, match="MLA needs one KV head"):
        paged_decode_mla_bf16(q, k, table, 0.1)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        paged_decode_fp8(q, k, k, torch.tensor(1.0), torch.tensor(1.0), table, 0.1)
    with pytest.raises(ValueError, match="entries_per_page must be 1"):
        PageTable(table.indptr, table.indices, table.seq_lens, 4, entries_per_page=2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize(
    ("batch", "max_len", "heads", "kv_heads", "dim"),
    [(64, 4500, 32, 8, 128), (7, 9001, 64, 8, 128), (33, 2049, 16, 16, 64), (5, 3001, 8, 2, 256)],
)
@pytest.mark.parametrize(("sglang_form", "balanced"), [(False, False), (True, False), (True, True)])
def test_gqa_real_shapes_gpu(
    kv_dtype, page_size, batch, max_len, heads, kv_heads, dim, sglang_form, balanced
):
    lens = torch.randint(1, max_len + 1, (batch,)).tolist()
    lens[0] = max_len
    run_gqa(kv_dtype, lens, page_size, heads, kv_heads, dim, sglang_form, balanced=balanced)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize(
    ("batch", "max_len", "heads"),
    # 96 requests of up to 8k: about 393k tokens, where the FP8 default at 16 heads is the
    # kernel whose consumer writes the query (E4M3_Q_IN_CONSUMER_MIN_TOKENS)
    [(32, 4097, 16), (96, 8192, 16), (9, 8191, 64), (3, 999, 128)],
)
@pytest.mark.parametrize("balanced", [False, True])
def test_mla_real_shapes_gpu(kv_dtype, page_size, batch, max_len, heads, balanced):
    lens = torch.randint(1, max_len + 1, (batch,)).tolist()
    lens[-1] = max_len
    run_mla(kv_dtype, lens, page_size, heads, balanced=balanced)
