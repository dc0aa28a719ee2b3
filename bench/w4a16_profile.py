"""Launch chosen W4A16 kernels once each between profiler start and stop, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section WarpStateStats \\
        python bench/w4a16_profile.py [--slice]

Profiles the GEMM at M = 1, 16384 x 7168, group 128, on both paths the v5 tuner chose between
(the weights-first 8 x 256 tensor-core tile with 4 K splits, and the CUDA-core GEMV with 128
columns and 8 K splits), and the MoE up GEMM at one token (Kimi-like experts, group 32).
With ``--slice``: the decode slice's INT4 linears at one token (Kimi K2's, group 32), each as
the tuner runs it (every launch of the call), with each call's CUDA-graph
time printed. With ``--groups``: Kimi K2's MoE up GEMM (384 experts, 7168 -> 2 x 2048, SiLU
epilogue) at 4 rows an expert on one tile, with group 32 and with group 128 experts: the same
launches and codes (group 32 carries 9% more bytes in its scales), so the two profiles differ
by the group-32 decode. With ``--marlin DIR`` (``sglang_jit_build.py``'s modules): Kimi K2's
routed experts (384, top 8, group 32; ``--moe-shape TEXT``: the first of w4a16_bench's MoE
shapes whose name holds TEXT), the whole forward by ours (``fused_moe`` as tuned) and by
SGLang's Marlin MoE on the same weights repacked, at 1 token and 2 and 4 rows an expert
(``--rows 16``: other sizes): each forward's CUDA-graph time printed, then every launch of both
profiled. With ``--wgmma DIR``: 64 tokens on 16384 x 7168
(group 128) and 4608 x 7168 (group 32), the Gluon warpgroup-MMA kernel's fastest tile and
Marlin's GEMM on the same weights repacked, each call's CUDA-graph time printed.
Compilation, tuning and a warm-up run happen before the profiler starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tessera.kernels.w4a16_gemm import (
    _TUNED,
    GemmConfig,
    _m_bucket,
    w4a16_matmul,
)
from tessera.kernels.w4a16_moe import MoeConfig, align_to_experts, fused_moe, moe_gemm
from timing import graph_time_us
from w4a16_bench import MOE_SHAPES, SLICE_LINEARS, random_int4, routings, tokens_for_rows


def profile_once(calls) -> None:
    """Each call once between the profiler's start and stop (compiled and tuned before)."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile_slice_linears() -> None:
    calls = []
    for n, k in SLICE_LINEARS:
        ws = [random_int4((n, k), 32) for _ in range(8)]  # 8 copies: past the L2 together
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t = graph_time_us(lambda i, x=x, ws=ws: w4a16_matmul(x, ws[i]), len(ws))
        cfg = next(v for key, v in _TUNED.items() if key[:4] == ("gemm", _m_bucket(1), n, k))
        print(f"N {n:5d} K {k:5d}: {t:6.1f} us a call (graph), {n * k / 2 / t / 1e6:.2f} TB/s "
              f"of codes, tuned {cfg}", flush=True)  # fmt: skip
        calls.append(lambda x=x, w=ws[0]: w4a16_matmul(x, w))
    profile_once(calls)


def profile_group_sizes() -> None:
    experts, hidden, inter, top_k, rows = 384, 7168, 2048, 8, 4
    tokens = rows * experts // top_k
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    cfg = MoeConfig(8, 128, 128, 4, 4, swap=True)
    pair_ids, block_expert = align_to_experts(ids, experts, cfg.block_m)
    calls = []
    for group in (32, 128):
        ws = [random_int4((experts, 2 * inter, hidden), group) for _ in range(2)]
        t = graph_time_us(lambda i, ws=ws: moe_gemm(x, ws[i], pair_ids, block_expert,
                                                    tokens * top_k, top_k, cfg, silu_mul=True),
                          len(ws))  # fmt: skip
        print(f"group {group}: up GEMM {t:7.1f} us at {rows} rows an expert, {cfg}", flush=True)
        calls.append(lambda w=ws[0]: moe_gemm(x, w, pair_ids, block_expert, tokens * top_k,
                                              top_k, cfg, silu_mul=True))  # fmt: skip
    profile_once(calls)


