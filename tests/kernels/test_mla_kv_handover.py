"""The handover conversion against SGLang's own write functions, byte for byte.

On CPU the Triton kernels run under the interpreter, and so do SGLang's own Triton quantize and
dequantize kernels (the DSA layout); the MLA FP8 cast is SGLang's torch cast in its pool. The
`gpu` tests repeat this at Kimi K2 / GLM 5 layer widths with 8k-token requests.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from tessera.kernels.mla_kv_handover import (
    MLAKVLayout,
    convert_rows,
    convert_rows_ref,
    convertible,
    page_rows,
)


def _sglang_module(name: str, file: str):  # type: ignore[no-untyped-def]
    """SGLang's own kernel module: from the installed package, or on a machine without SGLang
    from its source file in $TESSERA_SGLANG_SOURCES (the GPU runs)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        folder = os.environ.get("TESSERA_SGLANG_SOURCES")
        if not folder:
            pytest.skip("needs SGLang's kernels (installed, or TESSERA_SGLANG_SOURCES)",
                        allow_module_level=True)
        spec = importlib.util.spec_from_file_location(file, Path(folder) / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


sglang_dsa = _sglang_module("sglang.kernels.ops.quantization.dsa_quant_k_cache",
                            "dsa_quant_k_cache.py")
sglang_dequant = _sglang_module("sglang.kernels.ops.attention.dsa.dequant_k_cache",
                                "dequant_k_cache.py")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(128, 64), (256, 0)] if DEVICE == "cpu" else [(512, 64)]


def _bf16_rows(n: int, nope: int, rope: int, scale: float = 60.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 7 + nope)
    x = torch.randn(n, nope + rope, generator=g) * scale
    x[0, :6] = torch.tensor([1e6, -1e6, 449.0, -470.0, float("inf"), float("nan")])
    return x.to(torch.bfloat16).to(DEVICE)


