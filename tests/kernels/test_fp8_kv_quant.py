"""FP8 quantize-on-write and BF16 -> FP8 page conversion against their torch references.

The kernels round with integer arithmetic, so the stored bytes must match torch's e4m3 cast
exactly (NaN compared as NaN: its sign bit is not specified).
"""

import pytest
import torch
from tessera.kernels.fp8_kv_convert import (
    convert_pages_bf16_to_fp8,
    convert_pages_bf16_to_fp8_ref,
)
from tessera.kernels.fp8_kv_quant import write_kv_fp8, write_kv_fp8_ref
from tessera.kernels.paged_kv import FP8_DTYPE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECIALS = [
    448.0,
    449.0,
    464.0,
    465.0,
    1e30,
    float("inf"),
    -float("inf"),
    float("nan"),
    0.0,
    -0.0,
    2**-9,
    2**-10,
    3 * 2**-10,
    2**-6,
    2**-6 - 2**-10,
    1e-30,
    -300.5,
]


def poisoned_cache(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache filled with NaN bytes and per-(token, head) scales filled with NaN."""
    cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
    scale = torch.full(shape[:-1], float("nan"), device=DEVICE)
    return cache, scale


def assert_same_fp8(a: torch.Tensor, b: torch.Tensor) -> None:
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    assert torch.equal(nan_a, nan_b)
    assert torch.equal(a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b])


def assert_same_scales(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))


@pytest.mark.parametrize("per_token_head", [True, False])
@pytest.mark.parametrize(("heads", "dim"), [(3, 24), (1, 576), (2, 128)])
def test_write_matches_reference_bytes(per_token_head, heads, dim):
    pages, page_size, tokens = 7, 4, 11
    new = (torch.randn(tokens, heads, dim, device=DEVICE) * 30).bfloat16()
    new[0, 0, :3] = torch.tensor([float("inf"), float("nan"), -1e6])
    new[1, -1] = 0.0  # an all-zero row gets scale 1
    slots = torch.randperm(pages * page_size, device=DEVICE)[:tokens]
    cache, scale = poisoned_cache((pages, page_size, heads, dim))
    if not per_token_head:
        scale = torch.tensor(0.7, device=DEVICE)
    ref_cache, ref_scale = cache.clone(), scale.clone()

    write_kv_fp8(new, cache, scale, slots)
    write_kv_fp8_ref(new, ref_cache, ref_scale, slots)

    assert_same_fp8(cache, ref_cache)
    assert_same_scales(scale, ref_scale)
    written = cache.flatten(0, 1)[slots].float()
    assert written.isnan().sum() == 1  # only the NaN input; the poison was overwritten
    assert written.abs().nan_to_num(0).max() <= 448


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_specials_saturate_round_to_even_and_keep_nan(scale):
    x = torch.tensor(SPECIALS, device=DEVICE)
    wide = torch.randn(103, device=DEVICE) * torch.exp(torch.randn(103, device=DEVICE) * 4)
    rows = torch.cat([x, wide]).view(-1, 8, 1)  # 8 heads a row: fewer interpreted programs
    cache, _ = poisoned_cache(tuple(rows.shape))
    ref_cache = cache.clone()
    s = torch.tensor(scale, device=DEVICE)
    slots = torch.randperm(rows.shape[0], device=DEVICE)
    write_kv_fp8(rows, cache, s, slots)
    write_kv_fp8_ref(rows, ref_cache, s, slots)
    assert_same_fp8(cache, ref_cache)
    stored = cache[slots].flatten().float()
    assert stored[5] == 448 and stored[6] == -448  # +-Inf saturate
    assert stored[7].isnan()


@pytest.mark.parametrize("per_token_head", [True, False])
def test_page_conversion_matches_reference(per_token_head):
    page_size, heads, dim = 8, 2, 64
    src = torch.randn(9, page_size, heads, dim, device=DEVICE).bfloat16() * 5
    dst, scale = poisoned_cache((6, page_size, heads, dim))
    if not per_token_head:
        scale = torch.tensor(0.05, device=DEVICE)
    ref_dst, ref_scale = dst.clone(), scale.clone()
    src_pages = torch.tensor([8, 0, 3], device=DEVICE)
    dst_pages = torch.tensor([1, 5, 2], device=DEVICE)

    convert_pages_bf16_to_fp8(src, dst, scale, src_pages, dst_pages)
    convert_pages_bf16_to_fp8_ref(src, ref_dst, ref_scale, src_pages, dst_pages)

    assert_same_fp8(dst, ref_dst)
    assert_same_scales(scale, ref_scale)
    untouched = torch.tensor([0, 3, 4], device=DEVICE)
    assert dst[untouched].float().isnan().all()  # only the listed pages were written
    back = dst[dst_pages].float() * (scale[dst_pages] if per_token_head else scale)[..., None]
    err = (back - src[src_pages].float()).norm() / src[src_pages].float().norm()
    assert err < 0.05 if per_token_head else err < 0.1


def test_bad_input_says_what_is_wrong():
    cache, scale = poisoned_cache((4, 2, 2, 16))
    new = torch.randn(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        write_kv_fp8(new, cache.float(), scale, torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match=r"source rows must be \[rows, 2, 16\]"):
        write_kv_fp8(new[:, :1], cache, scale, torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="3 new rows but 2 slots"):
        write_kv_fp8(new, cache, scale, torch.arange(2, device=DEVICE))
    with pytest.raises(ValueError, match="FP8 scales must be 0-dim"):
        write_kv_fp8(new, cache, scale[:2], torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="source cache must be bfloat16"):
        convert_pages_bf16_to_fp8(cache.float(), cache, scale, torch.arange(1), torch.arange(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("heads", "dim", "tokens"), [(8, 128, 4099), (1, 576, 777), (4, 256, 1)])
def test_write_real_shapes_gpu(heads, dim, tokens):
    for per_token_head in (True, False):
        pages, page_size = 1024, 16
        new = torch.randn(tokens, heads, dim, device="cuda").bfloat16() * 4
        slots = torch.randperm(pages * page_size, device="cuda")[:tokens]
        cache, scale = poisoned_cache((pages, page_size, heads, dim))
        if not per_token_head:
            scale = torch.tensor(0.02, device="cuda")
        ref_cache, ref_scale = cache.clone(), scale.clone()
        write_kv_fp8(new, cache, scale, slots)
        write_kv_fp8_ref(new, ref_cache, ref_scale, slots)
        assert_same_fp8(cache, ref_cache)
        assert_same_scales(scale, ref_scale)
