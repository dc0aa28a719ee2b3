"""Programmatic dependent launch for the INT4 GEMM at one token: the decode slice's seven dense
linears a layer (Kimi K2 shapes, group 32), launched back to back in a CUDA graph as a decoding
step runs them, each GEMM's tile as the tuner picks it, with ``GemmConfig.pdl`` 0, 1 and 2
side by side in one run (four weight sets, 180 MB, cycled so the weights come from HBM).

    python bench/w4a16_pdl.py [--out DIR] [--commit SHA]

At one token a layer's dense linears take 41 us (docs/decode-slice.md), so the gaps between
their launches are part of what #20's +55% needs. Writes ``w4a16_pdl.json`` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import torch
import triton
from accuracy import rel_l2
from tessera.kernels.w4a16_gemm import _TUNED, w4a16_matmul
from timing import graph_time_us
from w4a16_bench import SLICE_LINEARS, random_int4

SETS = 4
GROUP = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--commit", default="", help="the tree's commit, recorded in the results")
    args = ap.parse_args()
    torch.manual_seed(0)
    ws = [[random_int4((n, k), GROUP) for n, k in SLICE_LINEARS] for _ in range(SETS)]
    xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k in SLICE_LINEARS]
    for x, w in zip(xs, ws[0], strict=True):  # tune each shape once, outside the timing
        w4a16_matmul(x, w)
    # the tuner's pick for each shape at one token (key: "gemm", M bucket, N, K, ...)
    configs = {key[2:4]: cfg for key, cfg in _TUNED.items() if key[:2] == ("gemm", 1)}
    rows = []
    outs = {}
    for pdl in (0, 1, 2):
        cfgs = [dataclasses.replace(configs[shape], pdl=pdl) for shape in SLICE_LINEARS]

        def layer(i, cfgs=cfgs):
            return [w4a16_matmul(x, w, c) for x, w, c in zip(xs, ws[i], cfgs, strict=True)]

        outs[pdl] = [o.clone() for o in layer(0)]
        us = graph_time_us(layer, SETS)
        rows.append({"pdl": pdl, "layer_us": us, "per_gemm_us": us / len(SLICE_LINEARS),
                     "configs": [dataclasses.asdict(c) for c in cfgs]})  # fmt: skip
        print(f"pdl {pdl}: {us:7.2f} us for the {len(SLICE_LINEARS)} linears "
              f"({us / len(SLICE_LINEARS):.2f} us each)", flush=True)
    worst = max(rel_l2(a, b) for p in (1, 2) for a, b in zip(outs[0], outs[p], strict=True))
    print(f"largest rel-L2 of a PDL output against pdl 0: {worst:.1e}; "
          f"pdl 1 {rows[0]['layer_us'] / rows[1]['layer_us']:.3f}x, "
          f"pdl 2 {rows[0]['layer_us'] / rows[2]['layer_us']:.3f}x the speed of pdl 0")
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "commit": args.commit or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shapes_nk": SLICE_LINEARS, "group": GROUP, "sets": SETS, "max_rel_l2_vs_pdl0": worst,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "w4a16_pdl.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
