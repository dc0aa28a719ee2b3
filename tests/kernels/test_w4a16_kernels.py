"""INT4 GEMM and fused MoE kernels against their pure-torch references.

On CPU they run under the Triton interpreter at small, odd shapes; with a GPU the ``gpu`` tests
add real decode shapes. Tolerance (BENCHMARKS.md): rel-L2 <= 5e-3 against fp32 on the
dequantized weights.
"""

import dataclasses

import pytest
import torch
import triton
from tessera.kernels import w4a16_gemm as gemm_module
from tessera.kernels import w4a16_moe as moe_module
from tessera.kernels.w4a16_format import W4A16Weight, dequantize, quantize_rtn
from tessera.kernels.w4a16_gemm import (
    GemmConfig,
    _candidates,
    capture_graph,
    counted_workspace,
    w4a16_dequantize,
    w4a16_matmul,
    w4a16_matmul_reference,
)
from tessera.kernels.w4a16_moe import (
    MoeConfig,
    align_to_experts,
    fused_moe,
    fused_moe_reference,
)

REL_L2 = 5e-3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


pytestmark = pytest.mark.usefixtures("gpu_like_interpreter")


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_weight(shape, group, symmetric, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(shape, generator=g), group, symmetric).to(DEVICE)


def make_x(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)


# (M, N, K, group, symmetric, split_k): odd M and N, K not a multiple of the 128 step,
# both scale paths (group == step, group < step), zeros, split-K.
GEMM_CASES = [
    (1, 40, 256, 128, True, 1),
    (3, 33, 384, 32, False, 1),
    (5, 72, 384, 64, True, 3),
    (17, 64, 160, 32, True, 2),
    (2, 48, 256, 128, False, 2),
]


@pytest.mark.parametrize("m,n,k,group,symmetric,split_k", GEMM_CASES)
def test_gemm_matches_reference(m, n, k, group, symmetric, split_k):
    w = make_weight((n, k), group, symmetric, seed=n + k)
    x = make_x(m, k, seed=m)
    out = w4a16_matmul(x, w, GemmConfig(block_n=32, split_k=split_k))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_l2(out, w4a16_matmul_reference(x, w)) <= REL_L2


# (M, N, K, group, symmetric, split_k, block_m): the weights as the dot's first operand
SWAP_CASES = [
    (1, 40, 256, 128, False, 1, 8),
    (5, 72, 384, 128, True, 3, 8),
    (3, 33, 384, 32, False, 1, 8),
    (2, 48, 256, 64, True, 2, 8),
    (17, 64, 160, 32, True, 2, 16),
    (20, 40, 256, 128, False, 1, 32),
]


@pytest.mark.parametrize("m,n,k,group,symmetric,split_k,block_m", SWAP_CASES)
def test_swapped_gemm_matches_reference(m, n, k, group, symmetric, split_k, block_m):
    w = make_weight((n, k), group, symmetric, seed=n + k)
    x = make_x(m, k, seed=m)
    cfg = GemmConfig(block_m=block_m, block_n=32, split_k=split_k, swap=True)
    out = w4a16_matmul(x, w, cfg)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_l2(out, w4a16_matmul_reference(x, w)) <= REL_L2


def workspace_is_zero() -> bool:
    return all(not buf.any() for bufs in gemm_module._WORKSPACES.values() for buf in bufs)


def test_split_calls_leave_the_workspace_zero():
    """K splits meet in one buffer per device that no launch zeroes: the program that adds an
    element's last part resets its sum and count. Back-to-back calls of different shapes,
    paths and split counts (dense tile, dense gemv, MoE up with SiLU and down with the top-k
    sum) each match their reference, and the buffer is all zero after them."""
    w = make_weight((72, 384), 64, False, seed=3)
    for i, cfg in enumerate((GemmConfig(block_n=32, split_k=3),
                             GemmConfig(block_m=8, block_n=32, split_k=2, swap=True),
                             GemmConfig("gemv", block_n=32, block_k=64, split_k=4))):  # fmt: skip
        x = make_x(3, 384, seed=10 + i)
        assert rel_l2(w4a16_matmul(x, w, cfg), w4a16_matmul_reference(x, w)) <= REL_L2, cfg
        assert workspace_is_zero(), cfg
    w13, w2, x, ids, weights = moe_case(4, 384, 96, 3, 2, 32, 32, True, seed=9)
    split = MoeConfig(block_m=8, block_n=32, swap=True, split_k=3)
    out = fused_moe(x, w13, w2, weights, ids, configs=(split, split))
    assert rel_l2(out, fused_moe_reference(x, w13, w2, weights, ids)) <= REL_L2
    assert workspace_is_zero()
    sums, counts = counted_workspace(torch.device(DEVICE), 10, 6)
    assert sums.dtype == torch.float32 and counts.dtype == torch.int32 and counts.numel() == 6


