"""SGLang's compressed-tensors W4A16 linear and MoE schemes running tessera's INT4 kernels.

SGLang 0.5.23 loads a ``pack-quantized`` 4-bit checkpoint through ``CompressedTensorsWNA16``
(linear layers) and ``CompressedTensorsWNA16MoE`` (experts); both then repack for Marlin in
``process_weights_after_loading`` and run Marlin in ``apply_weights``. The adapter replaces those
two methods on both classes:

- at load, per layer, it decides from the scheme and the layer alone whether tessera can serve it
  (:func:`linear_unsupported`, :func:`moe_unsupported`); if so it converts the loaded tensors once
  into :class:`W4A16Weight` (``repack_from_compressed_tensors``, bit for bit), drops the
  checkpoint-format parameters and keeps the converted weight on the layer; if not, it logs the
  reason once and runs SGLang's own method (Marlin repack);
- at run time a layer holding a tessera weight runs ``w4a16_matmul`` / ``fused_moe``; any other
  layer runs SGLang's ``apply_weights``.

Layouts as SGLang leaves them after loading: linear ``weight_packed`` int32 ``[N, K/8]``,
``weight_scale`` ``[N, K/G]``, ``weight_zero_point`` int32 ``[N/8, K/G]`` (the checkpoint's own);
MoE ``w13_weight_packed`` ``[E, H/8, 2I]`` (gate columns, then up), ``w2_weight_packed``
``[E, I/8, H]``, scales ``[E, K/G, N]``, zero points ``[E, K/G, N/8]`` (the checkpoint's
tensors transposed by SGLang's loader).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from tessera.kernels.w4a16_format import (
    SUPPORTED_GROUP_SIZES,
    W4A16Weight,
    repack_from_compressed_tensors,
)
from tessera.kernels.w4a16_gemm import w4a16_matmul
from tessera.kernels.w4a16_moe import fused_moe

from .contract import WNA16_MODULE, WNA16_MOE_MODULE
from .fallback import FALLBACKS, Fallbacks
from .plan import W4A16

WEIGHT_ATTR = "tessera_w4a16"  # linear: W4A16Weight
W13_ATTR, W2_ATTR = "tessera_w13", "tessera_w2"  # MoE: W4A16Weight [E, ...] each
ORIGINAL_ATTR = "_tessera_original"

LINEAR_PARAMS = (
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
)
MOE_PARAMS = tuple(
    f"{w}_{p}"
    for w in ("w13", "w2")
    for p in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
) + ("w13_g_idx_sort_indices", "w2_g_idx_sort_indices")


def _common_unsupported(num_bits: int, group_size: int | None, scale: torch.Tensor) -> str | None:
    if torch.version.hip is not None:
        return "ROCm (tessera's kernels target NVIDIA GPUs)"
    if num_bits != 4:
        return f"{num_bits}-bit weights"
    if group_size not in SUPPORTED_GROUP_SIZES:
        what = "channel-wise scales" if group_size in (None, -1) else f"group size {group_size}"
        return f"{what} (tessera: groups of {', '.join(map(str, SUPPORTED_GROUP_SIZES))})"
    if scale.dtype != torch.bfloat16:
        return f"{scale.dtype} activations (tessera's INT4 kernels take bf16)"
    return None


def linear_unsupported(scheme: Any, layer: Any) -> str | None:
    """Why tessera cannot serve this ``CompressedTensorsWNA16`` layer (None: it can)."""
    reason = _common_unsupported(32 // scheme.pack_factor, scheme.group_size, layer.weight_scale)
    if reason is not None:
        return reason
    if scheme.has_g_idx:
        return "activation-order (g_idx) checkpoints"
    k = layer.weight_packed.shape[1] * scheme.pack_factor
    if k % scheme.group_size:
        return f"a K of {k} that is not a multiple of the group size {scheme.group_size}"
    return None


def moe_unsupported(scheme: Any, layer: Any) -> str | None:
    """Why tessera cannot serve this ``CompressedTensorsWNA16MoE`` layer (None: it can)."""
    reason = _common_unsupported(scheme.num_bits, scheme.group_size, layer.w13_weight_scale)
    if reason is not None:
        return reason
    if scheme.actorder not in (None, "static"):
        return f"activation order {scheme.actorder}"
    if getattr(layer, "moe_ep_size", 1) != 1:
        return "expert parallelism (tessera's MoE takes local expert ids only)"
    cfg = getattr(scheme, "moe_runner_config", None)
    if cfg is None:
        return "no MoE runner config on the scheme"
    if cfg.activation != "silu" or not cfg.is_gated:
        return f"activation {cfg.activation} (tessera: gated SiLU)"
    for name in ("swiglu_limit", "gemm1_clamp_limit", "gemm1_alpha"):
        if getattr(cfg, name, None) is not None:
            return f"{name} set (tessera's MoE has no clamped or scaled SwiGLU)"
    if cfg.apply_router_weight_on_input or cfg.no_combine:
        return "router weights on the input or no_combine"
    return None


def _drop(layer: torch.nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        if hasattr(layer, name):
            delattr(layer, name)


def repack_linear(layer: torch.nn.Module) -> W4A16Weight:
    """Convert the loaded ``CompressedTensorsWNA16`` tensors once (``weight_shape`` is the full,
    unsharded shape under tensor parallelism, so the partition's shape comes from the tensors)."""
    zero = getattr(layer, "weight_zero_point", None)
    return repack_from_compressed_tensors(
        layer.weight_packed.data,
        layer.weight_scale.data,
        None,
        None if zero is None else zero.data,
    )


def repack_moe(layer: torch.nn.Module, prefix: str, symmetric: bool) -> W4A16Weight:
    """Convert one MoE weight (``w13`` or ``w2``): SGLang's loader stored the checkpoint tensors
    transposed, so they are handed back in the checkpoint's orientation (views)."""
    zero = None if symmetric else getattr(layer, f"{prefix}_weight_zero_point").data
    return repack_from_compressed_tensors(
        getattr(layer, f"{prefix}_weight_packed").data.transpose(-1, -2),
        getattr(layer, f"{prefix}_weight_scale").data.transpose(-1, -2),
        None,
        None if zero is None else zero.transpose(-1, -2),
    )


def linear_forward(w: W4A16Weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = w4a16_matmul(rows, w)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], w.n)


