"""The DeepGEMM peer of the benchmarks (bench/deepgemm.py): SGLang's group-128 activation
quantizer (its own Triton kernel, under the interpreter without a GPU) writes the values and
the column-major, TMA-aligned scale layout DeepGEMM reads; on an H200 with the sgl-deep-gemm
wheel, the whole linear against a float reference, including N not a multiple of 128."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import decode_slice as ds  # noqa: E402
import deepgemm  # noqa: E402
from sglang_source import find_sglang_source, load_triton_functions  # noqa: E402

pytestmark = pytest.mark.usefixtures("gpu_like_interpreter")


@pytest.fixture(scope="module")
def quant_kernel():
    try:
        path = find_sglang_source("fp8_kernel.py")
    except FileNotFoundError:
        pytest.skip("SGLang's kernel sources are not installed")
    name = "_per_token_group_quant_8bit_colmajor"
    return load_triton_functions(path, {name})[name]


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_group_quantizer_writes_deepgemm_scale_layout(quant_kernel, rows: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(rows, 384, device=device, dtype=torch.bfloat16)
    x[0, 128:256] *= 100  # one group far larger than the others: its own scale
    xq, xs = deepgemm.quantize_colmajor(quant_kernel, x)
    q_ref, s_ref = ds.group_quant_ref(x, deepgemm.GROUP)

    padded = (rows + 3) // 4 * 4
    assert xs.shape == (rows, 3) and xs.stride() == (1, padded)  # column-major, rows padded to 4
    torch.testing.assert_close(xs, s_ref, rtol=1e-6, atol=0)
    assert xs[0, 1] > 50 * xs[0, 0]
    deq = deepgemm.dequantize_groups(xq, xs)
    ref = deepgemm.dequantize_groups(q_ref, s_ref)
    assert ds.rel_l2(deq, ref) < 1e-3
    assert ds.rel_l2(deq, x.float()) < 0.05  # e4m3 keeps about 2 decimal digits


def test_supported_shapes_are_sglangs() -> None:
    assert deepgemm.supported(2112, 7168) and deepgemm.supported(512, 256)
    assert not deepgemm.supported(2100, 7168) and not deepgemm.supported(512, 200)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 2112, 7168), (16, 1536, 1536), (64, 7168, 256)])
def test_deepgemm_linear_matches_block_scaled_reference(quant_kernel, m: int, n: int, k: int):
    pytest.importorskip("deep_gemm")
    dg = deepgemm.DeepGemm()  # (the quantizer's source was found: the fixture skips otherwise)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gen = ds.Gen(torch.device("cuda"), seed=1)
    w = gen.fp8(n, k)
    blocks = gen.scales(-(-n // 128), k // 128, scale=1 / k**0.5)
    out = dg.linear(x, w, blocks)
    x_ref = deepgemm.dequantize_groups(*ds.group_quant_ref(x, 128))
    ref = x_ref @ deepgemm.dequantize_blocks(w, blocks).T
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert ds.rel_l2(out, ref) < 1e-2


def test_block_dequantization_covers_a_partial_last_block() -> None:
    """The reference for block-scaled linears whose N is not a multiple of 128 (2,112 in Kimi
    K2's fused q_a + kv_a): the last row block's scale covers the rows that exist."""
    w = torch.ones(200, 256).to(torch.float8_e4m3fn)
    blocks = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    deq = deepgemm.dequantize_blocks(w, blocks)
    assert deq.shape == (200, 256)
    assert deq[0, 0] == 1 and deq[127, 255] == 2 and deq[128, 0] == 3 and deq[199, 255] == 4