def profile_moe_against_marlin(folder: Path, shape: str, rows_list: list[int]) -> None:
    from marlin import Marlin

    marlin = Marlin(folder)
    name = next(k for k in MOE_SHAPES if shape in k)
    experts, hidden, inter, top_k, group = MOE_SHAPES[name]
    print(name, flush=True)
    sets = [(random_int4((experts, 2 * inter, hidden), group),
             random_int4((experts, hidden, inter), group)) for _ in range(2)]  # fmt: skip
    repacked = [(marlin.from_ours(w13), marlin.from_ours(w2)) for w13, w2 in sets]
    calls = []
    for rows in rows_list:
        tokens = tokens_for_rows(rows, experts, top_k)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        rs = routings(tokens, experts, top_k, len(sets))

        def ours(i, x=x, rs=rs):
            return fused_moe(x, *sets[i], *rs[i])

        def theirs(i, x=x, rs=rs):
            return marlin.fused_moe(x, *repacked[i], *rs[i], group)

        mine, ref = ours(0).float(), theirs(0).float()
        err = (mine - ref).norm() / ref.norm()
        t_ours, t_marlin = graph_time_us(ours, len(sets)), graph_time_us(theirs, len(sets))
        print(f"{tokens:4d} tokens ({rows} rows an expert): ours {t_ours:7.1f} us, Marlin "
              f"{t_marlin:7.1f} us ({t_marlin / t_ours:.2f}x), outputs {err:.1e} apart",
              flush=True)  # fmt: skip
        calls += [lambda f=ours: f(0), lambda f=theirs: f(0)]
    profile_once(calls)


# the Gluon kernel's fastest tiles at 64 tokens (bench/results/w4a16_gemm_wgmma_kept_h100.json):
# fixed here, because tuning under the profiler (which serializes launches) picks unsplit tiles
WGMMA_AT_64 = {
    (16384, 7168, 128): GemmConfig("wgmma", 64, 128, 128, 2, 8, 4, counted=False, pdl=0),
    (4608, 7168, 32): GemmConfig("wgmma", 64, 128, 128, 16, 8, 4, counted=False, pdl=0),
}


def wgmma_and_marlin_calls(marlin, n: int, k: int, group: int) -> list:
    """The Gluon kernel's fastest tile and Marlin at 64 tokens on one shape, timed."""
    ws = [random_int4((n, k), group) for _ in range(2)]
    repacked = [marlin.from_ours(w) for w in ws]
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, n, device="cuda", dtype=torch.bfloat16)
    cfg = WGMMA_AT_64[n, k, group]
    t_ours = graph_time_us(lambda i: w4a16_matmul(x, ws[i], cfg), len(ws))
    t_marlin = graph_time_us(lambda i: marlin.gemm(x, *repacked[i], out), len(ws))
    print(f"N {n} K {k} g{group} M 64: wgmma {t_ours:6.1f} us ({cfg}), Marlin "
          f"{t_marlin:6.1f} us", flush=True)  # fmt: skip
    return [lambda: w4a16_matmul(x, ws[0], cfg), lambda: marlin.gemm(x, *repacked[0], out)]


def profile_wgmma_against_marlin(folder: Path) -> None:
    from marlin import Marlin

    marlin = Marlin(folder)
    calls = []
    for n, k, group in WGMMA_AT_64:
        calls += wgmma_and_marlin_calls(marlin, n, k, group)
    profile_once(calls)


def _option(flag: str, default: str) -> str:
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


def main() -> None:
    if "--wgmma" in sys.argv:
        profile_wgmma_against_marlin(Path(_option("--wgmma", "")))
        return
    if "--marlin" in sys.argv:
        rows = [int(r) for r in _option("--rows", "1,2,4").split(",")]
        profile_moe_against_marlin(Path(_option("--marlin", "")),
                                   _option("--moe-shape", "kimi-like 384x7168x2048 top8 g32"),
                                   rows)  # fmt: skip
        return
    if "--slice" in sys.argv:
        profile_slice_linears()
        return
    if "--groups" in sys.argv:
        profile_group_sizes()
        return
    w = random_int4((16384, 7168), 128)
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    gemm_cfg = GemmConfig("triton", 8, 256, 128, 4, 4, 4, swap=True)
    gemv_cfg = GemmConfig("gemv", 1, 128, 128, 8, 4, 1)
    experts, hidden, inter = 384, 7168, 2048
    w13 = random_int4((experts, 2 * inter, hidden), 32)
    ids = torch.randperm(experts, device="cuda")[:8].view(1, 8)
    xm = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    moe_cfg = MoeConfig(8, 128, 128, 4, 4, swap=True)
    pair_ids, block_expert = align_to_experts(ids, experts, moe_cfg.block_m)

    def run() -> None:
        w4a16_matmul(x, w, gemm_cfg)
        w4a16_matmul(x, w, gemv_cfg)
        moe_gemm(xm, w13, pair_ids, block_expert, 8, 8, moe_cfg, silu_mul=True)

    run()
    profile_once([run])


if __name__ == "__main__":
    main()