def moe_forward(
    w13: W4A16Weight,
    w2: W4A16Weight,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    routed_scaling_factor: float | None,
) -> torch.Tensor:
    """SGLang's Marlin MoE scales the routed sum by ``routed_scaling_factor``; the same factor on
    the routing weights is the same sum, rounded to bf16 once."""
    if routed_scaling_factor not in (None, 1.0):
        topk_weights = topk_weights * routed_scaling_factor
    return fused_moe(x, w13, w2, topk_weights, topk_ids)


def make_linear_methods(
    original_process: Callable[..., Any],
    original_apply: Callable[..., Any],
    fallbacks: Fallbacks = FALLBACKS,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``process_weights_after_loading`` and ``apply_weights`` for ``CompressedTensorsWNA16``."""

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        reason = linear_unsupported(self, layer)
        if reason is not None:
            fallbacks.record(W4A16, f"linear: {reason}")
            return original_process(self, layer)
        weight = repack_linear(layer)
        _drop(layer, LINEAR_PARAMS)
        setattr(layer, WEIGHT_ATTR, weight)
        return None

    def apply_weights(self: Any, layer: torch.nn.Module, x: torch.Tensor, bias: Any) -> Any:
        weight = getattr(layer, WEIGHT_ATTR, None)
        if weight is None:
            return original_apply(self, layer, x, bias)
        return linear_forward(weight, x, bias)

    return process_weights_after_loading, apply_weights


def make_moe_methods(
    original_process: Callable[..., Any],
    original_apply: Callable[..., Any],
    fallbacks: Fallbacks = FALLBACKS,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``process_weights_after_loading`` and ``apply_weights`` for ``CompressedTensorsWNA16MoE``."""

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        if getattr(layer, W13_ATTR, None) is not None:
            return None  # converted already
        reason = moe_unsupported(self, layer)
        if reason is not None:
            fallbacks.record(W4A16, f"MoE: {reason}")
            return original_process(self, layer)
        w13, w2 = repack_moe(layer, "w13", self.sym), repack_moe(layer, "w2", self.sym)
        _drop(layer, MOE_PARAMS)
        setattr(layer, W13_ATTR, w13)
        setattr(layer, W2_ATTR, w2)
        return None

    def apply_weights(self: Any, layer: torch.nn.Module, dispatch_output: Any) -> Any:
        w13 = getattr(layer, W13_ATTR, None)
        if w13 is None:
            return original_apply(self, layer, dispatch_output)
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        topk_weights, topk_ids, _ = dispatch_output.topk_output
        out = moe_forward(
            w13,
            getattr(layer, W2_ATTR),
            dispatch_output.hidden_states,
            topk_weights,
            topk_ids,
            self.moe_runner_config.routed_scaling_factor,
        )
        return StandardCombineInput(hidden_states=out)

    return process_weights_after_loading, apply_weights


def _patch(cls: Any, makers: Callable[..., tuple[Callable[..., Any], Callable[..., Any]]]) -> None:
    if hasattr(cls.apply_weights, ORIGINAL_ATTR):
        return
    originals = (cls.process_weights_after_loading, cls.apply_weights)
    process, apply = makers(*originals)
    for name, new, old in zip(
        ("process_weights_after_loading", "apply_weights"), (process, apply), originals, strict=True
    ):
        setattr(new, ORIGINAL_ATTR, old)
        setattr(cls, name, new)


def _unpatch(cls: Any) -> None:
    for name in ("process_weights_after_loading", "apply_weights"):
        original = getattr(getattr(cls, name), ORIGINAL_ATTR, None)
        if original is not None:
            setattr(cls, name, original)


def _classes() -> tuple[Any, Any]:
    linear = importlib.import_module(WNA16_MODULE).CompressedTensorsWNA16
    moe = importlib.import_module(WNA16_MOE_MODULE).CompressedTensorsWNA16MoE
    return linear, moe


def install() -> None:
    """Patch both schemes (idempotent). Must run before SGLang loads the model."""
    linear, moe = _classes()
    _patch(linear, make_linear_methods)
    _patch(moe, make_moe_methods)


def uninstall() -> None:
    for cls in _classes():
        _unpatch(cls)