def _mla_pool_bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``x`` cast to ``dtype``: SGLang's MLA pool stores K with this plain cast in
    ``set_kv_buffer`` (read in its source; the two-process handover test, kv_handover_peer.py,
    writes through SGLang's own pool)."""
    return x.to(dtype).view(torch.uint8)


def _sglang_dsa_rows(x: torch.Tensor, nope: int) -> torch.Tensor:
    q, rope = sglang_dsa.quantize_k_cache_separate(x[:, :nope], x[:, nope:])
    return torch.cat([q.squeeze(1), rope.squeeze(1)], dim=1)


@pytest.mark.parametrize("nope,rope", SHAPES)
def test_bf16_to_fp8_is_sglangs_cast(nope: int, rope: int) -> None:
    x = _bf16_rows(9, nope, rope)
    src, dst = MLAKVLayout("bf16", nope, rope), MLAKVLayout("fp8_e4m3", nope, rope)
    out = torch.zeros(12, dst.token_bytes, dtype=torch.uint8, device=DEVICE)
    rows = torch.tensor([4, 0, 8, 1], device=DEVICE)
    to = torch.tensor([11, 2, 5, 0], device=DEVICE)
    convert_rows(x.view(torch.uint8), src, out, dst, rows, to)
    assert torch.equal(out[to], _mla_pool_bytes(x[rows], torch.float8_e4m3fn))
    assert out[2, 0] == 0x7E and out[2, 1] == 0xFE  # +-1e6 saturate at +-448
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[to.cpu()] = False
    assert not out[untouched.to(DEVICE)].any()


@pytest.mark.parametrize("nope,rope", SHAPES)
def test_fp8_to_bf16_is_exact(nope: int, rope: int) -> None:
    fp8 = _mla_pool_bytes(_bf16_rows(6, nope, rope), torch.float8_e4m3fn)
    src, dst = MLAKVLayout("fp8_e4m3", nope, rope), MLAKVLayout("bf16", nope, rope)
    out = torch.zeros(6, dst.token_bytes, dtype=torch.uint8, device=DEVICE)
    idx = torch.arange(6, device=DEVICE)
    convert_rows(fp8, src, out, dst, idx, idx)
    expected = fp8.view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(out.view(torch.bfloat16).view(torch.int16), expected.view(torch.int16))
    finite = expected.isfinite()
    # exact: casting back gives the FP8 bytes again
    assert torch.equal(expected[finite].to(torch.float8_e4m3fn), fp8.view(torch.float8_e4m3fn)[
        finite])


@pytest.mark.parametrize("nope,rope", [(s[0], 64) for s in SHAPES])
def test_bf16_to_dsa_fp8_is_sglangs_quantize(nope: int, rope: int) -> None:
    x = _bf16_rows(7, nope, rope, scale=3.0)[1:]  # finite rows: SGLang's kernel NaNs zero tiles
    src, dst = MLAKVLayout("bf16", nope, rope), MLAKVLayout("fp8_e4m3_dsa", nope, rope)
    out = torch.zeros(6, dst.token_bytes, dtype=torch.uint8, device=DEVICE)
    idx = torch.arange(6, device=DEVICE)
    convert_rows(x.contiguous().view(torch.uint8), src, out, dst, idx, idx)
    assert torch.equal(out, _sglang_dsa_rows(x, nope))


@pytest.mark.parametrize("nope,rope", [(s[0], 64) for s in SHAPES])
def test_dsa_fp8_to_bf16_is_sglangs_dequantize(nope: int, rope: int) -> None:
    x = _bf16_rows(7, nope, rope, scale=3.0)[1:].contiguous()
    packed = _sglang_dsa_rows(x, nope)
    src, dst = MLAKVLayout("fp8_e4m3_dsa", nope, rope), MLAKVLayout("bf16", nope, rope)
    out = torch.zeros(6, dst.token_bytes, dtype=torch.uint8, device=DEVICE)
    idx = torch.arange(6, device=DEVICE)
    convert_rows(packed, src, out, dst, idx, idx)
    expected = sglang_dequant.dequantize_k_cache(
        packed.view(torch.float8_e4m3fn).view(6, 1, -1)
    ).view(6, -1)
    assert torch.equal(out.view(torch.bfloat16).view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("kind", ["bf16", "fp8_e4m3", "fp8_e4m3_dsa"])
def test_same_layout_is_a_copy(kind: str) -> None:
    layout = MLAKVLayout(kind, 128, 64)
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (10, layout.token_bytes), generator=g, dtype=torch.uint8)
    src = src.to(DEVICE)
    out = torch.zeros_like(src)
    convert_rows(src, layout, out, layout, torch.tensor([3, 9], device=DEVICE),
                 torch.tensor([0, 4], device=DEVICE))
    assert torch.equal(out[0], src[3]) and torch.equal(out[4], src[9])


@pytest.mark.parametrize(
    "pair", [("bf16", "fp8_e4m3"), ("fp8_e4m3", "bf16"), ("bf16", "bf16")]
)
def test_table_kernels_match_the_torch_reference(pair: tuple[str, str]) -> None:
    src, dst = MLAKVLayout(pair[0], 128, 64), MLAKVLayout(pair[1], 128, 64)
    x = _bf16_rows(8, 128, 64)
    rows = torch.zeros(8, src.token_bytes, dtype=torch.uint8, device=DEVICE)
    idx = torch.arange(8, device=DEVICE)
    convert_rows_ref(x.view(torch.uint8), MLAKVLayout("bf16", 128, 64), rows, src, idx, idx)
    a = torch.zeros(8, dst.token_bytes, dtype=torch.uint8, device=DEVICE)
    b = torch.zeros_like(a)
    convert_rows(rows, src, a, dst, idx.flip(0), idx)
    convert_rows_ref(rows, src, b, dst, idx.flip(0), idx)
    assert torch.equal(a, b)


def test_layouts_and_refusals() -> None:
    assert MLAKVLayout("fp8_e4m3_dsa").token_bytes == 656
    assert MLAKVLayout("bf16").token_bytes == 1152 and MLAKVLayout("fp8_e4m3").token_bytes == 576
    assert convertible(MLAKVLayout("bf16"), MLAKVLayout("fp8_e4m3_dsa"))
    assert not convertible(MLAKVLayout("fp8_e4m3"), MLAKVLayout("fp8_e4m3_dsa"))
    assert not convertible(MLAKVLayout("bf16", 512, 64), MLAKVLayout("fp8_e4m3", 256, 64))
    with pytest.raises(ValueError, match="no conversion from"):
        convert_rows(
            torch.zeros(1, 576, dtype=torch.uint8), MLAKVLayout("fp8_e4m3"),
            torch.zeros(1, 656, dtype=torch.uint8), MLAKVLayout("fp8_e4m3_dsa"),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
        )
    with pytest.raises(ValueError, match=r"uint8 token rows \[n, 1152\]"):
        convert_rows(
            torch.zeros(1, 576, dtype=torch.uint8), MLAKVLayout("bf16"),
            torch.zeros(1, 576, dtype=torch.uint8), MLAKVLayout("fp8_e4m3"),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="unknown MLA KV layout"):
        MLAKVLayout("fp4")
    assert page_rows(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]


@pytest.mark.parametrize("pair", [("bf16", "fp8_e4m3"), ("bf16", "fp8_e4m3_dsa"),
                                  ("fp8_e4m3_dsa", "bf16")])
def test_every_layer_in_one_launch_matches_one_layer_at_a_time(pair: tuple[str, str]) -> None:
    src, dst = MLAKVLayout(pair[0], 128, 64), MLAKVLayout(pair[1], 128, 64)
    g = torch.Generator().manual_seed(5)
    layers = []
    for _ in range(3):  # separate buffers, as a pool's layers are
        x = (torch.randn(10, 192, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
        rows = torch.zeros(10, src.token_bytes, dtype=torch.uint8, device=DEVICE)
        idx = torch.arange(10, device=DEVICE)
        convert_rows(x.view(torch.uint8), MLAKVLayout("bf16", 128, 64), rows, src, idx, idx)
        layers.append(rows)
    staging = torch.zeros(3 * 4, dst.token_bytes, dtype=torch.uint8, device=DEVICE)
    regions = list(staging.view(3, 4, -1).unbind(0))
    pages = torch.tensor([7, 2, 9, 4], device=DEVICE)
    to = torch.arange(4, device=DEVICE)
    convert_rows(layers, src, regions, dst, pages, to)
    for layer, region in zip(layers, regions, strict=True):
        alone = torch.zeros_like(region)
        convert_rows(layer, src, alone, dst, pages, to)
        assert torch.equal(region, alone)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layers,src_kind,dst_kind", [
    (61, "bf16", "fp8_e4m3"), (61, "fp8_e4m3", "bf16"),  # Kimi K2
    (78, "bf16", "fp8_e4m3_dsa"), (78, "fp8_e4m3_dsa", "bf16"),  # GLM 5
], ids=["kimi-bf16-fp8", "kimi-fp8-bf16", "glm-bf16-fp8", "glm-fp8-bf16"])
def test_an_8k_request_at_real_layer_shapes_is_sglangs_bytes(
        layers: int, src_kind: str, dst_kind: str) -> None:
    """Every layer of one 8k-token request, scattered over 64-token pages of a larger pool,
    in one launch, against SGLang's own write of the values the source pool holds."""
    src, dst = MLAKVLayout(src_kind), MLAKVLayout(dst_kind)
    bf16 = MLAKVLayout("bf16")
    g = torch.Generator(device="cuda").manual_seed(1)
    pages = torch.randperm(256, generator=g, device="cuda")[:128]
    rows = page_rows(pages, 64)
    to = torch.arange(rows.numel(), device="cuda")
    pool, expected = [], []
    for _ in range(layers):
        x = (torch.randn(256 * 64, 576, generator=g, device="cuda") * 4).to(torch.bfloat16)
        if src == bf16:
            held = x
            pool.append(x.view(torch.uint8))
        elif src_kind == "fp8_e4m3":
            pool.append(_mla_pool_bytes(x, torch.float8_e4m3fn))
            held = pool[-1].view(torch.float8_e4m3fn).to(torch.bfloat16)
        else:
            pool.append(_sglang_dsa_rows(x, 512))
            held = sglang_dequant.dequantize_k_cache(
                pool[-1].view(torch.float8_e4m3fn).view(x.shape[0], 1, -1)).view(x.shape[0], -1)
        held = held[rows]
        if dst_kind == "bf16":
            expected.append(held.contiguous().view(torch.uint8))
        elif dst_kind == "fp8_e4m3":
            expected.append(_mla_pool_bytes(held, torch.float8_e4m3fn))
        else:
            expected.append(_sglang_dsa_rows(held.contiguous(), 512))
    staging = torch.empty(layers, rows.numel(), dst.token_bytes, dtype=torch.uint8,
                          device="cuda")
    convert_rows(pool, src, list(staging.unbind(0)), dst, rows, to)
    for layer in range(layers):
        assert torch.equal(staging[layer], expected[layer]), f"layer {layer}"
