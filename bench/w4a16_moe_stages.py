"""The MoE up GEMM's tensor-core tiles by pipeline stages and warps, side by side in one process:
Kimi K2's routed experts (384, top 8, group 32) at 2, 4 and 8 rows an expert, each tile with
its SiLU-and-mul on the same weights and routings. The 8 x 256 tile keeps two programs (8
warps) on an SM with four stages, four (16 warps) with three: the measurement behind the
three-stage tuner candidates. CUDA-graph replay medians, us, and the bytes of the experts the
first routing touches over that time.

    python bench/w4a16_moe_stages.py [--rows 2,4,8] [--out DIR] [--commit SHA]
"""

from __future__ import annotations

import argparse

import torch
from tessera.kernels.w4a16_moe import MoeConfig, align_to_experts, moe_gemm
from timing import graph_time_us, parse_results_args, write_results
from w4a16_bench import random_int4, routings, tokens_for_rows

EXPERTS, HIDDEN, INTER, TOP_K, GROUP = 384, 7168, 2048, 8, 32
TILES = (  # (block_m, block_n, warps, stages, weights first)
    [(8, 256, 4, s, True) for s in (2, 3, 4)] + [(8, 256, 8, s, True) for s in (3, 4)]
    + [(8, 128, 4, s, True) for s in (3, 4, 6)] + [(16, 256, 4, s, False) for s in (3, 4)]
    + [(16, 128, 4, s, False) for s in (3, 4)]
)  # fmt: skip


def time_up_gemm(x, weights, aligned, cfg: MoeConfig) -> float:
    """``cfg``'s up GEMM with SiLU-and-mul, cycling over the weight sets and their routings."""
    pairs = x.shape[0] * TOP_K
    return graph_time_us(lambda i: moe_gemm(x, weights[i], *aligned[i], pairs, TOP_K, cfg,
                                            silu_mul=True), len(weights))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4,8", help="average rows an expert")
    args = parse_results_args(ap)
    weights = [random_int4((EXPERTS, 2 * INTER, HIDDEN), GROUP) for _ in range(2)]
    expert_bytes = weights[0].qweight[0].numel() * 4 + weights[0].scales[0].numel() * 2
    rows = []
    for per_expert in map(int, args.rows.split(",")):
        tokens = tokens_for_rows(per_expert, EXPERTS, TOP_K)
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        rs = routings(tokens, EXPERTS, TOP_K, len(weights))
        touched = len(torch.unique(rs[0][1]))  # the routings' experts alike: the first's count
        for bm, bn, warps, stages, swap in TILES:
            cfg = MoeConfig(bm, bn, 128, warps, stages, swap=swap)
            us = time_up_gemm(x, weights, [align_to_experts(ids, EXPERTS, bm) for _, ids in rs],
                              cfg)  # fmt: skip
            rows.append({"rows_per_expert": per_expert, "tokens": tokens, "block_m": bm,
                         "block_n": bn, "warps": warps, "stages": stages, "swap": swap, "us": us,
                         "TBps": expert_bytes * touched / us / 1e6})  # fmt: skip
            print(f"{per_expert} rows an expert ({tokens} tokens): {bm}x{bn} {warps} warps "
                  f"{stages} stages{' weights first' if swap else ''}: {us:8.1f} us "
                  f"{rows[-1]['TBps']:5.2f} TB/s", flush=True)  # fmt: skip
    write_results(args.out, "w4a16_moe_stages.json", args.commit,
                  "Kimi K2's up GEMM (384 experts, top 8, group 32, SiLU-and-mul) per tile, "
                  "CUDA-graph replay medians over 2 weight sets, us", rows)  # fmt: skip


if __name__ == "__main__":
    main()