def test_zeroed_output_split_matches_reference():
    """The three-launch split (fp32 atomics into a zeroed output, then a cast) that the
    counted one replaces by default."""
    w = make_weight((72, 384), 64, True, seed=4)
    x = make_x(5, 384, seed=5)
    out = w4a16_matmul(x, w, GemmConfig(block_n=32, split_k=3, counted=False))
    assert out.dtype == torch.bfloat16
    assert rel_l2(out, w4a16_matmul_reference(x, w)) <= REL_L2


# (M, N, K, group, symmetric, BLOCK_N, BLOCK_K, split_k): odd N, K not a multiple of the step,
# groups smaller and larger than the step, zeros, split-K with an empty part
GEMV_CASES = [
    (1, 40, 256, 128, True, 32, 128, 1),
    (3, 33, 384, 32, False, 32, 64, 2),
    (2, 72, 512, 64, True, 64, 128, 3),
    (1, 64, 640, 128, False, 32, 128, 8),
]


@pytest.mark.parametrize("m,n,k,group,symmetric,bn,bk,split_k", GEMV_CASES)
def test_gemv_matches_reference(m, n, k, group, symmetric, bn, bk, split_k):
    """The CUDA-core path for a few tokens (on the GPU its fp16x2 PTX decode, in the
    interpreter the same kernel with exact fp32 products)."""
    w = make_weight((n, k), group, symmetric, seed=n)
    x = make_x(m, k, seed=k)
    out = w4a16_matmul(x, w, GemmConfig("gemv", block_n=bn, block_k=bk, split_k=split_k))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_l2(out, w4a16_matmul_reference(x, w)) <= REL_L2


@gpu
@needs_gpu
@pytest.mark.parametrize("group,symmetric", [(128, True), (32, False)])
def test_gemv_fp16_decode_real_shapes(group, symmetric):
    """The fp16x2 decode against the fp32 reference at a real shape, with activations up to
    fp16's range (the 1/64 unit keeps every product and partial sum finite) and the plain
    decode of the same kernel."""
    w = make_weight((7168, 2048), group, symmetric, seed=group)
    x = make_x(2, 2048, seed=1)
    x[1] *= 4096  # |x| up to about 2e4
    ref = w4a16_matmul_reference(x, w)
    for split in (1, 4):
        cfg = GemmConfig("gemv", block_n=256, split_k=split)
        fast = w4a16_matmul(x, w, cfg)
        plain = w4a16_matmul(x, w, dataclasses.replace(cfg, fast_decode=False))
        assert torch.isfinite(fast).all()
        assert rel_l2(fast, ref) <= REL_L2 and rel_l2(plain, ref) <= REL_L2


@pytest.mark.parametrize("group,symmetric", [(32, False), (128, True)])
def test_dequantize_kernel_is_exact(group, symmetric):
    w = make_weight((24, 256), group, symmetric, seed=group)
    expected = dequantize(w, torch.float32).transpose(0, 1).to(torch.bfloat16)
    assert torch.equal(w4a16_dequantize(w), expected)


def test_dequantize_then_matmul_path():
    w = make_weight((40, 256), 128, True, seed=7)
    x = make_x(3, 256, seed=3)
    out = w4a16_matmul(x, w, GemmConfig(path="dequant_cublas"))
    assert rel_l2(out, w4a16_matmul_reference(x, w)) <= REL_L2


def test_gemm_rejects_bad_input():
    w = make_weight((16, 128), 128, True, seed=1)
    with pytest.raises(ValueError, match="bf16"):
        w4a16_matmul(make_x(2, 128, 0).float(), w)
    with pytest.raises(ValueError, match=r"\[M, 128\]"):
        w4a16_matmul(make_x(2, 256, 0), w)
    experts = make_weight((2, 16, 128), 128, True, seed=1)
    with pytest.raises(ValueError, match="w4a16_moe"):
        w4a16_matmul(make_x(2, 128, 0), experts)
    assert w4a16_matmul(make_x(0, 128, 0), w).shape == (0, 16)


def test_align_to_experts_places_every_pair_once():
    g = torch.Generator().manual_seed(0)
    experts, tokens, top_k, block_m = 7, 9, 3, 4
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    pair_ids, block_expert = align_to_experts(ids, experts, block_m)
    num_pairs = tokens * top_k
    real = pair_ids[pair_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    used = block_expert >= 0
    assert bool((block_expert[: int(used.sum())] >= 0).all())  # used blocks come first
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = pair_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        if e < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == e).all())


