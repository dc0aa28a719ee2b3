"""The decode slice's stand-ins for SGLang's fused glue ops (bench/sglang_glue.py) against
their torch references, under the Triton interpreter: RMSNorm with and without the residual
add, on strided row slices, and SiLU-and-mul."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from sglang_glue import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_ref,
    rope_cache,
    rope_inplace,
    rope_inplace_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

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


def test_rope_rotates_query_heads_and_key_in_place_as_its_reference() -> None:
    """The query's rope columns (a view of the q_b output) and the key's (a view of the latent
    projection), each token at its own position; position 0 leaves them as they are."""
    g = torch.Generator().manual_seed(2)
    q_full = torch.randn(3, 5, 32 + 64, generator=g).bfloat16()  # heads x (nope + rope)
    latent = torch.randn(3, 80 + 64, generator=g).bfloat16()
    positions = torch.tensor([0, 7, 300])
    cache = rope_cache(512, 64, torch.device("cpu"))
    q, k = q_full[..., 32:], latent[:, 80:]
    q_ref, k_ref = q.clone(), k.clone()
    before = q_full.clone(), latent.clone()
    rope_inplace(positions, q, k, cache)
    rope_inplace_ref(positions, q_ref, k_ref, cache)
    assert (q.float() - q_ref.float()).abs().max() <= 2**-7 * q_ref.float().abs().max()
    assert (k.float() - k_ref.float()).abs().max() <= 2**-7 * k_ref.float().abs().max()
    assert torch.equal(q_full[..., :32], before[0][..., :32])  # only the rope columns change
    assert torch.equal(latent[:, :80], before[1][:, :80])
    assert torch.equal(q_full[0], before[0][0]) and torch.equal(latent[0], before[1][0])
    assert not torch.equal(q_full[2], before[0][2]) and not torch.equal(latent[2], before[1][2])
    # a rotation: each pair keeps its length
    def lengths(x: torch.Tensor) -> torch.Tensor:
        return x[2, :, 32:].float().view(5, 32, 2).norm(dim=-1)

    assert torch.allclose(lengths(q_full), lengths(before[0]), rtol=2e-2)
