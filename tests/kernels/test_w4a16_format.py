"""The packed INT4 format: packing order, RTN quantization, and the lossless round trip with
compressed-tensors ``pack-quantized`` (written here independently from its documented layout)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tessera.kernels.w4a16_format import (
    W4A16Weight,
    dequantize,
    pack_int4,
    quantize_rtn,
    repack_from_compressed_tensors,
    to_compressed_tensors,
    unpack_int4,
)


def ct_pack(signed: torch.Tensor, dim: int) -> torch.Tensor:
    """compressed-tensors packing, element by element: value ``j`` along ``dim`` (signed int4,
    stored + 8) goes to word ``j // 8``, bits ``4 (j % 8)``; the packed dim is zero-padded."""
    u = (signed.long() + 8).movedim(dim, -1)
    words = torch.zeros(*u.shape[:-1], -(-u.shape[-1] // 8), dtype=torch.long)
    for j in range(u.shape[-1]):
        words[..., j // 8] |= u[..., j] << (4 * (j % 8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def test_nibble_order_is_low_bits_first():
    words = pack_int4(torch.arange(8, dtype=torch.uint8).reshape(1, 8))
    assert words.item() == 0x76543210
    high = pack_int4(torch.full((1, 8), 15, dtype=torch.uint8))
    assert high.item() == -1  # all 32 bits set, as a signed int32


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 5),
    words=st.integers(1, 4),
    dim=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip(rows, words, dim, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (words * 8, rows) if dim == 0 else (rows, words * 8)
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    packed = pack_int4(codes, dim=dim)
    assert packed.dtype == torch.int32 and packed.shape[dim] == words
    assert torch.equal(unpack_int4(packed, dim=dim), codes)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((1, 8), 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        unpack_int4(torch.zeros(1, 2, dtype=torch.int64))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_rtn_error_is_within_half_a_step_except_at_clamps(symmetric, group):
    w = torch.randn(2, 24, 256, generator=torch.Generator().manual_seed(group))
    q = quantize_rtn(w, group, symmetric)
    assert q.qweight.shape == (2, 32, 24) and q.scales.shape == (2, 256 // group, 24)
    assert q.symmetric is symmetric
    step = q.scales.float().repeat_interleave(group, dim=-2).transpose(-1, -2)
    err = (dequantize(q) - w).abs()
    # rounding: half a step; only the clamped extremes (symmetric +absmax, or the range end a
    # rounded zero point cuts off) may be off by up to one step
    assert bool((err <= step + 1e-6).all())
    assert (err <= 0.5 * step + 1e-6).float().mean().item() > 0.98
    assert (err.norm() / w.norm()).item() < 0.12


def test_weight_validation_messages():
    q = quantize_rtn(torch.randn(16, 128), 128)
    with pytest.raises(ValueError, match="group_size 48"):
        W4A16Weight(q.qweight, q.scales, None, 48)
    with pytest.raises(ValueError, match="scales must be"):
        W4A16Weight(q.qweight, q.scales.float(), None, 128)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_rtn(torch.randn(4, 100), 32)


@pytest.mark.parametrize("n", [24, 37])  # 37: zero points padded to a multiple of 8 rows
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("lead", [(), (3,)])  # a linear layer, and stacked MoE experts
def test_compressed_tensors_conversion_is_lossless(n, symmetric, lead):
    g = torch.Generator().manual_seed(n)
    k, group = 256, 32
    signed = torch.randint(-8, 8, (*lead, n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(*lead, n, k // group, generator=g) + 0.01).to(torch.bfloat16)
    ct = {
        "weight_packed": ct_pack(signed, dim=-1),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k], dtype=torch.int32),
    }
    zp = torch.zeros(*lead, n, k // group, dtype=torch.int8)
    if not symmetric:
        zp = torch.randint(-8, 8, zp.shape, generator=g, dtype=torch.int8)
        ct["weight_zero_point"] = ct_pack(zp, dim=-2)

    w = repack_from_compressed_tensors(**ct)
    assert w.group_size == group and (w.n, w.k) == (n, k) and w.symmetric is symmetric
    expected = (
        signed.float() - zp.float().repeat_interleave(group, -1)
    ) * scale.float().repeat_interleave(group, -1)
    assert torch.equal(dequantize(w), expected)

    back = to_compressed_tensors(w)
    assert back.keys() == ct.keys()
    for name, tensor in ct.items():
        assert torch.equal(back[name], tensor), name


def test_compressed_tensors_fp16_scales_stay_fp16():
    signed = torch.randint(-8, 8, (8, 128), dtype=torch.int8)
    scale = torch.rand(8, 1).half()
    w = repack_from_compressed_tensors(ct_pack(signed, -1), scale)
    assert w.scales.dtype == torch.float16
    assert torch.equal(to_compressed_tensors(w)["weight_scale"], scale)


def test_compressed_tensors_rejects_what_it_cannot_serve():
    signed = torch.randint(-8, 8, (8, 128), dtype=torch.int8)
    packed, scale = ct_pack(signed, -1), torch.rand(8, 4).bfloat16()
    with pytest.raises(ValueError, match="does not match"):
        repack_from_compressed_tensors(packed, scale, weight_shape=torch.tensor([8, 120]))
    shuffled = torch.randperm(128) // 32
    with pytest.raises(ValueError, match="act-order"):
        repack_from_compressed_tensors(packed, scale, weight_g_idx=shuffled)
    in_order = torch.arange(128) // 32
    assert repack_from_compressed_tensors(packed, scale, weight_g_idx=in_order).group_size == 32
    with pytest.raises(ValueError, match="int32"):
        repack_from_compressed_tensors(packed.long(), scale)
