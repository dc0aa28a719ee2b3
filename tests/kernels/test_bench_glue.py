"""The decode slice's stand-ins for SGLang's fused glue ops (bench/sglang_glue.py) against
their torch references, under the Triton interpreter: RMSNorm with and without the residual
add, on strided row slices, and SiLU-and-mul."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from sglang_glue import add_rms_norm, add_rms_norm_ref, silu_and_mul, silu_and_mul_ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("gpu_like_interpreter")


def test_add_rms_norm_matches_its_reference_with_and_without_the_residual() -> None:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 300, generator=g).bfloat16()
    x = wide[:, 20:220]  # a strided column slice, as the slice's q_a / kv_a norms take
    delta = torch.randn(3, 200, generator=g).bfloat16()
    w = torch.rand(200, generator=g).bfloat16() + 0.5
    for d in (delta, None):
        res, out = add_rms_norm(x, d, w, 1e-6)
        ref_res, ref_out = add_rms_norm_ref(x, d, w, 1e-6)
        assert torch.equal(res, ref_res)
        assert out.is_contiguous() and out.dtype == torch.bfloat16
        assert (out.float() - ref_out.float()).abs().max() <= 2 ** -7 * ref_out.float().abs().max()
    assert torch.equal(add_rms_norm(x, delta, w, 1e-6)[0], (x.float() + delta.float()).bfloat16())


def test_silu_and_mul_matches_its_reference() -> None:
    h = torch.randn(5, 2 * 1100, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = silu_and_mul(h)
    assert out.shape == (5, 1100)
    assert (out.float() - silu_and_mul_ref(h).float()).abs().max() <= 1e-2
