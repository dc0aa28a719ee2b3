"""Repeat every split-K W4A16 launch many times on fresh inputs, to catch a reduction race.

The dense GEMM's K splits (counted, or added into a zeroed output; the Triton tiles and, on
Hopper, the Gluon kernel's) and the MoE's K splits,
CUDA-core path and top-k sum: counted splits meet inside the launch, where each program adds its
fp32 part and counts it, and the program that adds an element's last part stores it and resets
the workspace (``w4a16_gemm._add_counted``). A race can show up rarely (one wrong run in 128 in
the v3 check of an earlier in-launch design), so one pass of ``bench/w4a16_check.py`` cannot
clear one. This runs every such config the tuners may pick for the decode shapes
``--repeats`` times, each on a fresh activation (the MoE: and a fresh routing), and counts
outputs whose rel-L2 against the fp32 reference exceeds 5e-3.

``--only streams`` runs the pattern of SGLang's CUDA-graph decode instead: a Kimi K2 EP-8 GPU's
routed experts on one stream and its share of the shared expert (two dense GEMMs) on a second,
forked and joined as SGLang does, in a captured graph, every launch a counted split. With
``--one-workspace`` both streams take the first stream's workspace, as every stream did before
the workspace was made per stream: what that cost.

    python bench/w4a16_splitk_stress.py [--repeats 100] [--only dense|moe|wgmma|streams]
        [--one-workspace] [--out DIR] [--tag _counted]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from tessera.kernels import w4a16_gemm, w4a16_moe
from tessera.kernels.w4a16_format import W4A16Weight, dequantize, quantize_rtn
from tessera.kernels.w4a16_gemm import _candidates, _run, _wgmma_tiles, capture_graph
from tessera.kernels.w4a16_moe import _candidates as moe_candidates
from tessera.kernels.w4a16_moe import fused_moe, fused_moe_reference

SHAPES = [(16384, 7168, 128), (4608, 7168, 32)]  # (N, K, group)
M_VALUES = (1, 4, 16, 64)
# (experts, hidden, expert width, top_k, tokens): all of Kimi K2's experts, one EP-8 GPU's share
MOE_CASES = [(384, 7168, 2048, 8, 1), (384, 7168, 2048, 8, 4), (48, 7168, 2048, 1, 1),
             (48, 7168, 2048, 1, 16)]  # fmt: skip
TOLERANCE = 5e-3


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    rel = float((out.float() - ref).norm() / ref.norm())
    return rel if rel == rel else float("inf")


def tally(rows: list, label: str, runs: int, errors: list[float], **fields) -> None:
    bad = sum(not e <= TOLERANCE for e in errors)
    rows.append({**fields, "runs": runs, "bad": bad, "worst_rel_l2": max(errors)})
    print(f"{label}: {bad}/{runs} bad, worst {max(errors):.2e}", flush=True)


def dense_rows(repeats: int, gluon_only: bool = False, ms: tuple = M_VALUES) -> list[dict]:
    rows = []
    for n, k, group in SHAPES:
        w = quantize_rtn(torch.randn(n, k, device="cuda"), group)
        dense = dequantize(w, torch.float32).T.contiguous()  # [K, N]
        for m in ms:
            probe = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            tiles = ([] if gluon_only else _candidates(m, n, k)) + _wgmma_tiles(probe, w)
            for cfg in (c for c in tiles if c.split_k > 1):
                errors = []
                for _ in range(repeats):
                    x = torch.randn(m, k, device="cuda").bfloat16()
                    errors.append(rel_l2(_run(x, w, cfg), x.float() @ dense))
                tile = (f"{cfg.path} {cfg.block_m}x{cfg.block_n} s{cfg.num_stages} split "
                        f"{cfg.split_k}" + (" counted" if cfg.counted else ""))
                tally(rows, f"N{n} K{k} g{group} M{m} {tile}", repeats, errors,
                      n=n, k=k, group=group, m=m, config=asdict(cfg))  # fmt: skip
    return rows


def random_experts(experts: int, n: int, k: int, group: int) -> W4A16Weight:
    """Random INT4 experts ``[E, K / 8, N]`` scaled like a trained layer's (std 1 / sqrt(K), so
    the activations stay near 1: the CUDA-core path multiplies in fp16), built a few at a time
    (the fp32 staging is large)."""
    parts = [quantize_rtn(torch.randn(min(8, experts - e), n, k, device="cuda") / k**0.5, group)
             for e in range(0, experts, 8)]  # fmt: skip
    return W4A16Weight(torch.cat([p.qweight for p in parts]),
                       torch.cat([p.scales for p in parts]), None, group)  # fmt: skip


def routed_case(w13: W4A16Weight, w2: W4A16Weight, tokens: int, top_k: int) -> tuple:
    """A fresh activation and random routing over the experts of ``w13`` and ``w2``, and the
    MoE's fp32 reference (on the used experts only: all of them dequantized would not fit)."""
    experts, hidden = w13.qweight.shape[0], w13.k
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device="cuda").softmax(-1)
    used = ids.unique()
    ref = fused_moe_reference(
        x, W4A16Weight(w13.qweight[used], w13.scales[used], None, 32),
        W4A16Weight(w2.qweight[used], w2.scales[used], None, 32), weights,
        torch.searchsorted(used, ids),
    )  # fmt: skip
    return x, weights, ids, ref


