"""The one error measure the benchmarks report: relative L2 error of an output against a
reference, in float32."""

from __future__ import annotations

import torch


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())
