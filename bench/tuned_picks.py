"""The INT4 kernels' tuned picks as JSON: a run records them and a later run can repeat them
(``decode_slice.py --tuned-from``), so that an A/B across machine starts compares the change,
not the tuner's noise (two starts of the same code have picked different tiles).

A pick is ``[key, config]``: the tuner's key (``w4a16_gemm.tune_cached``; the device's name is
part of it, so picks made on another GPU model never apply) and a ``GemmConfig``, or for the
MoE a pair of ``MoeConfig``, each as ``{"ClassName": fields}``; dtypes as ``{"dtype": name}``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from tessera.kernels.w4a16_gemm import _TUNED, GemmConfig
from tessera.kernels.w4a16_moe import MoeConfig

CONFIG_TYPES = {c.__name__: c for c in (GemmConfig, MoeConfig)}


def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (GemmConfig, MoeConfig)):
        return {type(value).__name__: asdict(value)}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict):
        ((name, fields),) = value.items()
        return getattr(torch, fields) if name == "dtype" else CONFIG_TYPES[name](**fields)
    return value


def tuned_picks() -> list[list[Any]]:
    """Every pick the INT4 tuners made in this process, JSON-ready."""
    return [[_encode(key), _encode(config)] for key, config in _TUNED.items()]


def load_tuned_picks(picks: list[list[Any]]) -> int:
    """Make the tuners take these picks instead of timing their candidates; returns how many."""
    for key, config in picks:
        _TUNED[_decode(key)] = _decode(config)
    return len(picks)
