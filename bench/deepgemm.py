"""SGLang 0.5.23's dense block-FP8 linear on Hopper as a benchmark peer.

On sm90 SGLang runs a block-FP8 checkpoint's linears (Kimi K2, DeepSeek V3, GLM 5: 128 x 128
weight blocks) through DeepGEMM whenever ``deep_gemm`` imports
(``fp8_utils._dispatch_auto_backend`` -> ``deepgemm_w8a8_block_fp8_linear_with_fallback``):
the activation is quantized per token in groups of 128 with fp32 scales stored column-major
and TMA-aligned (rows padded to 4), then ``deep_gemm.fp8_gemm_nt`` multiplies. SGLang quantizes
with sgl-kernel's CUDA op, whose compiled library does not load on the GPU machine's torch; its
Triton twin ``_per_token_group_quant_8bit_colmajor`` from the same release runs here instead.
SGLang pins its fork's wheel of DeepGEMM (``sgl-deep-gemm`` 0.2.3.post2), which does not load on
that torch either; ``deepgemm_build.py`` builds upstream DeepGEMM, from which the fork's sm90
block-FP8 GEMM derives (the fork adds 32-wide scale blocks and reorders its accumulation).
Each kernel compiles with nvcc on first use (``DG_JIT_CACHE_DIR`` keeps them).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path

import torch
from sglang_source import find_sglang_source, load_triton_functions

GROUP = 128  # activation groups and weight blocks
FP8_MAX = 448.0


def supported(n: int, k: int) -> bool:
    """SGLang's own test (``_deepgemm_block_fp8_supported``): it sends other shapes to its
    Triton GEMM, which this peer does not run (``DeepGemm.linear`` refuses them)."""
    return n % 64 == 0 and k % GROUP == 0


def colmajor_scales(rows: int, groups: int, device) -> torch.Tensor:
    """``[rows, groups]`` fp32 stored column-major with the row count padded to 4 (16 bytes),
    as ``create_per_token_group_quant_fp8_output_scale`` makes them for DeepGEMM's TMA."""
    padded = (rows + 3) // 4 * 4
    return torch.empty(groups, padded, dtype=torch.float32, device=device).t()[:rows]


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3 ``q`` [rows, cols] with one scale per group of columns."""
    group = q.shape[1] // scale.shape[1]
    return q.float() * scale.repeat_interleave(group, dim=1)


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3 ``w`` [N, K] with one scale per 128 x 128 block (the last row block
    may be partial)."""
    s = scale.repeat_interleave(GROUP, dim=0).repeat_interleave(GROUP, dim=1)
    return w.float() * s[: w.shape[0], : w.shape[1]]


class DeepGemm:
    def __init__(self, sglang_src: Path | None = None) -> None:
        import deep_gemm  # built by deepgemm_build.py; absent on machines without a Hopper GPU

        self.dg = deep_gemm
        path = find_sglang_source("fp8_kernel.py", sglang_src)
        self.quant_kernel = load_triton_functions(path, {"_per_token_group_quant_8bit_colmajor"})[
            "_per_token_group_quant_8bit_colmajor"
        ]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_colmajor(self.quant_kernel, x)

    def gemm(self, xq, xs, weight: torch.Tensor, block_scale: torch.Tensor, out=None):
        """``xq @ weight.T`` with the scales applied, BF16 ``[M, N]``."""
        if out is None:
            out = torch.empty(xq.shape[0], weight.shape[0], dtype=torch.bfloat16,
                              device=xq.device)  # fmt: skip
        self.dg.fp8_gemm_nt((xq, xs), (weight, block_scale), out)
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor):
        """The whole linear as SGLang runs it: quantize, then GEMM (two launches)."""
        if not supported(*weight.shape):
            raise ValueError(f"DeepGEMM takes N % 64 == 0 and K % 128 == 0, not {weight.shape}")
        return self.gemm(*self.quantize(x), weight, block_scale)


def quantize_colmajor(kernel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's per-token-group (128) e4m3 quantization with DeepGEMM's scale layout."""
    x = x.contiguous()
    rows, cols = x.shape
    xq = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    xs = colmajor_scales(rows, cols // GROUP, x.device)
    kernel[(rows * (cols // GROUP),)](
        x, xq, xs, GROUP, cols, xs.stride(1), 1e-10, bit8_min=-FP8_MAX, bit8_max=FP8_MAX,
        BLOCK=GROUP, SCALE_UE8M0=False, num_warps=1, num_stages=1,
    )  # fmt: skip
    return xq, xs


def _compile_one(job: tuple[int, int, int, str | None]) -> tuple[int, int, int, float]:
    """Run one linear so that DeepGEMM compiles (or finds in its cache) the kernel for it."""
    m, n, k, src = job
    dg = DeepGemm(Path(src) if src else None)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(n, k, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.ones(-(-n // GROUP), k // GROUP, device="cuda")
    t0 = time.time()
    dg.linear(x, w, s)
    torch.cuda.synchronize()
    return m, n, k, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description="compile DeepGEMM's kernels for these linears "
                                             "in parallel processes (one nvcc each), ahead of a "
                                             "benchmark; DG_JIT_CACHE_DIR keeps them")  # fmt: skip
    ap.add_argument("--shapes", required=True, help="N:K pairs, comma-separated")
    ap.add_argument("--m", default="1,16,64", help="row counts, comma-separated")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--sglang-src", help="folder with SGLang's fp8_kernel.py")
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split(":"))) for s in args.shapes.split(",")]
    jobs = [(m, n, k, args.sglang_src) for n, k in shapes for m in map(int, args.m.split(","))]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for m, n, k, seconds in pool.imap_unordered(_compile_one, jobs):
            print(f"deepgemm M={m} N={n} K={k}: first call {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
