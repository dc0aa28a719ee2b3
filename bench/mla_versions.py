"""Versions of the e4m3 MLA decode kernel (``mla_decode_e4m3.py``) timed side by side in one
process, on the same pages, tables and queries: each version is a copy of that module (say, from
another commit or branch), loaded beside the installed one as a module of ``tessera.kernels``
(so its relative imports resolve against the installed package), and put in place of the
default's e4m3 kernel for one ``bench_mla`` call per shape. Each call also times the widening
Gluon kernel and each side of the version alone (producer only, consumer only), and checks its
error against attention over its own dequantized pages.

    python bench/mla_versions.py --version NAME=FILE [--version NAME=FILE ...]
        [--shapes HEADSxBATCHxCONTEXT,...] [--bound N] [--out DIR] [--tag _x] [--commit SHA]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import fp8_kv_decode
from fp8_kv_decode import bench_mla
from tessera.kernels import paged_decode_split
from timing import copy_bandwidth, parse_results_args, write_results

SHAPES = "16x64x4096,16x32x8192,16x64x16384,16x128x8192,8x256x2048,16x32x4096"
KEPT = ("ours_bf16_us", "ours_fp8_e4m3_us", "err_ours_fp8_e4m3_vs_dequant", "ours_fp8_po_us",
        "ours_fp8_co_us", "ours_fp8_wgmma_us")  # fmt: skip


def load_version(name: str, path: Path):
    """The module at ``path`` as ``tessera.kernels._version_<name>``."""
    module_name = f"tessera.kernels._version_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Gluon's compiler looks the module up by name
    spec.loader.exec_module(module)
    kernel = module.mla_fp8_e4m3_kernel
    return kernel if "pieces" in kernel.arg_names else WholeSplits(kernel)


class WholeSplits:
    """A version from before the kernel cut its splits into pieces (``plan_pieces``), launched
    the way the current one is: the piece arguments dropped where there is one piece a split."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*, piece_len, pieces, **kwargs):
            if pieces != 1:
                raise ValueError(f"{pieces} pieces a split: this version runs whole splits only "
                                 "(a shape whose splits fit the token cap)")  # fmt: skip
            return self.kernel[grid](**kwargs)

        return launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="append", required=True, help="NAME=FILE")
    ap.add_argument("--shapes", default=SHAPES, help="HEADSxBATCHxCONTEXT, comma-separated")
    ap.add_argument("--bound", type=int, default=0,
                    help="the longest length the kernels are told of (0: each shape's context)")
    ap.add_argument("--tag", default="")
    args = parse_results_args(ap, "a Hopper GPU")
    fp8_kv_decode.BOUND = args.bound
    versions = {}
    for spec in args.version:
        name, _, path = spec.partition("=")
        versions[name] = load_version(name, Path(path))
    e4m3 = paged_decode_split.MLA_FP8_E4M3
    variants = {"e4m3": ("fp8", e4m3), "po": ("fp8", replace(e4m3, only=1)),
                "co": ("fp8", replace(e4m3, only=2)),
                "wgmma": ("fp8", paged_decode_split.MLA_FP8_WGMMA)}  # fmt: skip
    copy_bw = copy_bandwidth()
    rows = []
    for shape in args.shapes.split(","):
        heads, batch, ctx = map(int, shape.split("x"))
        row = {"heads": heads, "batch": batch, "ctx": ctx, "tokens": batch * ctx}
        for name, kernel in versions.items():
            paged_decode_split.mla_fp8_e4m3_kernel = kernel
            timed = bench_mla(batch, ctx, heads, 64, None, copy_bw, variants=variants)
            row |= {f"{name}:{key}": timed[key] for key in KEPT if key in timed}
        rows.append(row)
        print(f"{heads:3d} heads {batch:4d} x {ctx:6d}: "
              + "  ".join(f"{name} {row[f'{name}:ours_fp8_e4m3_us']:7.1f}us"
                          for name in versions)
              + f"  widening {row[f'{name}:ours_fp8_wgmma_us']:7.1f}us", flush=True)  # fmt: skip
    write_results(
        args.out, f"mla_versions{args.tag}.json", args.commit,
        "bench_mla (bench/fp8_kv_decode.py) once per version and shape in one process, each "
        "version's mla_fp8_e4m3_kernel in place of the default's; 'po' / 'co': the version's "
        "producer / consumer alone; page 64, CUDA-graph replay medians, us",
        rows, bound=args.bound,
        versions={spec.partition("=")[0]: spec.partition("=")[2] for spec in args.version},
    )  # fmt: skip


if __name__ == "__main__":
    main()
