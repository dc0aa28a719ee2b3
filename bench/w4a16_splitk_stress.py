"""Repeat every split-K W4A16 config many times on fresh inputs, to catch a reduction race.

A race in a split-K reduction can show up rarely (one wrong run in 128 in the v3 check of the
reduction inside the launch, since removed), so one pass of ``bench/w4a16_check.py`` cannot clear
one. This runs each split-K config the tuner may pick for the decode shapes ``--repeats`` times,
each on a fresh activation (weights fixed), and counts outputs whose rel-L2 against the fp32
reference exceeds 5e-3.

    python bench/w4a16_splitk_stress.py [--repeats 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from tessera.kernels.w4a16_format import dequantize, quantize_rtn
from tessera.kernels.w4a16_gemm import _candidates, _run

SHAPES = [(16384, 7168, 128), (4608, 7168, 32)]  # (N, K, group)
M_VALUES = (1, 4, 16)
TOLERANCE = 5e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for n, k, group in SHAPES:
        w = quantize_rtn(torch.randn(n, k, device="cuda"), group)
        dense = dequantize(w, torch.float32).T.contiguous()  # [K, N]
        for m in M_VALUES:
            for cfg in (c for c in _candidates(m, n, k) if c.split_k > 1):
                bad, worst = 0, 0.0
                for _ in range(a.repeats):
                    x = torch.randn(m, k, device="cuda").bfloat16()
                    out = _run(x, w, cfg).float()
                    ref = x.float() @ dense
                    rel = float((out - ref).norm() / ref.norm())
                    worst = max(worst, rel if rel == rel else float("inf"))
                    bad += not rel <= TOLERANCE
                rows.append({"n": n, "k": k, "group": group, "m": m, "config": asdict(cfg),
                             "runs": a.repeats, "bad": bad, "worst_rel_l2": worst})  # fmt: skip
                tile = f"{cfg.block_m}x{cfg.block_n} split {cfg.split_k} swap {cfg.swap}"
                print(f"N{n} K{k} g{group} M{m} {tile}: {bad}/{a.repeats} bad, worst {worst:.2e}",
                      flush=True)  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    total = sum(r["bad"] for r in rows)
    result = {"gpu": torch.cuda.get_device_name(), "tolerance": TOLERANCE, "bad_total": total,
              "runs_total": sum(r["runs"] for r in rows), "rows": rows}  # fmt: skip
    (a.out / "w4a16_splitk_stress.json").write_text(json.dumps(result, indent=1))
    print(f"split-K: {total} bad of {result['runs_total']} runs")


if __name__ == "__main__":
    main()
