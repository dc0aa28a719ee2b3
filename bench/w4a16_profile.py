"""Launch chosen W4A16 kernels once each between profiler start and stop, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section WarpStateStats \\
        python bench/w4a16_profile.py

Profiles the GEMM at M = 1, 16384 x 7168, group 128, on both paths the v5 tuner chose between
(the weights-first 8 x 256 tensor-core tile with 4 K splits, and the CUDA-core GEMV with 128
columns and 8 K splits), and the MoE up GEMM at one token (Kimi-like experts, group 32).
Compilation and a warm-up run happen before the profiler starts.
"""

from __future__ import annotations

import torch
from tessera.kernels.w4a16_format import PACK, W4A16Weight
from tessera.kernels.w4a16_gemm import GemmConfig, w4a16_matmul
from tessera.kernels.w4a16_moe import MoeConfig, align_to_experts, moe_gemm


def random_int4(lead: tuple, n: int, k: int, group: int) -> W4A16Weight:
    qweight = torch.randint(-(2**31), 2**31 - 1, (*lead, k // PACK, n), dtype=torch.int32,
                            device="cuda")  # fmt: skip
    scales = ((torch.rand(*lead, k // group, n, device="cuda") + 0.5) / 64).to(torch.bfloat16)
    return W4A16Weight(qweight, scales, None, group)


def main() -> None:
    w = random_int4((), 16384, 7168, 128)
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    gemm_cfg = GemmConfig("triton", 8, 256, 128, 4, 4, 4, swap=True)
    gemv_cfg = GemmConfig("gemv", 1, 128, 128, 8, 4, 1)
    experts, hidden, inter = 384, 7168, 2048
    w13 = random_int4((experts,), 2 * inter, hidden, 32)
    ids = torch.randperm(experts, device="cuda")[:8].view(1, 8)
    xm = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    moe_cfg = MoeConfig(8, 128, 128, 4, 4, swap=True)
    pair_ids, block_expert = align_to_experts(ids, experts, moe_cfg.block_m)

    def run() -> None:
        w4a16_matmul(x, w, gemm_cfg)
        w4a16_matmul(x, w, gemv_cfg)
        moe_gemm(xm, w13, pair_ids, block_expert, 8, 8, moe_cfg, silu_mul=True)

    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
