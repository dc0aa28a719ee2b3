"""Kernel tests: without a CUDA device they run under Triton's interpreter (switched on in
tests/conftest.py). ``gpu_like_interpreter`` is for modules whose kernels (or SGLang's)
multiply bf16 or e4m3 tiles: they opt in with ``pytestmark = pytest.mark.usefixtures(...)``.
"""

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def gpu_like_interpreter():
    """Make the Triton interpreter compute bf16 and e4m3 like the GPU, for one module.

    Its gaps (triton 3.9 on CPU): ``tl.dot`` multiplies bf16 and e4m3 operands as their raw
    bits; fp32 -> bf16 casts truncate where the GPU rounds to nearest even; its cast to e4m3
    drops the carry into the exponent (127.9 becomes 64) and does not saturate. Here dots
    widen to fp32 (exact) and those casts go through torch, e4m3 saturating at +-448 as the
    GPU's ``satfinite`` conversion does. Only the interpreter changes, never a kernel.
    """
    if torch.cuda.is_available():
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast, fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp
    as_torch = {tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn,
                tl.float16: torch.float16, tl.float32: torch.float32}  # fmt: skip

    def values(h) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(h.data)).view(as_torch[h.dtype.scalar])

    def handle(t: torch.Tensor, dtype):
        bits = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8}.get(t.dtype)
        return interpreter.TensorHandle((t.view(bits) if bits else t).numpy(), dtype)

    def widen(h):
        if h.dtype.scalar not in (tl.bfloat16, tl.float8e4nv):
            return h
        return handle(values(h).float(), tl.float32)

    def rounded(src, dst_type):
        """fp -> bf16 / e4m3 rounded to nearest even by torch, or None for other casts."""
        src_t, dst_t = src.dtype.scalar, dst_type.scalar
        if src_t not in as_torch or dst_t not in (tl.bfloat16, tl.float8e4nv) or src_t == dst_t:
            return None
        wide = values(src).float()
        if dst_t == tl.float8e4nv:
            wide = wide.clamp(-448.0, 448.0)
        return handle(wide.to(as_torch[dst_t]), dst_t)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        out = rounded(src, dst_type)
        return out if out is not None else cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = rounded(src, dst_type)
        return out if out is not None else fp_to_fp(self, src, dst_type, rounding_mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "create_dot", create_dot)
        mp.setattr(builder, "cast_impl", cast_impl)
        mp.setattr(builder, "create_fp_to_fp", create_fp_to_fp)
        mp.setattr(builder, "create_fp_trunc", lambda self, src, t: self.cast_impl(src, t))
        yield


@pytest.fixture(autouse=True)
def seeded():
    """Every kernel test draws the same random data on every run: its pass or fail against a
    tolerance is then a property of the kernel, not of the draw."""
    torch.manual_seed(0)