def test_blocks_of_one_row_are_the_pairs_in_order_with_their_routed_experts():
    """The gemv path's blocks: no sort and no launch, every pair its own block."""
    ids = torch.tensor([[3, 0], [0, 2], [1, 3]], device=DEVICE)
    pair_ids, block_expert = moe_module.expert_blocks(ids, 4, 1)
    assert pair_ids.tolist() == list(range(6)) and pair_ids.dtype == torch.int32
    assert block_expert.tolist() == [3, 0, 0, 2, 1, 3]
    assert moe_module.expert_blocks(ids, 4, 1)[0] is pair_ids  # made once
    aligned = zip(moe_module.expert_blocks(ids, 4, 8), align_to_experts(ids, 4, 8), strict=True)
    for got, want in aligned:
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "experts,tokens,top_k,block_m,chunk",
    [
        (7, 9, 3, 4, None),
        (40, 33, 8, 16, None),
        (5, 1, 2, 8, None),
        (40, 33, 8, 16, 64),  # 5 chunks, the last one partial
        (300, 50, 8, 8, 128),  # more experts than a chunk has pairs
        (384, 192, 8, 16, None),  # 1,536 pairs: six chunks of the real size
    ],
)
def test_align_kernel_matches_torch_ops(experts, tokens, top_k, block_m, chunk):
    """The Triton alignment (one launch, or per chunk then a scatter) gives exactly the blocks
    of the torch version."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids = ids.to(DEVICE)
    sizes = {} if chunk is None else {"one_program": chunk, "chunk": chunk}
    pair_ids, block_expert = align_to_experts(ids, experts, block_m, **sizes)
    ref_pairs, ref_blocks = moe_module.align_to_experts_reference(ids, experts, block_m)
    assert torch.equal(pair_ids.cpu(), ref_pairs.cpu())
    assert torch.equal(block_expert.cpu(), ref_blocks.cpu())


@gpu
@needs_gpu
@pytest.mark.parametrize("tokens", [1, 64, 65, 128, 129, 192, 1024])
@pytest.mark.parametrize("experts,top_k,block_m", [(384, 8, 16), (256, 8, 8), (48, 1, 16)])
def test_align_kernel_matches_torch_ops_at_model_sizes(experts, top_k, block_m, tokens):
    """Kimi K2's and GLM 5's routers and one EP-8 GPU's experts, on both sides of one chunk."""
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    got = align_to_experts(ids, experts, block_m)
    want = moe_module.align_to_experts_reference(ids, experts, block_m)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


MOE_CASES = [  # (experts, hidden, inter, tokens, top_k, group up, group down, symmetric)
    (6, 128, 64, 5, 3, 128, 64, True),
    (5, 256, 96, 7, 2, 32, 32, False),
]


def moe_case(experts, hidden, inter, tokens, top_k, g13, g2, symmetric, seed):
    """INT4 experts, activations and a random top-k routing (weights summing to 1)."""
    g = torch.Generator().manual_seed(tokens)
    w13 = make_weight((experts, 2 * inter, hidden), g13, symmetric, seed=seed)
    w2 = make_weight((experts, hidden, inter), g2, symmetric, seed=seed + 1)
    x = make_x(tokens, hidden, seed=seed + 2)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return w13, w2, x, ids.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("experts,hidden,inter,tokens,top_k,g13,g2,symmetric", MOE_CASES)
def test_fused_moe_matches_reference(experts, hidden, inter, tokens, top_k, g13, g2, symmetric):
    w13, w2, x, ids, weights = moe_case(experts, hidden, inter, tokens, top_k, g13, g2,
                                        symmetric, seed=1)  # fmt: skip
    small, wide = MoeConfig(block_n=32), MoeConfig(block_n=64)
    out = fused_moe(x, w13, w2, weights, ids, configs=(small, wide))
    assert out.shape == (tokens, hidden) and out.dtype == torch.bfloat16
    assert rel_l2(out, fused_moe_reference(x, w13, w2, weights, ids)) <= REL_L2

    # the bf16-expert twin of the same kernel, on the same (dequantized) experts
    b13 = dequantize(w13, torch.bfloat16).transpose(-1, -2).contiguous()
    b2 = dequantize(w2, torch.bfloat16).transpose(-1, -2).contiguous()
    out16 = fused_moe(x, b13, b2, weights, ids, configs=(wide, small))
    assert rel_l2(out16, fused_moe_reference(x, b13, b2, weights, ids)) <= REL_L2


@pytest.mark.parametrize("g13,g2,symmetric", [(128, 32, True), (64, 64, False)])
def test_fused_moe_swapped_blocks_match_reference(g13, g2, symmetric):
    """8-row expert blocks with the weights as the dot's first operand (and a 16-row up GEMM
    with a swapped down GEMM, which aligns the pairs twice)."""
    experts, hidden, inter, tokens, top_k = 6, 256, 64, 5, 3
    w13, w2, x, ids, weights = moe_case(experts, hidden, inter, tokens, top_k, g13, g2,
                                        symmetric, seed=3)  # fmt: skip
    swap8 = MoeConfig(block_m=8, block_n=32, swap=True)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    for cfgs in ((swap8, swap8), (MoeConfig(block_n=32), swap8)):
        assert rel_l2(fused_moe(x, w13, w2, weights, ids, configs=cfgs), ref) <= REL_L2
    b13 = dequantize(w13, torch.bfloat16).transpose(-1, -2).contiguous()
    b2 = dequantize(w2, torch.bfloat16).transpose(-1, -2).contiguous()
    out16 = fused_moe(x, b13, b2, weights, ids, configs=(swap8, swap8))
    assert rel_l2(out16, fused_moe_reference(x, b13, b2, weights, ids)) <= REL_L2


