"""Packed INT4 (W4A16) weight format and its pure-torch reference utilities.

Layout (the form the kernels read; "repacked once at load"):

- ``qweight``: int32 ``[..., K // 8, N]``, contiguous. Word ``(r, n)`` holds the eight 4-bit
  codes of input rows ``k = 8 r + i`` (i = 0..7) of output column ``n``, code ``i`` in bits
  ``4 i .. 4 i + 3``. Codes are unsigned, 0..15.
- ``scales``: bf16 (or fp16, kept as loaded so conversion stays lossless) ``[..., K // G, N]``.
- ``zeros``: optional uint8 ``[..., K // G, N]``, unsigned zero points 0..15; ``None`` means the
  symmetric zero point 8.
- dequantized weight ``W[n, k] = (code[k, n] - zero[k // G, n]) * scale[k // G, n]``; the matmul is
  ``y = x @ W.T`` (``W`` is ``[N, K]`` as in ``torch.nn.Linear``).
- leading dims (``...``) are experts for MoE weights: ``[E, K // 8, N]``.

It is the compressed-tensors ``pack-quantized`` format transposed. That format (what SGLang
loads for ``compressed-tensors`` W4A16) stores ``weight_packed`` int32 ``[N, K // 8]`` with the
same nibble order and the same unsigned codes (signed value + 8), ``weight_scale``
``[N, K // G]``, ``weight_shape`` ``[N, K]`` and, if asymmetric, ``weight_zero_point`` int32
``[ceil(N / 8), K // G]`` packed along the output dim. Transposing puts N innermost so the
kernels' loads are coalesced across columns; codes, scales and zero points are copied bit for
bit both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .w4a16_layout import PACK, SUPPORTED_GROUP_SIZES, SYMMETRIC_ZERO

SCALE_DTYPES = (torch.bfloat16, torch.float16)

_SHIFTS = tuple(4 * i for i in range(PACK))


@dataclass(frozen=True)
class W4A16Weight:
    """An INT4 weight ``[..., N, K]`` in the packed layout above."""

    qweight: torch.Tensor  # int32 [..., K // 8, N]
    scales: torch.Tensor  # bf16/fp16 [..., K // G, N]
    zeros: torch.Tensor | None  # uint8 [..., K // G, N] or None (symmetric)
    group_size: int

    def __post_init__(self) -> None:
        q, s, z, g = self.qweight, self.scales, self.zeros, self.group_size
        if q.dtype != torch.int32 or q.dim() < 2:
            raise ValueError(f"qweight must be int32 [..., K/8, N], got {q.dtype} {tuple(q.shape)}")
        if g not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size {g} is not supported; use one of {SUPPORTED_GROUP_SIZES}")
        k = q.shape[-2] * PACK
        if k % g:
            raise ValueError(f"K={k} is not a multiple of group_size={g}")
        groups_shape = (*q.shape[:-2], k // g, q.shape[-1])
        if s.dtype not in SCALE_DTYPES or tuple(s.shape) != groups_shape:
            raise ValueError(
                f"scales must be bf16/fp16 {groups_shape}, got {s.dtype} {tuple(s.shape)}"
            )
        if z is not None and (z.dtype != torch.uint8 or tuple(z.shape) != groups_shape):
            raise ValueError(f"zeros must be uint8 {groups_shape}, got {z.dtype} {tuple(z.shape)}")

    @property
    def n(self) -> int:
        return self.qweight.shape[-1]

    @property
    def k(self) -> int:
        return self.qweight.shape[-2] * PACK

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def to(self, device: torch.device | str) -> W4A16Weight:
        zeros = None if self.zeros is None else self.zeros.to(device)
        return W4A16Weight(self.qweight.to(device), self.scales.to(device), zeros, self.group_size)


def pack_int4(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack unsigned 4-bit codes (0..15, any integer dtype) 8 per int32 along ``dim``.

    Code ``8 r + i`` along ``dim`` lands in bits ``4 i`` of word ``r``; the size of ``dim`` must
    be a multiple of 8.
    """
    dim = dim % codes.dim()
    if codes.shape[dim] % PACK:
        raise ValueError(f"dim {dim} has size {codes.shape[dim]}, not a multiple of {PACK}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("4-bit codes must lie in 0..15")
    c = codes.movedim(dim, -1).to(torch.int32)
    c = c.reshape(*c.shape[:-1], -1, PACK)
    words = torch.zeros(c.shape[:-1], dtype=torch.int32, device=codes.device)
    for i, shift in enumerate(_SHIFTS):
        words |= c[..., i] << shift
    return words.movedim(-1, dim).contiguous()


def unpack_int4(words: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 words -> uint8 codes, ``dim`` grows 8x."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    dim = dim % words.dim()
    w = words.movedim(dim, -1).unsqueeze(-1)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    codes = ((w >> shifts) & 0xF).to(torch.uint8)
    codes = codes.reshape(*codes.shape[:-2], -1)
    return codes.movedim(-1, dim).contiguous()


def quantize_rtn(
    weight: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> W4A16Weight:
    """Round-to-nearest group-wise INT4 quantization of ``weight [..., N, K]`` (not GPTQ).

    Symmetric: ``scale = absmax / 7.5``, codes ``clamp(round(w / scale), -8, 7) + 8``.
    Asymmetric: ``scale = (max - min) / 15``, ``zero = round(-min / scale)``, codes
    ``clamp(round(w / scale) + zero, 0, 15)``. Codes are rounded against the stored (rounded)
    scale, so dequantizing reproduces exactly what the kernels compute.
    """
    if weight.dim() < 2 or weight.shape[-1] % group_size:
        raise ValueError(
            f"weight must be [..., N, K] with K a multiple of group_size={group_size}, "
            f"got {tuple(weight.shape)}"
        )
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
    *lead, n, k = weight.shape
    w = weight.float().reshape(*lead, n, k // group_size, group_size)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scale = (w.abs().amax(-1, keepdim=True) / 7.5).clamp_min(tiny)
        scale = scale.to(scale_dtype).float().clamp_min(tiny)
        codes = (torch.round(w / scale).clamp(-8, 7) + SYMMETRIC_ZERO).to(torch.uint8)
        zeros = None
    else:
        lo = w.amin(-1, keepdim=True).clamp_max(0)
        hi = w.amax(-1, keepdim=True).clamp_min(0)
        scale = ((hi - lo) / 15).clamp_min(tiny).to(scale_dtype).float().clamp_min(tiny)
        zero = torch.round(-lo / scale).clamp(0, 15)
        codes = (torch.round(w / scale) + zero).clamp(0, 15).to(torch.uint8)
        zeros = zero.squeeze(-1).to(torch.uint8).transpose(-1, -2).contiguous()
    codes = codes.reshape(*lead, n, k)
    return W4A16Weight(
        qweight=pack_int4(codes.transpose(-1, -2), dim=-2),
        scales=scale.squeeze(-1).to(scale_dtype).transpose(-1, -2).contiguous(),
        zeros=zeros,
        group_size=group_size,
    )


def dequantize(w: W4A16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``[..., N, K]`` as floats (computed in fp32, then cast to ``dtype``)."""
    codes = unpack_int4(w.qweight, dim=-2).float()  # [..., K, N]
    g = w.group_size
    zeros = SYMMETRIC_ZERO if w.zeros is None else w.zeros.float().repeat_interleave(g, dim=-2)
    values = (codes - zeros) * w.scales.float().repeat_interleave(g, dim=-2)
    return values.transpose(-1, -2).to(dtype)


def repack_from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int] | None = None,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> W4A16Weight:
    """Convert a compressed-tensors ``pack-quantized`` 4-bit weight (optionally with a leading
    expert dim) into :class:`W4A16Weight`, bit for bit.

    ``weight_packed`` int32 ``[..., N, K/8]``, ``weight_scale`` ``[..., N, K/G]`` (bf16/fp16),
    ``weight_zero_point`` int32 ``[..., ceil(N/8), K/G]`` for asymmetric checkpoints. The group
    size follows from the shapes. Activation-order checkpoints (a non-trivial ``g_idx``) are
    rejected.
    """
    if weight_packed.dtype != torch.int32 or weight_packed.dim() < 2:
        raise ValueError(
            f"weight_packed must be int32 [..., N, K/8], got {weight_packed.dtype} "
            f"{tuple(weight_packed.shape)}"
        )
    *lead, n, k_words = weight_packed.shape
    k = k_words * PACK
    if weight_shape is not None:
        shape = tuple(int(v) for v in torch.as_tensor(weight_shape).reshape(-1)[-2:])
        if shape != (n, k):
            raise ValueError(
                f"weight_shape {shape} does not match weight_packed {(n, k)}; K must be a "
                "multiple of 8 (padded checkpoints are not supported)"
            )
    groups = weight_scale.shape[-1]
    if tuple(weight_scale.shape[:-1]) != (*lead, n) or groups == 0 or k % groups:
        raise ValueError(
            f"weight_scale {tuple(weight_scale.shape)} does not fit weight [{n}, {k}] in groups"
        )
    group_size = k // groups
    if weight_g_idx is not None:
        expected = torch.arange(k, device=weight_g_idx.device) // group_size
        if not bool((weight_g_idx.reshape(-1, k).long() == expected).all()):
            raise ValueError(
                "activation-order (g_idx) checkpoints are not supported; "
                "re-quantize without act-order"
            )
    zeros = None
    if weight_zero_point is not None:
        if weight_zero_point.dtype != torch.int32:
            raise ValueError(f"weight_zero_point must be int32, got {weight_zero_point.dtype}")
        zp = unpack_int4(weight_zero_point, dim=-2)[..., :n, :]  # [..., N, K/G], signed + 8
        zeros = zp.transpose(-1, -2).contiguous()
    return W4A16Weight(
        qweight=weight_packed.transpose(-1, -2).contiguous(),
        scales=weight_scale.transpose(-1, -2).contiguous(),
        zeros=zeros,
        group_size=group_size,
    )


def to_compressed_tensors(w: W4A16Weight) -> dict[str, torch.Tensor]:
    """Inverse of :func:`repack_from_compressed_tensors`: the tensors of one ``pack-quantized``
    weight (``weight_packed``, ``weight_scale``, ``weight_shape`` and, if asymmetric,
    ``weight_zero_point``)."""
    out = {
        "weight_packed": w.qweight.transpose(-1, -2).contiguous(),
        "weight_scale": w.scales.transpose(-1, -2).contiguous(),
        "weight_shape": torch.tensor([w.n, w.k], dtype=torch.int32),
    }
    if w.zeros is not None:
        zp = w.zeros.transpose(-1, -2)  # [..., N, K/G]
        pad = (-w.n) % PACK
        if pad:
            # compressed-tensors pads the packed rows with code 0
            zp = torch.cat([zp, zp.new_zeros((*zp.shape[:-2], pad, zp.shape[-1]))], dim=-2)
        out["weight_zero_point"] = pack_int4(zp, dim=-2)
    return out
