"""The MoE's expert alignment (``align_to_experts``: one Triton launch up to a chunk of 1,024
(token, slot) pairs, two beyond) beside its torch version (``align_to_experts_reference``,
twenty to thirty launches with a radix sort), side by side in one process at the routers' sizes:
Kimi K2 (384 experts, top 8, 16-row blocks), GLM 5 (256, top 8, 8-row blocks) and one EP-8
GPU's Kimi K2 experts (48, top 1). CUDA-graph replay medians, us; each result is checked
against the torch version's first.

    python bench/moe_align.py [--tokens 1,64,128,129,256,512,1024] [--out DIR] [--commit SHA]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tessera.kernels.w4a16_moe import align_to_experts, align_to_experts_reference
from timing import graph_time_us, write_results

ROUTERS = {"kimi-k2": (384, 8, 16), "glm-5": (256, 8, 8), "kimi-k2-ep8": (48, 1, 16)}
SETS = 4  # routings cycled through, so no call reads the one before's results


def time_router(experts: int, top_k: int, block_m: int, tokens: int) -> dict:
    ids = [torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
           for _ in range(SETS)]  # fmt: skip
    for i in ids:
        got, want = (
            align_to_experts(i, experts, block_m),
            align_to_experts_reference(i, experts, block_m),
        )
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise RuntimeError(f"alignment differs from the torch version at {tokens} tokens")
    kernel = graph_time_us(lambda i: align_to_experts(ids[i], experts, block_m), SETS)
    torch_ops = graph_time_us(lambda i: align_to_experts_reference(ids[i], experts, block_m), SETS)
    return {"pairs": tokens * top_k, "kernel_us": kernel, "torch_us": torch_ops,
            "torch_over_kernel": torch_ops / kernel}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,128,129,256,512,1024")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--commit", default="", help="the tree's commit, recorded in the results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a GPU")
    rows = []
    for name, (experts, top_k, block_m) in ROUTERS.items():
        for tokens in map(int, args.tokens.split(",")):
            row = {"router": name, "experts": experts, "top_k": top_k, "block_m": block_m,
                   "tokens": tokens, **time_router(experts, top_k, block_m, tokens)}  # fmt: skip
            rows.append(row)
            print(f"{name:12s} {tokens:5d} tokens ({row['pairs']:5d} pairs): kernel "
                  f"{row['kernel_us']:6.1f} us, torch {row['torch_us']:6.1f} us "
                  f"({row['torch_over_kernel']:.1f}x)", flush=True)  # fmt: skip
    write_results(args.out, "moe_align.json", args.commit,
                  "align_to_experts and align_to_experts_reference on the same routings in "
                  "one process, CUDA-graph replay medians over 4 routings, us",
                  rows)  # fmt: skip


if __name__ == "__main__":
    main()
