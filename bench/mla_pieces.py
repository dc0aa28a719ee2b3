"""Three ways one e4m3 kernel (128-token tiles) takes equal requests whose splits pass the
8k-token cap, side by side in one process on the same pages: more splits (capped), each split
cut into pieces (pieces, the default), and no cap at all (one long piece a split: the accuracy
the cap keeps is lost, so this is for measuring only). The capped and uncapped plans run the
one-piece binary (Triton compiles ``pieces`` = 1 as a constant), the pieces plan the binary for
two or more: uncapped as fast as capped and pieces slower puts a cost on that binary
(docs/kernels-fp8-kv.md, "The token cap in pieces").

    python bench/mla_pieces.py [--shapes HEADSxBATCHxCONTEXT,...] [--out DIR] [--commit SHA]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from fp8_kv_decode import bench_mla
from tessera.kernels.paged_decode_split import MLA_FP8_E4M3_128
from timing import copy_bandwidth, parse_results_args, write_results

PLANS = {
    "capped": replace(MLA_FP8_E4M3_128, split_tokens_capped=True),
    "pieces": MLA_FP8_E4M3_128,
    "uncapped": replace(MLA_FP8_E4M3_128, max_split_tokens=0),
}


def time_plans(heads: int, batch: int, ctx: int, copy_bw: float) -> dict:
    """Each plan's time (us) and error against its own dequantized pages."""
    row = {"heads": heads, "batch": batch, "ctx": ctx}
    for name, config in PLANS.items():
        timed = bench_mla(batch, ctx, heads, 64, None, copy_bw, variants={name: ("fp8", config)})
        failed = timed.get(f"ours_fp8_{name}_error")
        if failed:
            raise RuntimeError(f"{name} at {heads}x{batch}x{ctx}: {failed}")
        row[f"{name}_us"] = timed[f"ours_fp8_{name}_us"]
        row[f"{name}_err_vs_dequant"] = timed[f"err_ours_fp8_{name}_vs_dequant"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x128x16384,16x132x32768,8x128x32768")
    args = parse_results_args(ap, "a Hopper GPU")
    copy_bw = copy_bandwidth()
    rows = []
    for shape in args.shapes.split(","):
        row = time_plans(*map(int, shape.split("x")), copy_bw)
        rows.append(row)
        print(f"{shape}: " + "  ".join(f"{name} {row[f'{name}_us']:7.1f}us" for name in PLANS),
              flush=True)  # fmt: skip
    write_results(args.out, "mla_pieces.json", args.commit,
                  "bench_mla (bench/fp8_kv_decode.py) once per plan and shape in one process, "
                  "told the real longest length; page 64, CUDA-graph replay medians, us",
                  rows)  # fmt: skip


if __name__ == "__main__":
    main()