def moe_rows(repeats: int) -> list[dict]:
    rows = []
    for experts, hidden, inter, top_k, tokens in MOE_CASES:
        w13 = random_experts(experts, 2 * inter, hidden, 32)
        w2 = random_experts(experts, hidden, inter, 32)
        pairs = tokens * top_k
        configs = dict.fromkeys(
            c for n in (2 * inter, hidden) for c in moe_candidates(pairs, experts, n)
            if c.split_k > 1 or c.path == "gemv"
        )  # fmt: skip
        for cfg in configs:
            errors = []
            for _ in range(repeats):
                x, weights, ids, ref = routed_case(w13, w2, tokens, top_k)
                errors.append(rel_l2(fused_moe(x, w13, w2, weights, ids, configs=(cfg, cfg)),
                                     ref))  # fmt: skip
            tile = f"{cfg.path} {cfg.block_m}x{cfg.block_n} split {cfg.split_k}"
            tally(rows, f"MoE {experts}x{hidden}x{inter} top{top_k} T{tokens} {tile}", repeats,
                  errors, experts=experts, hidden=hidden, inter=inter, top_k=top_k,
                  tokens=tokens, config=asdict(cfg))  # fmt: skip
    return rows


def stream_rows(repeats: int, one_workspace: bool) -> list[dict]:
    """The routed experts (48 local of 384, top 8, one token: 8 pairs) on one stream and the
    shared expert's up (512 x 7168) and down (7168 x 256) GEMMs on a second, forked and joined
    as SGLang does, captured in a CUDA graph as SGLang's decode runs them (replays run both
    branches at once; host-issued launches rarely overlap) and replayed ``repeats`` times on 8
    cycled input sets copied into the graph's inputs; every output is checked against its
    reference."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    if one_workspace:  # both streams look their buffer up as the first stream
        original = w4a16_gemm.counted_workspace

        def first_streams(device: torch.device, sums: int, counts: int) -> tuple:
            with torch.cuda.stream(main):
                return original(device, sums, counts)

        w4a16_gemm.counted_workspace = w4a16_moe.counted_workspace = first_streams
    experts, hidden, inter, top_k, shared = 48, 7168, 2048, 8, 256
    w13 = random_experts(experts, 2 * inter, hidden, 32)
    w2 = random_experts(experts, hidden, inter, 32)
    up = quantize_rtn(torch.randn(2 * shared, hidden, device="cuda") / hidden**0.5, 32)
    down = quantize_rtn(torch.randn(hidden, shared, device="cuda") / shared**0.5, 32)

    def counted_split(configs: list) -> object:
        return next(c for c in configs if c.split_k > 1 and getattr(c, "counted", True))

    moe_cfg = counted_split(moe_candidates(top_k, experts, 2 * inter))
    up_cfg, down_cfg = (counted_split(_candidates(1, w.n, w.k)) for w in (up, down))
    up_ref, down_ref = (dequantize(w, torch.float32).T for w in (up, down))
    sets = []
    for _ in range(8):
        x, weights, ids, moe_ref = routed_case(w13, w2, 1, top_k)
        h = torch.randn(1, shared, device="cuda").bfloat16()  # the down GEMM's input
        sets.append(((x, weights, ids, h), (moe_ref, x.float() @ up_ref, h.float() @ down_ref)))
    inputs = [t.clone() for t in sets[0][0]]
    outs: dict[str, torch.Tensor] = {}

    def step() -> None:
        x, weights, ids, h = inputs
        branch = torch.cuda.current_stream()
        side.wait_stream(branch)
        outs["routed"] = fused_moe(x, w13, w2, weights, ids, configs=(moe_cfg, moe_cfg))
        with torch.cuda.stream(side):
            outs["shared_up"], outs["shared_down"] = _run(x, up, up_cfg), _run(h, down, down_cfg)
        branch.wait_stream(side)

    graph = capture_graph(step)
    errors: dict[str, list[float]] = {"routed": [], "shared_up": [], "shared_down": []}
    for i in range(repeats):
        fresh, refs = sets[i % len(sets)]
        for dst, src in zip(inputs, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        for (name, errs), ref in zip(errors.items(), refs, strict=True):
            errs.append(rel_l2(outs[name], ref))
    rows = []
    label = "one workspace" if one_workspace else "a workspace per stream"
    for (name, errs), cfg in zip(errors.items(), (moe_cfg, up_cfg, down_cfg), strict=True):
        tally(rows, f"two streams in a graph, {label}: {name}", repeats, errs, output=name,
              one_workspace=one_workspace, graph=True, config=asdict(cfg))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--m", help="the dense GEMM's token counts, comma-separated")
    ap.add_argument("--only", choices=["dense", "moe", "wgmma", "streams"],
                    help="run one half, the dense GEMM's Gluon tiles alone, or two streams")
    ap.add_argument("--one-workspace", action="store_true",
                    help="with --only streams: both streams share one workspace")
    a = ap.parse_args()
    torch.manual_seed(0)
    ms = tuple(int(v) for v in a.m.split(",")) if a.m else M_VALUES
    if a.only == "streams":
        rows = stream_rows(a.repeats, a.one_workspace)
    else:
        rows = (dense_rows(a.repeats, a.only == "wgmma", ms) if a.only != "moe" else []) + (
            moe_rows(a.repeats) if a.only is None or a.only == "moe" else []
        )
    a.out.mkdir(parents=True, exist_ok=True)
    total = sum(r["bad"] for r in rows)
    result = {"gpu": torch.cuda.get_device_name(), "tolerance": TOLERANCE, "bad_total": total,
              "runs_total": sum(r["runs"] for r in rows), "rows": rows}  # fmt: skip
    (a.out / f"w4a16_splitk_stress{a.tag}.json").write_text(json.dumps(result, indent=1))
    print(f"counted reductions: {total} bad of {result['runs_total']} runs")


if __name__ == "__main__":
    main()
