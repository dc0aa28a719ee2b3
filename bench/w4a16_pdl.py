"""Programmatic dependent launch for the INT4 kernels at one token: the decode slice's seven dense
linears a layer (Kimi K2 shapes, group 32), launched back to back in a CUDA graph as a decoding
step runs them, side by side in one run (four weight sets, 180 MB, cycled so the weights come
from HBM): each GEMM's tile as the tuner picks it, and the fastest CUDA-core GEMV tile of each
(timed here), with ``GemmConfig.pdl`` 0 and 1, and 1 with the GEMV's first weights requested
before the wait (``early_weights``). Then the layer's routed experts on one EP-8 GPU (48 of 384
experts) at 1 to 4 (token, expert) pairs, as the GPU with the most experts gets them at one
request, alone and after the linears: the down GEMM's first weights before its wait or after,
and the up GEMM letting the down GEMM launch at its start (``pdl`` 2) or not.

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
from tessera.kernels import w4a16_gemm as gemm_module
from tessera.kernels.w4a16_gemm import _TUNED, GemmConfig, w4a16_matmul
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
    gemv = {shape: fastest_gemv(xs[i], ws, i) for i, shape in enumerate(SLICE_LINEARS)}
    rows, outs = [], {}
    for tiles, picked in (("tuned", configs), ("gemv", gemv)):
        for pdl, early in ((0, False), (1, False), (1, True)):
            cfgs = [dataclasses.replace(picked[shape], pdl=pdl, early_weights=early)
                    for shape in SLICE_LINEARS]  # fmt: skip

            def layer(i, cfgs=cfgs):
                return [w4a16_matmul(x, w, c) for x, w, c in zip(xs, ws[i], cfgs, strict=True)]

            outs[tiles, pdl, early] = [o.clone() for o in layer(0)]
            us = graph_time_us(layer, SETS)
            rows.append({"tiles": tiles, "pdl": pdl, "early_weights": early, "layer_us": us,
                         "per_gemm_us": us / len(SLICE_LINEARS),
                         "configs": [dataclasses.asdict(c) for c in cfgs]})  # fmt: skip
            print(f"{tiles:5s} pdl {pdl} early {early:d}: {us:7.2f} us for the "
                  f"{len(SLICE_LINEARS)} linears ({us / len(SLICE_LINEARS):.2f} us each)",
                  flush=True)  # fmt: skip
    worst = max(rel_l2(a, b) for key, out in outs.items() if key[1]
                for a, b in zip(outs[key[0], 0, False], out, strict=True))  # fmt: skip
    print(f"largest rel-L2 of a PDL output against pdl 0: {worst:.1e}")
    moe_rows, moe_worst = moe_modes(xs, ws, configs)
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "commit": args.commit or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shapes_nk": SLICE_LINEARS, "group": GROUP, "sets": SETS, "max_rel_l2_vs_pdl0": worst,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    meta |= {"moe": {"experts": MOE_EXPERTS, "hidden": MOE_HIDDEN, "width": MOE_WIDTH,
                     "pairs": MOE_PAIRS, "max_rel_l2_vs_first_mode": moe_worst}}  # fmt: skip
    (args.out / "w4a16_pdl.json").write_text(
        json.dumps({**meta, "rows": rows, "moe_rows": moe_rows}, indent=1)
    )


def fastest_gemv(x, ws, i) -> GemmConfig:
    """The fastest CUDA-core GEMV candidate for ``ws[*][i]`` at one token (first weights before
    the wait), timed like the tuner times (``gemm_module._graph_time``)."""
    cands = [c for c in gemm_module._candidates(1, ws[0][i].n, ws[0][i].k) if c.path == "gemv"]
    times = {c: gemm_module._graph_time(lambda c=c: w4a16_matmul(x, ws[0][i], c)) for c in cands}
    return min(times, key=times.__getitem__)


MOE_EXPERTS, MOE_HIDDEN, MOE_WIDTH = 48, 7168, 2048  # one EP-8 GPU's Kimi K2 experts
MOE_PAIRS = (1, 2, 3, 4)
MOE_MODES = ((1, False), (1, True), (2, True))  # (the up GEMM's pdl, the down's early_weights)


def moe_modes(xs, ws, configs) -> tuple[list[dict], float]:
    """The routed experts at 1 to 4 pairs (distinct experts, top 1 after dispatch), alone and
    after the seven linears (their tuned tiles, pdl 1), in each of ``MOE_MODES``."""
    w13 = random_int4((MOE_EXPERTS, 2 * MOE_WIDTH, MOE_HIDDEN), GROUP)
    w2 = random_int4((MOE_EXPERTS, MOE_HIDDEN, MOE_WIDTH), GROUP)
    dense = [dataclasses.replace(configs[shape], pdl=1) for shape in SLICE_LINEARS]
    order = torch.randperm(MOE_EXPERTS, generator=torch.Generator().manual_seed(1)).tolist()
    rows, worst = [], 0.0
    for pairs in MOE_PAIRS:
        x = torch.randn(pairs, MOE_HIDDEN, device="cuda", dtype=torch.bfloat16)
        # a different set of experts each weight set, so the experts come from HBM
        ids = [torch.tensor(order[i * pairs:(i + 1) * pairs], device="cuda")[:, None]
               for i in range(SETS)]  # fmt: skip
        weights = torch.ones(pairs, 1, device="cuda")
        fused_moe(x, w13, w2, weights, ids[0])  # tunes both GEMMs at this pair count
        up, down = next(v for k, v in _TUNED.items() if k[0] == "moe_down" and k[1] == pairs)
        outs = {}
        for up_pdl, early in MOE_MODES:
            cfgs = (dataclasses.replace(up, pdl=up_pdl),
                    dataclasses.replace(down, early_weights=early))  # fmt: skip

            def moe(i, cfgs=cfgs, x=x, ids=ids, weights=weights):
                return fused_moe(x, w13, w2, weights, ids[i], cfgs)

            def layer(i, moe=moe):
                linears = [w4a16_matmul(xi, w, c)
                           for xi, w, c in zip(xs, ws[i], dense, strict=True)]  # fmt: skip
                return [*linears, moe(i)]

            outs[up_pdl, early] = moe(0).clone()
            row = {"pairs": pairs, "up_pdl": up_pdl, "down_early_weights": early,
                   "moe_us": graph_time_us(moe, SETS),
                   "linears_and_moe_us": graph_time_us(layer, SETS),
                   "configs": [dataclasses.asdict(c) for c in cfgs]}  # fmt: skip
            rows.append(row)
            print(f"moe {pairs} pairs, up pdl {up_pdl}, down early {early:d} ({down.path}): "
                  f"{row['moe_us']:7.2f} us alone, {row['linears_and_moe_us']:7.2f} us after the "
                  "7 linears", flush=True)
        worst = max(worst, *(rel_l2(out, outs[MOE_MODES[0]]) for out in outs.values()))
    print(f"moe: largest rel-L2 of a mode against the first: {worst:.1e}")
    return rows, worst


if __name__ == "__main__":
    main()
