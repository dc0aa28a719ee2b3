"""Block-scaled FP8 weights as DeepSeek V3, Kimi K2 and GLM 5 ship them.

A weight `W` of shape [N, K] is stored as `weight` (float8_e4m3fn, [N, K]) and
`weight_scale_inv` (float32, [ceil(N/B), ceil(K/B)], B = 128): the real weight is
`weight[i, j] * weight_scale_inv[i // B, j // B]` (despite its name the scale multiplies).
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _expand(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    rows, cols = shape
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """FP8 weight and its block scales -> float32 weight."""
    expected = (-(-weight.shape[0] // block), -(-weight.shape[1] // block))
    if weight.dim() != 2 or tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"FP8 weight {tuple(weight.shape)} needs a weight_scale_inv of shape {expected} "
            f"({block}x{block} blocks), got {tuple(scale_inv.shape)}"
        )
    return weight.float() * _expand(scale_inv.float(), weight.shape, block)


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight -> (FP8 weight, float32 weight_scale_inv), the inverse of `dequantize`."""
    rows, cols = weight.shape
    pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    pad[:rows, :cols] = weight.float()
    blocks = pad.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, B, C, B]
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    fp8 = (weight.float() / _expand(scale_inv, weight.shape, block)).to(torch.float8_e4m3fn)
    return fp8, scale_inv
