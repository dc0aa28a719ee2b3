"""Programmatic dependent launch for the INT4 kernels at one token: the decode slice's seven dense
linears a layer (Kimi K2 shapes, group 32), launched back to back in a CUDA graph as a decoding
step runs them, each GEMM's tile as the tuner picks it, with ``GemmConfig.pdl`` 0, 1 and 2
side by side in one run (four weight sets, 180 MB, cycled so the weights come from HBM); then
the layer's routed experts on one EP-8 GPU at one request (48 of 384 experts, one (token,
expert) pair, a different expert each set) alone and after the linears, ``MoeConfig.pdl`` 0
and 1 (with the linears' ``pdl`` the same).

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
from tessera.kernels.w4a16_moe import fused_moe
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
    moe_rows, moe_worst = moe_modes(xs, ws, configs)
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "commit": args.commit or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shapes_nk": SLICE_LINEARS, "group": GROUP, "sets": SETS, "max_rel_l2_vs_pdl0": worst,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    meta |= {"moe": {"experts": MOE_EXPERTS, "hidden": MOE_HIDDEN, "width": MOE_WIDTH,
                     "pairs": 1, "max_rel_l2_vs_pdl0": moe_worst}}  # fmt: skip
    (args.out / "w4a16_pdl.json").write_text(
        json.dumps({**meta, "rows": rows, "moe_rows": moe_rows}, indent=1)
    )


MOE_EXPERTS, MOE_HIDDEN, MOE_WIDTH = 48, 7168, 2048  # one EP-8 GPU's Kimi K2 experts


def moe_modes(xs, ws, configs) -> tuple[list[dict], float]:
    """The routed experts at one pair, alone and after the seven linears, pdl 0 and 1."""
    w13 = random_int4((MOE_EXPERTS, 2 * MOE_WIDTH, MOE_HIDDEN), GROUP)
    w2 = random_int4((MOE_EXPERTS, MOE_HIDDEN, MOE_WIDTH), GROUP)
    x = torch.randn(1, MOE_HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids = [torch.tensor([[e]], device="cuda") for e in (3, 17, 29, 41)][:SETS]
    weights = torch.ones(1, 1, device="cuda")
    fused_moe(x, w13, w2, weights, ids[0])  # tunes both GEMMs at one pair, outside the timing
    moe_cfgs = next(v for k, v in _TUNED.items() if k[0] == "moe_up_given_down")
    rows, outs = [], {}
    for pdl in (0, 1):
        cfgs = tuple(dataclasses.replace(c, pdl=pdl) for c in moe_cfgs)
        dense = [dataclasses.replace(configs[shape], pdl=pdl) for shape in SLICE_LINEARS]

        def moe(i, cfgs=cfgs):
            return fused_moe(x, w13, w2, weights, ids[i], cfgs)

        def layer(i, cfgs=cfgs, dense=dense):
            linears = [w4a16_matmul(xi, w, c) for xi, w, c in zip(xs, ws[i], dense, strict=True)]
            return [*linears, moe(i)]

        outs[pdl] = moe(0).clone()
        row = {"pdl": pdl, "moe_us": graph_time_us(moe, SETS),
               "linears_and_moe_us": graph_time_us(layer, SETS),
               "configs": [dataclasses.asdict(c) for c in cfgs]}  # fmt: skip
        rows.append(row)
        print(f"moe pdl {pdl}: {row['moe_us']:7.2f} us alone, {row['linears_and_moe_us']:7.2f} us "
              "after the 7 linears", flush=True)
    worst = rel_l2(outs[1], outs[0])
    print(f"moe: rel-L2 pdl 1 vs 0 {worst:.1e}; pdl 1 {rows[0]['moe_us'] / rows[1]['moe_us']:.3f}x "
          f"alone, {rows[0]['linears_and_moe_us'] / rows[1]['linears_and_moe_us']:.3f}x with the "
          "linears, the speed of pdl 0")
    return rows, worst


if __name__ == "__main__":
    main()