def test_fused_moe_32_row_blocks_match_reference():
    """32-row expert blocks, the tuner's tiles from 4 pairs an expert: experts holding more
    than 16 pairs (here 18 on average) in one block, and beside a 16-row down GEMM, which
    aligns the pairs twice."""
    experts, hidden, inter, tokens, top_k = 4, 128, 64, 24, 3
    w13, w2, x, ids, weights = moe_case(experts, hidden, inter, tokens, top_k, 32, 32, True,
                                        seed=4)  # fmt: skip
    assert torch.bincount(ids.flatten().cpu(), minlength=experts).max() > 16
    rows32 = MoeConfig(block_m=32, block_n=32)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    for cfgs in ((rows32, rows32), (rows32, MoeConfig(block_n=32))):
        assert rel_l2(fused_moe(x, w13, w2, weights, ids, configs=cfgs), ref) <= REL_L2


def test_moe_candidates_offer_32_row_blocks_between_4_and_48_pairs_an_expert():
    """The tuner times 32-row tiles where an expert's pairs may overflow a 16-row block, and
    only 64-row tiles beyond 48 pairs an expert."""

    def rows(pairs):
        return {c.block_m for c in moe_module._candidates(pairs, 48, 4096)}

    assert 32 not in rows(2 * 48)
    assert {16, 32, 64} <= rows(16 * 48) and {16, 32, 64} <= rows(40 * 48)
    assert rows(49 * 48) == {64}


@pytest.mark.parametrize("g13,g2,symmetric", [(32, 32, True), (128, 32, False)])
def test_fused_moe_split_k_matches_reference(g13, g2, symmetric):
    """K split over programs, met in counted fp32 sums inside the launch: the program that adds
    the last part of a gate/up pair applies SiLU-and-mul, the one that adds the last part of a
    token's down row (its top-k pairs times the splits) stores it. The up GEMM's K (384) is 3
    steps: split 2 gives parts of 2 and 1 steps, split 4 an empty part; the down GEMM's K (96)
    is one step."""
    experts, hidden, inter, tokens, top_k = 5, 384, 96, 3, 2
    w13, w2, x, ids, weights = moe_case(experts, hidden, inter, tokens, top_k, g13, g2,
                                        symmetric, seed=4)  # fmt: skip
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    plain = MoeConfig(block_m=8, block_n=32, swap=True)
    for split in (2, 4):
        swapped = MoeConfig(block_m=8, block_n=32, swap=True, split_k=split)
        rows16 = MoeConfig(block_n=32, split_k=split)
        for cfgs in ((swapped, swapped), (rows16, plain), (plain, rows16)):
            out = fused_moe(x, w13, w2, weights, ids, configs=cfgs)
            assert out.dtype == torch.bfloat16
            assert rel_l2(out, ref) <= REL_L2, (split, cfgs)
    b13 = dequantize(w13, torch.bfloat16).transpose(-1, -2).contiguous()
    b2 = dequantize(w2, torch.bfloat16).transpose(-1, -2).contiguous()
    split4 = MoeConfig(block_m=8, block_n=32, swap=True, split_k=4)
    out16 = fused_moe(x, b13, b2, weights, ids, configs=(split4, split4))
    assert rel_l2(out16, fused_moe_reference(x, b13, b2, weights, ids)) <= REL_L2


@pytest.mark.parametrize("g13,g2,symmetric", [(32, 32, True), (128, 32, False)])
def test_fused_moe_gemv_matches_reference(g13, g2, symmetric):
    """One pair a program on CUDA cores, and tensor-core tiles of one pair a block, both in
    pair order with no alignment: experts shared by several pairs, column counts that are not
    a multiple of the tile (masked columns), a down K (96) that ends inside a step, K split
    with an empty part, and either beside an aligned tensor-core tile in the other GEMM."""
    experts, hidden, inter, tokens, top_k = 4, 384, 96, 5, 2
    w13, w2, x, ids, weights = moe_case(experts, hidden, inter, tokens, top_k, g13, g2,
                                        symmetric, seed=7)  # fmt: skip
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    tile = MoeConfig(block_m=8, block_n=32, swap=True)
    wide = MoeConfig(1, 128, 128, path="gemv")
    short = MoeConfig(1, 64, 64, split_k=4, path="gemv")
    one_pair = MoeConfig(block_m=8, block_n=32, swap=True, pair_blocks=True)
    one_pair_split = MoeConfig(block_m=8, block_n=32, swap=True, split_k=3, pair_blocks=True)
    for cfgs in ((wide, short), (short, tile), (tile, wide), (one_pair_split, one_pair),
                 (one_pair, tile), (wide, one_pair_split)):  # fmt: skip
        out = fused_moe(x, w13, w2, weights, ids, configs=cfgs)
        assert out.dtype == torch.bfloat16 and out.shape == (tokens, hidden)
        assert rel_l2(out, ref) <= REL_L2, cfgs
    b13 = dequantize(w13, torch.bfloat16).transpose(-1, -2).contiguous()
    with pytest.raises(ValueError, match="gemv path takes INT4"):
        fused_moe(x, b13, w2, weights, ids, configs=(wide, wide))


