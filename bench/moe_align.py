"""The MoE's expert alignment (``align_to_experts``: one Triton launch up to a chunk of 1,024
(token, slot) pairs, two beyond) beside its torch version (``align_to_experts_reference``,
twenty to thirty launches with a radix sort), side by side in one process at the routers' sizes:
Kimi K2 (384 experts, top 8, 16-row blocks), GLM 5 (256, top 8, 8-row blocks) and one EP-8
GPU's Kimi K2 experts (48, top 1). CUDA-graph replay medians, us; each result is checked
against the torch version's first. ``--chunks`` also times each chunk size ``c`` given (one
program up to ``c`` pairs, chunks of ``c`` beyond), which is how the defaults were chosen.

    python bench/moe_align.py [--tokens 1,64,128,129,256,512,1024] [--chunks 128,256,512,1024]
                              [--out DIR] [--commit SHA]
"""

from __future__ import annotations

import argparse

import torch
from tessera.kernels.w4a16_moe import align_to_experts, align_to_experts_reference
from timing import graph_time_us, parse_results_args, write_results

ROUTERS = {"kimi-k2": (384, 8, 16), "glm-5": (256, 8, 8), "kimi-k2-ep8": (48, 1, 16)}
SETS = 4  # routings cycled through, so no call reads the one before's results


def time_router(experts: int, top_k: int, block_m: int, tokens: int, chunks: list[int]) -> dict:
    ids = [torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
           for _ in range(SETS)]  # fmt: skip
    sizes = {"default": {}} | {str(c): {"one_program": c, "chunk": c} for c in chunks}
    for i in ids:
        want = align_to_experts_reference(i, experts, block_m)
        for size in sizes.values():
            got = align_to_experts(i, experts, block_m, **size)
            if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                raise RuntimeError(f"alignment differs from the torch version at {tokens} "
                                   f"tokens ({size or 'default sizes'})")  # fmt: skip
    times = {name: graph_time_us(lambda i, s=size: align_to_experts(ids[i], experts, block_m, **s),
                                 SETS) for name, size in sizes.items()}  # fmt: skip
    torch_ops = graph_time_us(lambda i: align_to_experts_reference(ids[i], experts, block_m), SETS)
    kernel = times.pop("default")
    return {"pairs": tokens * top_k, "kernel_us": kernel, "torch_us": torch_ops,
            "torch_over_kernel": torch_ops / kernel, "chunk_us": times}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,128,129,256,512,1024")
    ap.add_argument("--chunks", default="", help="chunk sizes to time beside the defaults")
    args = parse_results_args(ap)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    rows = []
    for name, (experts, top_k, block_m) in ROUTERS.items():
        for tokens in map(int, args.tokens.split(",")):
            timed = time_router(experts, top_k, block_m, tokens, chunks)
            row = {"router": name, "experts": experts, "top_k": top_k, "block_m": block_m,
                   "tokens": tokens, **timed}  # fmt: skip
            rows.append(row)
            print(f"{name:12s} {tokens:5d} tokens ({row['pairs']:5d} pairs): kernel "
                  f"{row['kernel_us']:6.1f} us, torch {row['torch_us']:6.1f} us "
                  f"({row['torch_over_kernel']:.1f}x)"
                  + "".join(f", chunk {c} {t:.1f}" for c, t in row["chunk_us"].items()),
                  flush=True)  # fmt: skip
    write_results(args.out, "moe_align.json", args.commit,
                  "align_to_experts (its default sizes, and chunk_us: one program up to c pairs, "
                  "chunks of c beyond) and align_to_experts_reference on the same routings in "
                  "one process, CUDA-graph replay medians over 4 routings, us",
                  rows)  # fmt: skip


if __name__ == "__main__":
    main()
