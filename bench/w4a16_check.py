"""GPU correctness of the W4A16 kernels at real shapes, and a parallel warm-up of their compiles.

Checks every tile the tuner may pick for the benchmark shapes, and both weight decodes (the packed
bf16x2 PTX one and the plain-Triton one the CPU interpreter runs) against the fp32 reference on
the dequantized weights (rel-L2 <= 5e-3, BENCHMARKS.md) and against each other (the two decodes
produce the same bf16 weights, so the outputs should agree bit for bit). Also GEMMs with zero
points, groups 32 and 64, and odd sizes (masked tails), and the fused MoE with INT4 and bf16
experts. Fresh random data, outputs poisoned with NaN first where the kernel allocates them.

Before checking, worker processes compile every kernel variant the checks and
``bench/w4a16_bench.py`` will use, in parallel, into Triton's on-disk cache.

    python bench/w4a16_check.py [--workers 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accuracy import rel_l2
from tessera.kernels.w4a16_format import W4A16Weight, dequantize, quantize_rtn
from tessera.kernels.w4a16_gemm import (
    GemmConfig,
    _candidates,
    _run,
    w4a16_matmul_reference,
)
from tessera.kernels.w4a16_moe import MoeConfig, fused_moe, fused_moe_reference
from tessera.kernels.w4a16_moe import _candidates as moe_candidates

REL_L2 = 5e-3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BENCH_GEMM = [(16384, 7168, 128), (7168, 7168, 128)]  # bench --quick GEMM shapes
BENCH_M = (1, 4, 16, 64)
# (N, K, group, symmetric, M values): zero points, small groups, odd (masked) sizes
EXTRA_GEMM = [
    (7168, 7168, 128, False, (1, 16)),
    (7168, 2048, 32, True, (1, 16, 64)),
    (4096, 7168, 64, False, (4,)),
    (200, 384, 32, False, (3,)),
    (72, 160, 32, True, (17,)),
]
MOE = (384, 7168, 2048, 8, 32)  # experts, hidden, expert width, top-k, group (bench --quick)
MOE_TOKENS = (1, 16, 64)


def weight(n: int, k: int, group: int, symmetric: bool, lead: tuple = ()) -> W4A16Weight:
    return quantize_rtn(torch.randn(*lead, n, k, device=DEVICE) / 8, group, symmetric)


def gemm_configs() -> list[tuple]:
    """(n, k, group, symmetric, m, config) for every GEMM launch the checks and the bench make."""
    jobs = []
    for n, k, group in BENCH_GEMM:
        for m in BENCH_M:
            jobs += [(n, k, group, True, m, c) for c in _candidates(m, n, k)]
    for n, k, group, sym, ms in EXTRA_GEMM:
        for m in ms:  # the first candidate (weights first) and the last (the other orientation)
            cands = _candidates(m, n, k)
            jobs += [(n, k, group, sym, m, c) for c in (cands[0], cands[-1])]
    # the plain-Triton decode and the PTX decode of the same unsplit tile (split-K would add
    # the splits in any order): group 128 with zero points, and group 32
    for n, k, group, sym, m, bm, bn, swap in (
        (16384, 7168, 128, False, 1, 16, 256, False),
        (7168, 2048, 32, True, 16, 16, 128, False),
        (16384, 7168, 128, False, 1, 8, 256, True),
        (7168, 2048, 32, True, 16, 8, 128, True),
    ):
        if BENCH_GEMM[0][0] < 1000:  # --smoke
            n, k = 64, 256
        for fast in (False, True):
            cfg = GemmConfig(block_m=bm, block_n=bn, fast_decode=fast, swap=swap)
            jobs.append((n, k, group, sym, m, cfg))
    return jobs


def moe_configs() -> list[tuple]:
    experts, _, _, top_k, _ = MOE
    cands = {c for t in MOE_TOKENS for c in moe_candidates(t * top_k, experts)}
    cands = sorted(cands, key=str)
    jobs = [(True, c) for c in cands] + [(False, c) for c in cands]
    plain = [MoeConfig(block_n=128, fast_decode=False),
             MoeConfig(8, 128, fast_decode=False, swap=True)]  # fmt: skip
    return [*jobs, *((True, c) for c in plain)]


def _compile_job(job: tuple) -> str:
    """Run one launch at its real shape (small expert count for the MoE) to compile it."""
    torch.manual_seed(0)
    t0 = time.time()
    if job[0] == "gemm":
        _, n, k, group, sym, m, cfg = job
        w = weight(n, k, group, sym)
        _run(torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16), w, cfg)
    else:
        _, int4, cfg, (_, hidden, inter, top_k, group) = job
        x, w13, w2, wts, ids = moe_inputs(top_k, hidden, inter, top_k, group, 4, int4)
        fused_moe(x, w13, w2, wts, ids, configs=(cfg, cfg))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return f"{job[0]} {job[1:]}: {time.time() - t0:.1f}s"


def routed_tokens(experts, hidden, top_k, tokens):
    """Random activations ``[tokens, hidden]``, routing weights and distinct expert ids."""
    ids = torch.stack([torch.randperm(experts, device=DEVICE)[:top_k] for _ in range(tokens)])
    wts = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    return x, wts, ids


def moe_inputs(experts, hidden, inter, top_k, group, tokens, int4=True):
    if int4:
        w13 = weight(2 * inter, hidden, group, True, (experts,))
        w2 = weight(hidden, inter, group, True, (experts,))
    else:
        w13 = torch.randn(experts, hidden, 2 * inter, device=DEVICE, dtype=torch.bfloat16) / 64
        w2 = torch.randn(experts, inter, hidden, device=DEVICE, dtype=torch.bfloat16) / 64
    x, wts, ids = routed_tokens(experts, hidden, top_k, tokens)
    return x, w13, w2, wts, ids


def warm_up(workers: int) -> None:
    jobs, seen = [], set()
    for n, k, group, sym, m, cfg in gemm_configs():
        key = (group, sym, n % cfg.block_n == 0, k % cfg.block_k == 0, cfg)  # what is compiled
        if key not in seen:
            seen.add(key)
            jobs.append(("gemm", n, k, group, sym, m, cfg))
    jobs += [("moe", *j, MOE) for j in moe_configs()]
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for line in pool.map(_compile_job, jobs):
            print("compiled", line, flush=True)
    print(f"warm-up: {len(jobs)} launches compiled in {time.time() - t0:.1f}s", flush=True)


def check_gemm() -> list[dict]:
    rows = []
    by_shape: dict[tuple, list] = {}
    for n, k, group, sym, m, cfg in gemm_configs():
        by_shape.setdefault((n, k, group, sym), []).append((m, cfg))
    for (n, k, group, sym), runs in by_shape.items():
        w = weight(n, k, group, sym)
        for m in sorted({m for m, _ in runs}):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = w4a16_matmul_reference(x, w)
            outs = {}
            for mm, cfg in runs:
                if mm != m:
                    continue
                out = _run(x, w, cfg)
                outs[cfg] = out
                err = rel_l2(out, ref)
                ok = bool(torch.isfinite(out).all()) and err <= REL_L2
                rows.append({"kind": "gemm", "N": n, "K": k, "group": group, "symmetric": sym,
                             "M": m, "config": asdict(cfg), "rel_l2": err, "ok": ok})  # fmt: skip
                print(f"gemm N={n} K={k} g{group} sym={sym} M={m} {cfg}: rel-L2 {err:.2e} "
                      f"{'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
            plain = [c for c in outs if not c.fast_decode]
            for p in plain:
                twin = GemmConfig(**{**asdict(p), "fast_decode": True})
                out_fast = outs[twin] if twin in outs else _run(x, w, twin)
                diff = (outs[p].float() - out_fast.float()).abs().max().item()
                rows.append({"kind": "gemm fast vs plain decode", "N": n, "K": k, "M": m,
                             "group": group, "config": asdict(twin), "max_abs_diff": diff,
                             "ok": diff == 0.0})  # fmt: skip
                print(f"gemm N={n} K={k} g{group} M={m} PTX vs plain decode: max |diff| {diff}",
                      flush=True)  # fmt: skip
    return rows


def check_moe() -> list[dict]:
    rows = []
    experts, hidden, inter, top_k, group = MOE
    w13 = weight(2 * inter, hidden, group, True, (32,))
    w2 = weight(hidden, inter, group, True, (32,))
    b13 = dequantize(w13, torch.bfloat16).transpose(-1, -2).contiguous()
    b2 = dequantize(w2, torch.bfloat16).transpose(-1, -2).contiguous()
    for tokens in MOE_TOKENS:
        x, wts, ids = routed_tokens(32, hidden, top_k, tokens)
        ref = fused_moe_reference(x, w13, w2, wts, ids)
        ref16 = fused_moe_reference(x, b13, b2, wts, ids)
        for int4, cfg in moe_configs():
            if cfg not in moe_candidates(tokens * top_k, experts):
                continue
            out = fused_moe(x, *((w13, w2) if int4 else (b13, b2)), wts, ids, configs=(cfg, cfg))
            err = rel_l2(out, ref if int4 else ref16)
            ok = bool(torch.isfinite(out).all()) and err <= REL_L2
            rows.append({"kind": "moe", "int4": int4, "tokens": tokens, "config": asdict(cfg),
                         "rel_l2": err, "ok": ok})  # fmt: skip
            print(f"moe {'int4' if int4 else 'bf16'} T={tokens} {cfg}: rel-L2 {err:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
        for plain in (MoeConfig(block_n=128, fast_decode=False),
                      MoeConfig(8, 128, fast_decode=False, swap=True)):  # fmt: skip
            fast = MoeConfig(**{**asdict(plain), "fast_decode": True})
            a = fused_moe(x, w13, w2, wts, ids, configs=(plain, plain))
            b = fused_moe(x, w13, w2, wts, ids, configs=(fast, fast))
            diff = (a.float() - b.float()).abs().max().item()
            rows.append({"kind": "moe fast vs plain decode", "tokens": tokens,
                         "config": asdict(fast), "max_abs_diff": diff,
                         "ok": diff == 0.0})  # fmt: skip
            print(f"moe T={tokens} {fast} PTX vs plain decode: max |diff| {diff}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--warm-up-only", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        global BENCH_GEMM, BENCH_M, EXTRA_GEMM, MOE, MOE_TOKENS
        BENCH_GEMM, BENCH_M = [(64, 256, 128)], (1, 17)
        EXTRA_GEMM = [(40, 256, 32, False, (3,)), (72, 160, 32, True, (2,))]
        MOE, MOE_TOKENS = (6, 256, 64, 2, 32), (1, 3)
    if not args.no_warm_up:
        warm_up(args.workers)
    if args.warm_up_only:
        return
    torch.manual_seed(1)
    rows = check_gemm() + check_moe()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    doc = {"device": device, "torch": torch.__version__,
           "command": " ".join(["python", *sys.argv]), "rows": rows}  # fmt: skip
    (args.out / "w4a16_check.json").write_text(json.dumps(doc, indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"\n== check: {len(rows) - len(bad)} of {len(rows)} ok ==")
    for r in bad:
        print("FAIL", r)


if __name__ == "__main__":
    main()