@pytest.mark.parametrize(
    "cfg",
    [MoeConfig(block_m=8, block_n=32, swap=True, split_k=2), MoeConfig(block_n=32, split_k=4),
     MoeConfig(1, 64, 64, split_k=3, path="gemv"), MoeConfig(block_m=8, block_n=32, swap=True),
     MoeConfig(block_m=8, block_n=32, swap=True, split_k=2, pair_blocks=True)],
)  # fmt: skip
def test_moe_gemm_sums_rows(cfg):
    """The public ``moe_gemm``: each pair's bf16 row, and with ``sum_rows`` each token's rows
    summed (counted inside the launch for K splits and the gemv path: up to 3 x 4 = 12 parts an
    element; one more launch for an unsplit tile), with the routing weights; blocks as
    ``expert_blocks`` makes them for the tile (the pairs in order for one pair a block)."""
    w = make_weight((3, 64, 256), 32, True, seed=5)
    x = make_x(4, 256, seed=6)
    ids = torch.tensor([[0, 2, 1], [2, 1, 0], [2, 0, 1], [1, 2, 0]], device=DEVICE)
    gains = torch.rand(4, 3, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    pair_ids, block_expert = moe_module.expert_blocks(ids, 3, cfg.rows_per_block)
    dense = dequantize(w, torch.float32)  # [E, N, K]
    rows = torch.stack([x[p // 3].float() @ dense[ids.flatten()[p]].T for p in range(12)])
    out = moe_module.moe_gemm(x, w, pair_ids, block_expert, 12, 3, cfg)
    assert out.dtype == torch.bfloat16 and out.shape == (12, 64)
    assert rel_l2(out, rows) <= REL_L2
    routed = rows * gains.flatten()[:, None]
    summed = moe_module.moe_gemm(x, w, pair_ids, block_expert, 12, 3, cfg, gains.flatten(),
                                 sum_rows=3)  # fmt: skip
    assert summed.shape == (4, 64)
    assert rel_l2(summed, routed.view(4, 3, 64).sum(1)) <= REL_L2


def test_tuner_picks_the_up_tile_knowing_the_down_tiles_block_kind():
    """The tuner's stages with a cost model for the GPU's timer: each GEMM's time plus one
    alignment launch per block size above one pair. Beside the mid-size (aligned) down tile
    the aligned up tile wins; beside it, pair blocks in the down GEMM; the last stage then
    gives the up GEMM pair blocks too, which saves the alignment launch (16 us against the 18
    of the second stage's pair)."""
    aligned = MoeConfig(block_m=8, block_n=64, swap=True)
    one_pair = dataclasses.replace(aligned, pair_blocks=True)
    mid = MoeConfig(block_m=8, block_n=256, swap=True, split_k=4)
    up_us, down_us, align_us = {aligned: 10, one_pair: 11}, {aligned: 6, one_pair: 5, mid: 6}, 3

    def cost(cfgs):
        up, down = cfgs
        aligned_sizes = {c.rows_per_block for c in cfgs} - {1}
        return up_us[up] + down_us[down] + align_us * len(aligned_sizes)

    stages = []

    def fastest(stage, cfg_pairs):
        stages.append((stage, cfg_pairs))
        return min(cfg_pairs, key=cost)

    picked = moe_module._tune_stages(fastest, [aligned, one_pair], [aligned, one_pair], mid)
    assert picked == (one_pair, one_pair) and cost(picked) == 16
    assert [stage for stage, _ in stages] == ["moe_up", "moe_down", "moe_up_given_down"]
    up_stage, down_stage, last_stage = (cfg_pairs for _, cfg_pairs in stages)
    assert up_stage == [(aligned, mid), (one_pair, mid)]
    assert down_stage == [(aligned, aligned), (aligned, one_pair)]
    assert last_stage == [(aligned, one_pair), (one_pair, one_pair)]


def test_fused_moe_rejects_mismatched_routing():
    w = make_weight((4, 64, 128), 128, True, seed=0)
    w2 = make_weight((4, 128, 32), 32, True, seed=0)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="token count"):
        fused_moe(make_x(3, 128, 0), w, w2, torch.ones(3, 1, device=DEVICE), ids)


@gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", [(7168, 1024), (7168, 256), (2112, 7168)])
def test_gemm_one_launch_tiles_real_shapes(m, n, k):
    """The unsplit tiles the tuner offers at M <= 16 (the decode slice's small linears)."""
    w = make_weight((n, k), 32, True, seed=n + k)
    x = make_x(m, k, seed=m)
    ref = w4a16_matmul_reference(x, w)
    tiles = [c for c in _candidates(m, n, k) if c.split_k == 1]
    assert tiles
    for cfg in tiles:
        assert rel_l2(w4a16_matmul(x, w, cfg), ref) <= REL_L2, cfg


@gpu
@needs_gpu
@pytest.mark.parametrize("pdl", [1, 2])
def test_dependent_launches_match_plain_ones(pdl):
    """Programmatic dependent launch (``GemmConfig.pdl``) on every one-token candidate, each
    launched right after the one before, the split ones too: unsplit ones give the same bits
    as plain launches; split ones, whose fp32 atomics add in any order (so a bf16 output may
    round either way, launched plainly too: one such run failed a 1e-6 bound), match the
    reference as closely as plain launches do."""
    n, k = 7168, 2048
    w = make_weight((n, k), 32, True, seed=7)
    x = make_x(1, k, seed=7)
    ref = w4a16_matmul_reference(x, w)
    cfgs = _candidates(1, n, k)
    plain = [w4a16_matmul(x, w, dataclasses.replace(cfg, pdl=0)) for cfg in cfgs]
    chained = [w4a16_matmul(x, w, dataclasses.replace(cfg, pdl=pdl)) for cfg in cfgs]
    for cfg, a, b in zip(cfgs, plain, chained, strict=True):
        if cfg.split_k == 1:
            assert torch.equal(b, a), cfg
        else:
            assert rel_l2(b, ref) <= max(2 * rel_l2(a, ref), REL_L2 / 10), cfg


@gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 16, 64, 512])
@pytest.mark.parametrize("n,k,group", [(16384, 7168, 128), (7168, 2048, 32)])
def test_gemm_real_shapes_tuned(m, n, k, group):
    w = make_weight((n, k), group, True, seed=m)
    x = make_x(m, k, seed=m)
    assert rel_l2(w4a16_matmul(x, w), w4a16_matmul_reference(x, w)) <= REL_L2


@gpu
@needs_gpu
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_fused_moe_real_width_tuned(tokens):
    experts, hidden, inter, top_k = 32, 7168, 2048, 8
    w13 = make_weight((experts, 2 * inter, hidden), 32, True, seed=1)
    w2 = make_weight((experts, hidden, inter), 32, True, seed=2)
    x = make_x(tokens, hidden, seed=3)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    ids, weights = ids.cuda(), weights.cuda()
    out = fused_moe(x, w13, w2, weights, ids)
    assert rel_l2(out, fused_moe_reference(x, w13, w2, weights, ids)) <= REL_L2


def random_experts(experts, n, k, g):
    """Random INT4 experts ``[experts, n, k]`` at group 32, drawn on the GPU (384 experts would
    take minutes on the CPU)."""
    codes = torch.randint(-(2**31), 2**31 - 1, (experts, k // 8, n), generator=g,
                          dtype=torch.int32, device="cuda")  # fmt: skip
    scales = (torch.rand(experts, k // 32, n, generator=g, device="cuda") + 0.5) / k**0.5
    return W4A16Weight(codes, scales.to(torch.bfloat16) / 4, None, 32)


def kimi_width_moe(experts, tokens, top_k, seed, x_seed):
    """Kimi K2's expert widths (7168 -> 2 x 2048, group 32), drawn on the GPU, activations and
    a random top-k routing: ``(w13, w2, x, ids, weights)``."""
    hidden, inter = 7168, 2048
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = random_experts(experts, 2 * inter, hidden, g)
    w2 = random_experts(experts, hidden, inter, g)
    x = make_x(tokens, hidden, seed=x_seed)
    ids = torch.stack([torch.randperm(experts, generator=g, device="cuda")[:top_k]
                       for _ in range(tokens)])  # fmt: skip
    weights = torch.rand(tokens, top_k, generator=g, device="cuda").softmax(-1)
    return w13, w2, x, ids, weights


def reference_on_used_experts(x, w13, w2, weights, ids):
    """``fused_moe_reference`` dequantizing only the experts ``ids`` uses."""
    used = ids.unique()

    def sliced(w):
        return W4A16Weight(w.qweight[used], w.scales[used], None, 32)

    return fused_moe_reference(x, sliced(w13), sliced(w2), weights, torch.searchsorted(used, ids))


@gpu
@needs_gpu
def test_moe_dependent_launches_match_plain_ones():
    """``MoeConfig.pdl`` on every one-token candidate of one EP-8 GPU's 48 Kimi K2 experts
    (group 32, top 8), both GEMMs: unsplit tensor-core tiles give the same bits as plain
    launches, the rest (K parts and the CUDA-core path meet in fp32 atomics, in any order)
    match the reference as closely as plain launches do."""
    experts, hidden, inter, top_k = 48, 7168, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(5)
    w13 = random_experts(experts, 2 * inter, hidden, g)
    w2 = random_experts(experts, hidden, inter, g)
    x = make_x(1, hidden, seed=3)
    ids = torch.randperm(experts, generator=g, device="cuda")[:top_k][None]
    weights = torch.rand(1, top_k, generator=g, device="cuda").softmax(-1)
    ref = reference_on_used_experts(x, w13, w2, weights, ids)
    for cfg in moe_module._candidates(top_k, experts, 2 * inter, True):
        runs = [fused_moe(x, w13, w2, weights, ids, (c, c)) for c in
                (dataclasses.replace(cfg, pdl=0), dataclasses.replace(cfg, pdl=1))]  # fmt: skip
        if cfg.split_k == 1 and cfg.path != "gemv":
            assert torch.equal(runs[1], runs[0]), cfg
        else:
            assert rel_l2(runs[1], ref) <= max(2 * rel_l2(runs[0], ref), REL_L2 / 10), cfg


@gpu
@needs_gpu
def test_fused_moe_every_tile_at_16_pairs_an_expert():
    """Every tile the tuner may take at 16 pairs an expert (16-, 32- and 64-row blocks, the
    packed PTX decode), in both GEMMs, at Kimi K2's widths (group 32), against the reference."""
    experts, top_k, tokens = 8, 2, 64
    w13, w2, x, ids, weights = kimi_width_moe(experts, tokens, top_k, seed=7, x_seed=8)
    ref = reference_on_used_experts(x, w13, w2, weights, ids)
    cfgs = moe_module._candidates(tokens * top_k, experts, w13.n, True)
    assert {c.block_m for c in cfgs} == {16, 32, 64}
    for cfg in cfgs:
        assert rel_l2(fused_moe(x, w13, w2, weights, ids, (cfg, cfg)), ref) <= REL_L2, cfg


@gpu
@needs_gpu
@pytest.mark.parametrize("experts,tokens,split", [(48, 1, 8), (384, 1, 4), (48, 16, 2)])
def test_fused_moe_gemv_real_width(experts, tokens, split):
    """The gemv path with its fp16x2 PTX decode at Kimi K2's expert shapes (group 32): one
    EP-8 GPU's 48 experts and all 384, one pair and several pairs an expert."""
    top_k = 8 if experts == 384 else 1
    w13, w2, x, ids, weights = kimi_width_moe(experts, tokens, top_k, seed=4, x_seed=6)
    cfg = MoeConfig(1, 128, 128, split_k=split, path="gemv")
    out = fused_moe(x, w13, w2, weights, ids, configs=(cfg, cfg))
    ref = reference_on_used_experts(x, w13, w2, weights, ids)
    assert rel_l2(out, ref) <= REL_L2


@gpu
@needs_gpu
@pytest.mark.parametrize("group,symmetric,m", [(128, False, 1), (32, True, 40)])
def test_ptx_decode_matches_plain_decode(group, symmetric, m):
    """The packed-bf16x2 PTX decode and the plain-Triton one (what the CPU tests run) give the
    same bf16 weights, so the same tile gives the same output bit for bit."""
    w = make_weight((1000, 2048), group, symmetric, seed=m)
    x = make_x(m, 2048, seed=m)
    for bn, split in ((64, 1), (256, 2)):
        fast = w4a16_matmul(x, w, GemmConfig(block_n=bn, split_k=split))
        plain = w4a16_matmul(x, w, GemmConfig(block_n=bn, split_k=split, fast_decode=False))
        if split == 1:
            assert torch.equal(fast, plain)
        else:  # fp32 atomics add the splits in any order
            assert rel_l2(fast, plain) <= 1e-3
        assert rel_l2(fast, w4a16_matmul_reference(x, w)) <= REL_L2


@gpu
@needs_gpu
def test_tuner_picks_the_fastest_candidate_and_skips_those_that_fail_to_compile():
    """The tuner times every candidate and keeps the fastest; one that
    runs out of shared memory is left out, not fatal."""
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def run(c: str) -> torch.Tensor:
        if c == "out of shared memory":
            raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")
        return a @ a if c == "one matmul" else a @ a @ a @ a

    key = ("test tuner", id(a))
    picked = gemm_module.tune_cached(key, lambda: ["four matmuls", "out of shared memory",
                                                   "one matmul"], run)  # fmt: skip
    gemm_module._TUNED.pop(key)
    assert picked == "one matmul"
    with pytest.raises(RuntimeError, match="no candidate config compiled"):
        gemm_module.tune_cached(key, lambda: ["out of shared memory"], run)


@gpu
@needs_gpu
def test_workspace_is_per_stream_and_grows_only_before_a_capture():
    """Kernels on two streams may run at once (SGLang's decode graphs run the shared expert on a
    second stream beside the routed experts), so each stream has its own buffer. A graph keeps
    the addresses it was captured with, so a buffer may only grow before a capture on its
    stream; growing inside one says what to do instead."""
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    first = counted_workspace(device, 1, 1)[0]
    with torch.cuda.stream(side):
        second = counted_workspace(device, 1, 1)[0]
    assert first.data_ptr() != second.data_ptr()
    key = (device, side.cuda_stream)
    size = gemm_module._WORKSPACES[key][-1].numel()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="once on the capturing stream before capturing"):
        with torch.cuda.graph(graph, stream=side):
            counted_workspace(device, 2 * size, 0)
    assert gemm_module._WORKSPACES[key][-1].numel() == size


@gpu
@needs_gpu
def test_counted_splits_on_two_streams_at_once_match_reference():
    """SGLang's decode pattern: a fused MoE on one stream and two dense GEMMs on a second,
    forked and joined each time, every launch a counted K split, in a captured graph (whose
    warm-up and capture share one stream, :func:`capture_graph`) replayed many times."""
    w13, w2, x, ids, weights = moe_case(16, 1024, 512, 1, 4, 32, 32, True, seed=21)
    up, down = make_weight((256, 1024), 32, True, seed=22), make_weight((1024, 512), 32, True, 23)
    h = make_x(1, 512, seed=24)
    split, dense = MoeConfig(block_m=8, block_n=64, swap=True, split_k=4), GemmConfig(split_k=4)
    side = torch.cuda.Stream()
    outs = []

    def step() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        routed = fused_moe(x, w13, w2, weights, ids, configs=(split, split))
        with torch.cuda.stream(side):
            got = (w4a16_matmul(x, up, dense), w4a16_matmul(h, down, dense))
        main.wait_stream(side)
        outs.append((routed, *got))

    graph = capture_graph(step)
    routed, shared_up, shared_down = outs[-1]
    refs = (fused_moe_reference(x, w13, w2, weights, ids),
            w4a16_matmul_reference(x, up), w4a16_matmul_reference(h, down))  # fmt: skip
    for _ in range(200):
        graph.replay()
        torch.cuda.synchronize()
        for out, ref in zip((routed, shared_up, shared_down), refs, strict=True):
            assert rel_l2(out, ref) <= REL_L2
    assert workspace_is_zero()


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (sm_90)",
)


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("one_launch", [False, True])
def test_wgmma_gemm_matches_reference(m, group, split_k, warps, one_launch):
    """The Gluon warpgroup-MMA kernel: token tiles of 8 to 64 (M = 5 and 33 padded), N not a
    multiple of its 64 or 128 columns, per-weight scales (groups 32, 64) and per-step ones
    (128), K split unevenly (8 steps in 3 parts), one warpgroup or two; launched plainly
    (splits added into a zeroed output) or dependently (splits met in the workspace)."""
    bm = max(8, gemm_module._m_bucket(m))
    if warps == 8 and bm < 16:
        pytest.skip("two warpgroups take 16 tokens or more")
    n, k = 200, 1024
    w = make_weight((n, k), group, True, seed=group + m)
    x = make_x(m, k, seed=m)
    cfg = GemmConfig("wgmma", bm, 64 * warps // 4, 128, split_k, warps, 8 if split_k > 1 else 4,
                     counted=one_launch, pdl=int(one_launch))  # fmt: skip
    out = w4a16_matmul(x, w, cfg)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_l2(out, w4a16_matmul_reference(x, w)) <= REL_L2, cfg
    assert workspace_is_zero(), cfg


@gpu
@hopper
@pytest.mark.parametrize("m", [8, 16, 64])
@pytest.mark.parametrize("n,k,group", [(2112, 7168, 32), (16384, 7168, 128)])
def test_wgmma_tiles_real_shapes(m, n, k, group):
    """Every Gluon tile at the decode slice's fused q_a + kv_a and at the target shape, its K
    splits added into a zeroed output or met in the workspace (which every call leaves zero)."""
    w = make_weight((n, k), group, True, seed=n)
    x = make_x(m, k, seed=m)
    ref = w4a16_matmul_reference(x, w)
    cfgs = gemm_module._wgmma_tiles(x, w)
    assert any(c.counted and c.split_k > 1 for c in cfgs)
    for cfg in cfgs:
        assert rel_l2(w4a16_matmul(x, w, cfg), ref) <= REL_L2, cfg
        assert workspace_is_zero(), cfg
