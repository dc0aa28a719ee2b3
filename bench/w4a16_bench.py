"""Benchmark the INT4 W4A16 GEMM and fused MoE against their peers on one GPU.

GEMM (``y = x @ W.T``, group-wise INT4 weights) vs torch bf16 matmul and ``torch._scaled_mm``
with fp8 weights (activations pre-quantized, per-tensor scales: the peer's best case);
MoE (SwiGLU experts, top-k routing) vs the same kernel over bf16 experts and SGLang's Triton
int4 fused-MoE kernel (``fused_moe_kernel_gptq_awq``, read from SGLang's source file, best of a
few configs). Every timing is a CUDA-graph replay of many calls cycling through several weight
and input sets (working set above the 60 MB L2), median of replays, all in this one run.

    python bench/w4a16_bench.py [--quick] [--m 1,16,512] [--candidates] [--sglang-kernels PATH]
                                [--marlin DIR] [--rows-per-expert 1,2,4,8,16] [--slice-linears]
                                [--moe-shape 'top8 g32'] [--deepgemm] [--out DIR] [--tag _v3]

``--deepgemm`` also times SGLang's block-FP8 linear as it runs on Hopper (bench/deepgemm.py:
its group-128 quantizer, then DeepGEMM), whole and GEMM alone, on the fp8 weights.
``--marlin`` also times SGLang's Marlin (bench/marlin.py) on the same weights, repacked. Where the
tuned GEMM splits K, the same tile with its splits met the other way (counted in the launch, or
added into a zeroed output and cast: ``GemmConfig.counted``) is timed beside it
(``int4_other_split_us``).

``--candidates`` also times every tile the GEMM tuner may pick, side by side, and again three
times the tuner's way (``tuner_us``; ``tuner_rounds``: each round's pick and what it costs over
the fastest tile by the bench's timing), and the parts of the MoE forward (alignment, both
GEMMs, top-k sum) against the torch ops they replaced.
Prints a table last and writes w4a16_gemm<tag>.json and w4a16_moe<tag>.json under --out.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from accuracy import rel_l2
from deepgemm import DeepGemm, dequantize_blocks, dequantize_groups
from marlin import Marlin, marlin_block
from tessera.kernels import w4a16_moe
from tessera.kernels.w4a16_format import PACK, W4A16Weight, dequantize, unpack_int4
from tessera.kernels.w4a16_gemm import (
    _TUNED,
    _candidates,
    _graph_time,
    _m_bucket,
    _wgmma_tiles,
    flushed_graph,
    replay_times,
    w4a16_matmul,
)
from tessera.kernels.w4a16_moe import (
    align_to_experts,
    fused_moe,
    fused_moe_reference,
    moe_gemm,
)
from timing import graph_time_us

L2_BYTES = 60 * 2**20
M_VALUES = (1, 4, 16, 32, 64, 128, 512, 2048)
GEMM_SHAPES = {  # name: (N, K, group) per GPU
    "N16384_K7168 (target shape)": (16384, 7168, 128),
    "N7168_K7168 (target shape)": (7168, 7168, 128),
    "kimi-k2 dense gate_up TP8": (4608, 7168, 128),
    "kimi-k2 dense down TP8": (7168, 2304, 128),
    "N16384_K7168 group 32": (16384, 7168, 32),
}
# --slice-linears: the decode slice's INT4 linears on one Kimi K2 GPU (N, K), group 32: fused
# q_a + kv_a, q_b, o_proj, shared expert up and down, dense MLP up and down
SLICE_LINEARS = ((2112, 7168), (1536, 1536), (7168, 1024), (512, 7168), (7168, 256),
                 (4608, 7168), (7168, 2304))  # fmt: skip
MOE_SHAPES = {  # name: (experts, hidden, expert width, top_k, group)
    "kimi-like 384x7168x2048 top8 g32": (384, 7168, 2048, 8, 32),
    "kimi-like 384x7168x2048 top8 g128": (384, 7168, 2048, 8, 128),
    # one GPU's share at expert parallelism 8 (48 of the 384 experts): each row is one
    # dispatched (token, expert) pair, so a few rows touch a few experts (the decode slice)
    "kimi-k2 EP8 share 48x7168x2048 top1 g32": (48, 7168, 2048, 1, 32),
    "glm-like 256x6144x2048 top8 g128": (256, 6144, 2048, 8, 128),
    "glm-5 EP8 share 32x6144x2048 top1 g128": (32, 6144, 2048, 1, 128),
}
# --rows-per-expert: the MoE shapes of both models' releases (Kimi K2 group 32, GLM 5 group 128)
ROWS_MOE_SHAPES = tuple(k for k in MOE_SHAPES if "kimi-like" not in k or "g32" in k)
QUICK_MOE_SHAPES = ("kimi-like 384x7168x2048 top8 g32", "kimi-k2 EP8 share 48x7168x2048 top1 g32")
MOE_TOKENS = (1, 4, 16, 32, 64, 128)


def random_int4(shape_nk: tuple[int, ...], group: int, device: str = "cuda") -> W4A16Weight:
    """Fresh random INT4 weight [..., N, K]: uniform codes, scales in [0.5, 1.5] / 64."""
    *lead, n, k = shape_nk
    qweight = torch.randint(-(2**31), 2**31 - 1, (*lead, k // PACK, n), dtype=torch.int32,
                            device=device)  # fmt: skip
    scales = ((torch.rand(*lead, k // group, n, device=device) + 0.5) / 64).to(torch.bfloat16)
    return W4A16Weight(qweight, scales, None, group)


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(4 * L2_BYTES / nbytes))


MARLIN: Marlin | None = None  # set by --marlin
DEEPGEMM = None  # set by --deepgemm: deepgemm.DeepGemm


def marlin_time(call, sets: int) -> tuple[float, str]:
    """A Marlin call's time: graph replay like every other timing here; if its launch cannot be
    captured, the median of event-timed loops (launch gaps included), and which it was."""
    try:
        return graph_time_us(call, sets), "graph"
    except Exception as e:  # noqa: BLE001 - recorded next to the number
        print(f"marlin: graph capture failed ({e!r:.120}), timing eager loops", flush=True)
        torch.cuda.synchronize()
    times = []
    for _ in range(9):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(20):
            call(i % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(times), "eager"


TUNER_ROUNDS = 3  # times --candidates times every tile (or MoE pick) the tuner's way


def tuner_pick_costs(tuner_us: dict[str, list[float]], bench_us: dict[str, float]) -> dict:
    """The tile the tuner's timing picks in each round (``tuner_us``: a time per round per
    tile) and what each pick costs over the fastest tile by the bench's timing
    (``bench_us``)."""
    rounds = len(next(iter(tuner_us.values())))
    picks = [min(tuner_us, key=lambda c, r=r: tuner_us[c][r]) for r in range(rounds)]
    best = min(bench_us.values())
    return {"picks": picks, "cost_us": [bench_us[p] - best for p in picks]}


def bench_gemm(m_values, shapes, candidates: bool) -> Iterator[dict]:
    for name, (n, k, group) in shapes.items():
        yield from bench_gemm_shape(name, n, k, group, m_values, candidates)
        torch.cuda.empty_cache()


def bench_gemm_shape(name: str, n: int, k: int, group: int, m_values, candidates) -> Iterator[dict]:
    w_bytes = n * k // 2 + n * (k // group) * 2
    # as many weight sets as the bf16 and fp8 weights get (cycled past the L2), however small:
    # in decode a linear's weights come from HBM (a step reads far more than the L2 holds)
    sets = copies_for(w_bytes)
    ws = [random_int4((n, k), group) for _ in range(sets)]
    bf16 = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * n * k))
    ]
    fp8 = [(b / 16).to(torch.float8_e4m3fn) for b in bf16]
    one = torch.ones((), device="cuda")
    mws = [MARLIN.from_ours(w) for w in ws] if MARLIN is not None else []  # the same weights
    w_ref = dequantize(ws[0], torch.float32)  # [N, K]
    for m in m_values:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        x8 = [x.to(torch.float8_e4m3fn) for x in xs]
        ref = xs[0].float() @ w_ref.T
        err = rel_l2(w4a16_matmul(xs[0], ws[0]), ref)
        t_int4 = graph_time_us(lambda i, xs=xs: w4a16_matmul(xs[i % 4], ws[i % sets]), sets)
        t_bf16 = graph_time_us(lambda i, xs=xs: xs[i % 4] @ bf16[i % len(bf16)].T, len(bf16))
        try:
            t_fp8 = graph_time_us(
                lambda i, x8=x8: torch._scaled_mm(x8[i % 4], fp8[i % len(fp8)].T, one, one,
                                           out_dtype=torch.bfloat16),
                len(fp8),
            )  # fmt: skip
        except RuntimeError as e:  # cuBLASLt fp8 shape limits
            print(f"_scaled_mm M={m}: {e}".splitlines()[0], file=sys.stderr)
            t_fp8 = float("nan")
        marlin = {}
        if MARLIN is not None:
            out_m = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            marlin["marlin_us"], marlin["marlin_timing"] = marlin_time(
                lambda i, xs=xs, o=out_m: MARLIN.gemm(xs[i % 4], *mws[i % sets], o), sets
            )
            marlin["x_vs_marlin"] = marlin["marlin_us"] / t_int4
            marlin["marlin_rel_l2_vs_fp32"] = rel_l2(MARLIN.gemm(xs[0], *mws[0], out_m), ref)
        if DEEPGEMM is not None:
            marlin.update(deepgemm_times(xs, fp8, m, n, k))
        tuned = [v for key, v in _TUNED.items() if key[:4] == ("gemm", _m_bucket(m), n, k)]
        twin = {}
        if tuned and tuned[-1].split_k > 1 and tuned[-1].path != "wgmma":
            # the same tile, its splits met the other way
            other = dataclasses.replace(tuned[-1], counted=not tuned[-1].counted)
            twin["int4_other_split_us"] = graph_time_us(
                lambda i, xs=xs, c=other: w4a16_matmul(xs[i % 4], ws[i % sets], c), sets
            )
        # the Gluon kernel's tiles (Hopper), whatever the tuner picked: its best, side by side
        wgmma, forms = {}, {}
        for cfg in _wgmma_tiles(xs[0], ws[0]):
            t = graph_time_us(lambda i, xs=xs, c=cfg: w4a16_matmul(xs[i % 4], ws[i % sets], c),
                              sets)  # fmt: skip
            # its best tile launched plainly (split: zeroing, kernel, cast) and dependently
            # (split: counted, one launch), side by side
            form = "dependent_one_launch" if cfg.pdl else "plain"
            if t < forms.get(form, (float("inf"),))[0]:
                forms[form] = (t, _short(cfg))
            if t < wgmma.get("wgmma_us", float("inf")):
                wgmma = {"wgmma_us": t, "wgmma_config": _short(cfg),
                         "wgmma_rel_l2_vs_fp32": rel_l2(w4a16_matmul(xs[0], ws[0], cfg), ref)}
        if forms:
            wgmma["wgmma_forms_us"] = forms
        per_config, tuner, tuner_rounds = {}, {}, {}
        if candidates:  # every tile the tuner may pick, timed the same way, side by side
            # one of each name: the candidate lists can hold a tile twice
            configs = list({_short(c): c for c in _candidates(m, n, k)
                            + _wgmma_tiles(xs[0], ws[0])}.values())  # fmt: skip
            for cfg in configs:
                per_config[_short(cfg)] = graph_time_us(
                    lambda i, xs=xs, c=cfg: w4a16_matmul(xs[i % 4], ws[i % sets], c), sets
                )
            # and as the tuner times them (one weight flushed from the L2 before each call;
            # flush included), in TUNER_ROUNDS interleaved rounds: how often its pick changes
            # and what each pick costs against the fastest by the bench's timing
            for _ in range(TUNER_ROUNDS):
                for cfg in configs:
                    call = functools.partial(w4a16_matmul, xs[0], ws[0], cfg)
                    tuner.setdefault(_short(cfg), []).append(_graph_time(call, 16) * 1e3 / 16)
            tuner_rounds = tuner_pick_costs(tuner, per_config)
            print(f"  M={m} candidates (us): "
                  + ", ".join(f"{c} {t:.1f}" for c, t in sorted(per_config.items(),
                                                                key=lambda kv: kv[1]))
                  + f"; tuner's picks: {tuner_rounds['picks']}, costing "
                  + ", ".join(f"{c:.1f}" for c in tuner_rounds["cost_us"]),
                  flush=True)  # fmt: skip
        yield {
            "shape": name, "N": n, "K": k, "group": group, "M": m,
            "int4_us": t_int4, "bf16_us": t_bf16, "fp8_scaled_mm_us": t_fp8,
            "candidates_us": per_config, "tuner_us": tuner, "tuner_rounds": tuner_rounds,
            **marlin, **twin, **wgmma,
            "x_vs_bf16": t_bf16 / t_int4, "x_vs_fp8": t_fp8 / t_int4,
            "int4_weight_TBps": w_bytes / t_int4 / 1e6,
            "bf16_weight_TBps": 2 * n * k / t_bf16 / 1e6,
            "rel_l2_vs_fp32": err,
            "tuned_config": [str(v) for v in tuned],
        }  # fmt: skip
        print(f"gemm {name:32s} M={m:5d} int4 {t_int4:8.1f}us bf16 {t_bf16:8.1f}us "
              f"fp8 {t_fp8:8.1f}us  x{t_bf16 / t_int4:5.2f} vs bf16  "
              f"x{t_fp8 / t_int4:5.2f} vs fp8  rel-L2 {err:.1e}"
              + (f"  marlin {marlin['marlin_us']:8.1f}us x{marlin['x_vs_marlin']:5.2f}"
                 if "marlin_us" in marlin else "")
              + (f"  other split {twin['int4_other_split_us']:6.1f}us" if twin else "")
              + (f"  wgmma {wgmma['wgmma_us']:6.1f}us ({wgmma['wgmma_config']})" if wgmma else "")
              + "".join(f"  {form} {t:6.1f}us ({c})"
                        for form, (t, c) in wgmma.get("wgmma_forms_us", {}).items())
              + (f"  deepgemm {marlin['deepgemm_us']:6.1f}us "
                 f"(gemm {marlin['deepgemm_gemm_us']:.1f})" if "deepgemm_us" in marlin else ""),
              flush=True)  # fmt: skip


def deepgemm_times(xs, fp8, m: int, n: int, k: int) -> dict:
    """SGLang's block-FP8 linear on Hopper (deepgemm.py) on the fp8 weights: the whole linear
    (activation quantization + GEMM, as SGLang runs it) and the GEMM alone, and its error."""
    blocks = [torch.rand(-(-n // 128), k // 128, device="cuda") / 16 + 1 / 32 for _ in fp8]
    res = {"deepgemm_us": graph_time_us(
        lambda i: DEEPGEMM.linear(xs[i % 4], fp8[i % len(fp8)], blocks[i % len(fp8)]), len(fp8))}
    q = [DEEPGEMM.quantize(x) for x in xs]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    res["deepgemm_gemm_us"] = graph_time_us(
        lambda i: DEEPGEMM.gemm(*q[i % 4], fp8[i % len(fp8)], blocks[i % len(fp8)], out),
        len(fp8))  # fmt: skip
    ref = dequantize_groups(*q[0]) @ dequantize_blocks(fp8[0], blocks[0]).T
    res["deepgemm_rel_l2_vs_quantized_fp32"] = rel_l2(DEEPGEMM.gemm(*q[0], fp8[0], blocks[0]), ref)
    return res


def _short(cfg) -> str:
    """A GEMM or MoE config in a few characters: orientation, tile, warps, stages, splits."""
    path = getattr(cfg, "path", "triton")
    if path == "gemv":
        return f"gemv{cfg.block_n}x{cfg.block_k}" + (f"k{cfg.split_k}" if cfg.split_k > 1 else "")
    if path == "wgmma":
        return (f"wgmma{cfg.block_m}x{cfg.block_n}s{cfg.num_stages}"
                + (f"k{cfg.split_k}" if cfg.split_k > 1 else "") + ("d" if cfg.pdl else ""))
    if path != "triton":
        return path
    text = f"{'S' if cfg.swap else 'P'}{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
    text += "p" if getattr(cfg, "pair_blocks", False) else ""  # one pair a block, in order
    split = getattr(cfg, "split_k", 1)
    return text + (f"k{split}" if split > 1 else "")


def load_sglang_moe_kernel(path: Path):
    """SGLang's own ``fused_moe_kernel_gptq_awq`` (and its helper), taken verbatim from its
    source file without importing the rest of SGLang (which needs packages absent here)."""
    source = path.read_text()
    tree = ast.parse(source)
    wanted = {"write_zeros_to_output", "fused_moe_kernel_gptq_awq"}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        raise SystemExit(f"{path} lacks {wanted}")
    scratch = Path.home() / ".cache" / "tessera" / "sglang_moe_kernel.py"
    scratch.parent.mkdir(parents=True, exist_ok=True)  # triton.jit needs real source lines
    scratch.write_text(
        "import triton\nimport triton.language as tl\n\n\n"
        + "\n\n\n".join("@triton.jit\n" + ast.get_source_segment(source, n) for n in nodes)
    )
    namespace: dict = {"__name__": "sglang_moe_kernel"}
    exec(compile(scratch.read_text(), str(scratch), "exec"), namespace)
    return namespace["fused_moe_kernel_gptq_awq"]


def to_sglang_int4(w: W4A16Weight, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [E, K/8, N] words -> SGLang's int4 layout: uint8 [E, N, K/2] (even k in the low nibble)
    and scales [E, N, K/G]."""
    e, n, k = w.qweight.shape[0], w.n, w.k
    packed = torch.empty((e, n, k // 2), dtype=torch.uint8, device=w.qweight.device)
    for s in range(0, e, chunk):
        codes = unpack_int4(w.qweight[s : s + chunk], dim=-2).transpose(-1, -2)  # [c, N, K]
        packed[s : s + chunk] = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, w.scales.transpose(-1, -2).contiguous()


def sglang_moe(kernel, cfg, x, b13, s13, b2, s2, topk_w, topk_ids, group):
    """The MoE forward SGLang runs with that kernel: up GEMM, SiLU-and-mul, down GEMM, sum."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    pair_ids, block_expert = align_to_experts(topk_ids, b13.shape[0], cfg["BLOCK_SIZE_M"])
    post_padded = (block_expert >= 0).sum().reshape(1) * cfg["BLOCK_SIZE_M"]
    routing = topk_w.reshape(-1).float()

    def gemm(a, b, s, rows_top_k, mul_routing):
        out = torch.empty((num_pairs, b.shape[1]), dtype=torch.bfloat16, device=a.device)
        grid = (
            triton.cdiv(pair_ids.numel(), cfg["BLOCK_SIZE_M"])
            * triton.cdiv(b.shape[1], cfg["BLOCK_SIZE_N"]),
        )
        kernel[grid](
            a, b, out, s, None, routing, pair_ids, block_expert, post_padded,
            b.shape[1], a.shape[1], pair_ids.numel(), num_pairs,
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1),
            out.stride(0), out.stride(1), s.stride(0), s.stride(2), s.stride(1), 0, 0, 0,
            group_size=group, MUL_ROUTED_WEIGHT=mul_routing, top_k=rows_top_k,
            compute_type=tl.bfloat16, has_zp=False, use_int4_w4a16=True, use_int8_w8a16=False,
            even_Ks=a.shape[1] % cfg["BLOCK_SIZE_K"] == 0, **cfg,
        )  # fmt: skip
        return out

    h = gemm(x, b13, s13, top_k, False)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    out = gemm(act, b2, s2, 1, True)
    return out.view(tokens, top_k, -1).sum(1, dtype=torch.float32).to(torch.bfloat16)


SGLANG_CONFIGS = [  # its default int4 config at small M, and its default at large M
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1},
    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8},
]


def routings(tokens, experts, top_k, count):
    out = []
    for _ in range(count):
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
        out.append((torch.rand(tokens, top_k, device="cuda").softmax(-1), ids))
    return out


def tokens_for_rows(rows_per_expert: int, experts: int, top_k: int) -> int:
    """Tokens that give each expert ``rows_per_expert`` rows on average (1: one token, whose
    top-k rows land on distinct experts)."""
    return 1 if rows_per_expert == 1 else rows_per_expert * experts // top_k


def bench_moe(token_values, shapes, sglang_kernel, candidates: bool,
              rows_per_expert=None) -> Iterator[dict]:  # fmt: skip
    for name, shape in shapes.items():
        if rows_per_expert:
            experts, top_k = shape[0], shape[3]
            token_values = [tokens_for_rows(r, experts, top_k) for r in rows_per_expert]
        yield from bench_moe_shape(name, *shape, token_values, sglang_kernel, candidates)
        torch.cuda.empty_cache()


def moe_parts(x, w, rs, top_k, cfgs) -> dict:
    """Time each launch of the fused MoE forward (tuned tiles ``cfgs``) and the torch ops it
    replaced: the alignment (one Triton launch, two beyond a chunk of pairs, vs twenty to
    thirty torch ops), the up GEMM with SiLU-and-mul in its epilogue vs the up GEMM then
    torch's SiLU-and-mul, and the down GEMM with the top-k sum (each counted GEMM with the
    zeroing of its workspace). Where both GEMMs take blocks of one row (the gemv path), also
    the whole forward with its blocks made by the alignment kernel, as before ``expert_blocks``
    skipped it, beside the forward as it is."""
    (w13, w2), (up, down) = w, cfgs
    experts = (w13.qweight if isinstance(w13, W4A16Weight) else w13).shape[0]
    tokens = x.shape[0]
    pairs = tokens * top_k
    aligned = [w4a16_moe.expert_blocks(r[1], experts, up.rows_per_block) for r in rs]
    aligned_down = [w4a16_moe.expert_blocks(r[1], experts, down.rows_per_block) for r in rs]
    act = moe_gemm(x, w13, *aligned[0], pairs, top_k, up, silu_mul=True)
    routing = [r[0].reshape(-1) for r in rs]

    def up_then_silu(i):
        h = moe_gemm(x, w13, *aligned[i], pairs, top_k, up)
        gate, upper = h.chunk(2, dim=-1)
        return (F.silu(gate.float()) * upper.float()).to(torch.bfloat16)

    times = {
        "align_kernel": lambda i: align_to_experts(rs[i][1], experts, up.block_m),
        "align_torch_ops": lambda i: w4a16_moe.align_to_experts_reference(rs[i][1], experts,
                                                                             up.block_m),
        "up_gemm_silu_fused": lambda i: moe_gemm(x, w13, *aligned[i], pairs, top_k, up,
                                                 silu_mul=True),
        "up_gemm_then_torch_silu": up_then_silu,
        "down_gemm_topk_sum": lambda i: moe_gemm(act, w2, *aligned_down[i], pairs, 1, down,
                                                 routing[i], sum_rows=top_k),
    }  # fmt: skip
    if up.block_m == down.block_m == 1:

        def forward_aligned(i):
            saved = w4a16_moe.expert_blocks
            w4a16_moe.expert_blocks = align_to_experts
            try:
                return fused_moe(x, w13, w2, *rs[i])
            finally:
                w4a16_moe.expert_blocks = saved

        times["forward"] = lambda i: fused_moe(x, w13, w2, *rs[i])
        times["forward_aligned_blocks"] = forward_aligned
    return {part: graph_time_us(fn, len(rs)) for part, fn in times.items()}


def moe_candidates(xs, w, rs, top_k) -> dict[str, dict[str, float]]:
    """Each tile the MoE tuner may pick, timed alone in both GEMMs (the up GEMM with its
    SiLU-and-mul, the down GEMM on a fixed activation), side by side."""
    (w13, w2), tokens = w, xs[0].shape[0]
    experts = (w13.qweight if isinstance(w13, W4A16Weight) else w13).shape[0]
    pairs = tokens * top_k
    inter = w2.k if isinstance(w2, W4A16Weight) else w2.shape[1]
    act = torch.randn(pairs, inter, device="cuda", dtype=torch.bfloat16)
    int4 = isinstance(w13, W4A16Weight)
    routing = [r[0].reshape(-1) for r in rs]
    out = {"up": {}, "down": {}}
    for cfg in w4a16_moe._candidates(pairs, experts, w4a16_moe._num_columns(w13), int4):
        aligned = [w4a16_moe.expert_blocks(r[1], experts, cfg.rows_per_block) for r in rs]
        out["up"][_short(cfg)] = graph_time_us(
            lambda i, c=cfg, a=aligned: moe_gemm(xs[i], w13, *a[i], pairs, top_k, c,
                                                 silu_mul=True), len(rs))  # fmt: skip
    for cfg in w4a16_moe._candidates(pairs, experts, w4a16_moe._num_columns(w2), int4):
        aligned = [w4a16_moe.expert_blocks(r[1], experts, cfg.rows_per_block) for r in rs]
        out["down"][_short(cfg)] = graph_time_us(
            lambda i, c=cfg, a=aligned, g=routing: moe_gemm(act, w2, *a[i], pairs, 1, c, g[i],
                                                            sum_rows=top_k),
            len(rs),
        )  # fmt: skip
    return out


def interleaved_graph_times(fns: dict, rounds: int, calls: int = 16, replays: int = 9) -> dict:
    """The tuner's ``_graph_time`` of each of ``fns`` (key: function), its ``replays`` split
    into ``rounds`` interleaved rounds, so that a drift of clocks falls on every candidate
    alike; one round times them one after another, as the tuner does."""
    graphs = {}
    for key, fn in fns.items():
        try:
            graphs[key] = flushed_graph(fn, calls)
        except (triton.runtime.errors.OutOfResources, triton.CompilationError):
            continue  # as the tuner skips them
    times = {key: [] for key in graphs}
    for _ in range(rounds):
        for key, graph in graphs.items():
            times[key] += replay_times(graph, replays // rounds)
    return {key: statistics.median(t) for key, t in times.items()}


def moe_tuner_rounds(xs, w, rs, alone: dict[str, dict[str, float]]) -> dict:
    """The MoE tuner's choice as it makes it (``_tune_stages``: each (up, down) pair's whole
    forward timed the tuner's way on one input and routing), uncached and repeated
    TUNER_ROUNDS times, with its candidates timed one after another (1 round, as the tuner
    does) and in TUNER_ROUNDS interleaved rounds, alternating: each repetition's pick and its
    forward by the bench's timing, beside the forward of the fastest up and down tiles timed
    alone (``alone``, from ``moe_candidates``)."""
    w13, w2 = w
    pairs = rs[0][1].numel()
    up_cands, down_cands, mid = w4a16_moe._tune_candidates(w13, w2, pairs,
                                                           w4a16_moe._num_experts(w13))

    def forward(cfgs, i=0):
        return fused_moe(xs[i], w13, w2, *rs[i], configs=cfgs)

    def tuner(rounds):
        def fastest(stage, cfg_pairs):
            times = interleaved_graph_times({c: functools.partial(forward, c) for c in cfg_pairs},
                                            rounds)  # fmt: skip
            return min(times, key=times.__getitem__)

        return w4a16_moe._tune_stages(fastest, up_cands, down_cands, mid)

    def bench_us(cfgs):
        return graph_time_us(lambda i: forward(cfgs, i), len(rs))

    picks = {r: [] for r in (1, TUNER_ROUNDS)}
    for _ in range(TUNER_ROUNDS):
        for r, rounds_picks in picks.items():
            rounds_picks.append(tuner(r))
    by_name = {_short(c): c for c in up_cands + down_cands}
    best = tuple(by_name[min(alone[g], key=alone[g].__getitem__)] for g in ("up", "down"))
    return {
        "picks": {f"{r} rounds": [[_short(c) for c in cfgs] for cfgs in p]
                  for r, p in picks.items()},
        "picks_us": {f"{r} rounds": [bench_us(cfgs) for cfgs in p] for r, p in picks.items()},
        "fastest_alone": [_short(c) for c in best],
        "fastest_alone_us": bench_us(best),
    }  # fmt: skip


def tuned_moe_tiles(tokens, experts, hidden, kind) -> tuple:
    """The (up, down) tiles ``fused_moe`` runs at this shape: the tuner's last stage."""
    return _TUNED[("moe_up_given_down", tokens, experts, (hidden,), kind,
                   torch.cuda.get_device_name())]  # fmt: skip


def bench_moe_shape(
    name, experts, hidden, inter, top_k, group, token_values, sglang_kernel, candidates
):  # fmt: skip
    w13 = random_int4((experts, 2 * inter, hidden), group)
    w2 = random_int4((experts, hidden, inter), group)
    b13 = torch.randn(experts, hidden, 2 * inter, device="cuda", dtype=torch.bfloat16) / 64
    b2 = torch.randn(experts, inter, hidden, device="cuda", dtype=torch.bfloat16) / 64
    sg = (*to_sglang_int4(w13), *to_sglang_int4(w2)) if sglang_kernel else None
    if MARLIN is not None:  # the same experts in Marlin's layout
        mw13, mw2 = MARLIN.from_ours(w13), MARLIN.from_ours(w2)

    # correctness of all three on a few tokens, against the fp32 reference
    wts, ids = routings(4, experts, top_k, 1)[0]
    x = torch.randn(4, hidden, device="cuda", dtype=torch.bfloat16)
    ref = fused_moe_reference(x, _slice(w13, ids), _slice(w2, ids), wts, _remap(ids))
    errs = {"int4": rel_l2(fused_moe(x, w13, w2, wts, ids), ref)}
    if sg:
        errs["sglang_int4"] = rel_l2(
            sglang_moe(sglang_kernel, SGLANG_CONFIGS[0], x, *sg, wts, ids, group), ref
        )
    if MARLIN is not None:
        errs["marlin"] = rel_l2(MARLIN.fused_moe(x, mw13, mw2, wts, ids, group), ref)
    print(f"moe {name}: rel-L2 vs fp32 reference {errs}", flush=True)

    for tokens in token_values:
        rs = routings(tokens, experts, top_k, 4)
        xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        t_int4 = graph_time_us(lambda i, xs=xs, rs=rs: fused_moe(xs[i], w13, w2, *rs[i]), 4)
        tuned_int4 = tuned_moe_tiles(tokens, experts, hidden, "int4")
        aligned_tiles = {}
        if any(c.pair_blocks for c in tuned_int4):
            # the same tiles on blocks from the alignment kernel, side by side
            plain = tuple(dataclasses.replace(c, pair_blocks=False) for c in tuned_int4)
            aligned_tiles["int4_aligned_tiles_us"] = graph_time_us(
                lambda i, xs=xs, rs=rs, c=plain: fused_moe(xs[i], w13, w2, *rs[i], configs=c), 4
            )
            print(f"  T={tokens} tuned {[_short(c) for c in tuned_int4]}: {t_int4:.1f} us, "
                  f"on aligned blocks {aligned_tiles['int4_aligned_tiles_us']:.1f} us",
                  flush=True)  # fmt: skip
        t_bf16 = graph_time_us(lambda i, xs=xs, rs=rs: fused_moe(xs[i], b13, b2, *rs[i]), 4)
        t_sg, best_cfg = float("nan"), None
        if sg:
            for cfg in SGLANG_CONFIGS:

                def call(i, c=cfg, xs=xs, rs=rs):
                    return sglang_moe(sglang_kernel, c, xs[i], *sg, *rs[i], group)

                t = graph_time_us(call, 4)
                if not t >= t_sg:
                    t_sg, best_cfg = t, cfg
        marlin = {}
        if MARLIN is not None:
            marlin = marlin_moe_times(xs, rs, (mw13, mw2), experts, hidden, inter, top_k, group)
            marlin["x_vs_marlin_moe"] = marlin["marlin_moe_us"] / t_int4
        touched = statistics.mean(r[1].unique().numel() for r in rs)
        parts, per_config, tuner_rounds = {}, {}, {}
        if candidates:
            for kind, w in (("int4", (w13, w2)), ("bf16", (b13, b2))):
                per_config[kind] = moe_candidates(xs, w, rs, top_k)
                for gemm, times in per_config[kind].items():
                    print(f"  T={tokens} {kind} {gemm} candidates (us): " + ", ".join(
                        f"{c} {t:.1f}" for c, t in sorted(times.items(), key=lambda kv: kv[1])),
                        flush=True)  # fmt: skip
                if kind == "bf16":  # a baseline: its tuner's picks are not what ships
                    continue
                tuner_rounds[kind] = rounds = moe_tuner_rounds(xs, w, rs, per_config[kind])
                print(f"  T={tokens} {kind} tuner's picks: " + "; ".join(
                    f"{way}: " + ", ".join(f"{p} {t:.1f}" for p, t in zip(
                        rounds["picks"][way], rounds["picks_us"][way], strict=True))
                    for way in rounds["picks"])
                    + f"; fastest tiles alone {rounds['fastest_alone']} "
                    f"{rounds['fastest_alone_us']:.1f} us", flush=True)  # fmt: skip
            tuned = {key[0]: v for key, v in _TUNED.items()
                     if key[0].startswith("moe") and key[1] == tokens}  # fmt: skip
            for kind, w in (("int4", (w13, w2)), ("bf16", (b13, b2))):
                cfgs = tuned_moe_tiles(tokens, experts, hidden, kind)
                parts[kind] = moe_parts(xs[0], w, rs, top_k, cfgs)
                parts[kind]["tiles"] = [_short(c) for c in cfgs]
                print(f"  T={tokens} {kind} parts (us): "
                      + ", ".join(f"{p} {t:.1f}" for p, t in parts[kind].items()
                                  if p != "tiles") + f" tiles {parts[kind]['tiles']}",
                      flush=True)  # fmt: skip
            del tuned
        tuned_tiles = {kind: [_short(c) for c in tuned_moe_tiles(tokens, experts, hidden, kind)]
                       for kind in ("int4", "bf16")}  # fmt: skip
        yield {
            "shape": name, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
            "group": group, "tokens": tokens, "int4_us": t_int4, "bf16_experts_us": t_bf16,
            "sglang_int4_us": t_sg, "sglang_best_config": best_cfg,
            "x_vs_bf16_experts": t_bf16 / t_int4, "x_vs_sglang": t_sg / t_int4,
            "rel_l2_vs_fp32_T4": errs, "avg_distinct_experts_per_call": touched,
            "tuned_configs": {f"{key[0]} {key[-2]}": str(v) for key, v in _TUNED.items()
                              if key[0].startswith("moe") and key[1] == tokens},
            "tuned_tiles": tuned_tiles,
            "parts_us": parts, "candidates_us": per_config, "tuner_rounds": tuner_rounds,
            **marlin, **aligned_tiles,
        }  # fmt: skip
        print(f"moe {name} T={tokens:4d} int4 {t_int4:8.1f}us bf16 {t_bf16:8.1f}us "
              f"sglang {t_sg:8.1f}us  x{t_bf16 / t_int4:5.2f} vs bf16  "
              f"x{t_sg / t_int4:5.2f} vs sglang"
              + (f"  marlin {marlin['marlin_moe_us']:8.1f}us (gemms "
                 f"{marlin['marlin_up_gemm_us']:.1f}+{marlin['marlin_down_gemm_us']:.1f}) "
                 f"x{marlin['x_vs_marlin_moe']:5.2f}" if marlin else ""),
              flush=True)  # fmt: skip


def marlin_moe_times(xs, rs, weights, experts, hidden, inter, top_k, group) -> dict:
    """Marlin's fused MoE (alignment included, as ours) and its two GEMMs alone (routings
    aligned ahead) on the bench's inputs and routings."""
    tokens = xs[0].shape[0]
    mw13, mw2 = weights
    block = marlin_block(tokens, top_k, experts)
    mrs = [(*MARLIN.align(ids, experts, block), wts.float().reshape(-1)) for wts, ids in rs]
    h13 = torch.empty(tokens * top_k, 2 * inter, dtype=torch.bfloat16, device="cuda")
    act = torch.randn(tokens * top_k, inter, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(tokens * top_k, hidden, dtype=torch.bfloat16, device="cuda")
    res = {"marlin_block": block}
    res["marlin_moe_us"], res["marlin_timing"] = marlin_time(
        lambda i: MARLIN.fused_moe(xs[i], mw13, mw2, *rs[i], group), len(rs)
    )
    res["marlin_up_gemm_us"], _ = marlin_time(
        lambda i: MARLIN.moe_gemm(xs[i], h13, *mw13, mrs[i], block, top_k, False, group),
        len(rs))  # fmt: skip
    res["marlin_down_gemm_us"], _ = marlin_time(
        lambda i: MARLIN.moe_gemm(act, down, *mw2, mrs[i], block, 1, True, group), len(rs)
    )
    counts = [r[1].flatten().bincount(minlength=experts) for r in rs]
    res["avg_rows_per_touched_expert"] = statistics.mean(
        float(c[c > 0].float().mean()) for c in counts)  # fmt: skip
    return res


def _remap(ids: torch.Tensor) -> torch.Tensor:
    """Routing renumbered onto the experts it uses (the reference dequantizes only those)."""
    return torch.searchsorted(ids.unique(), ids)


def _slice(w: W4A16Weight, ids: torch.Tensor) -> W4A16Weight:
    used = ids.unique()
    return W4A16Weight(w.qweight[used], w.scales[used], None, w.group_size)


def _portable(args: list[str]) -> list[str]:
    """The arguments without this machine's paths: the output folder as OUT_DIR, any other
    absolute path (Marlin's built modules) as DIR."""
    return ["OUT_DIR" if i and args[i - 1] == "--out" else "DIR" if a.startswith("/") else a
            for i, a in enumerate(args)]  # fmt: skip


def meta(argv, commit: str = "") -> dict:
    return {
        "commit": commit or None,
        "device": torch.cuda.get_device_name(),
        "driver": subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip(),
        "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python bench/w4a16_bench.py", *_portable(argv[1:])]),
        "timing": "CUDA-graph replay, median of 10 replays, weights/inputs rotated past L2",
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and sizes")
    ap.add_argument("--m", help="GEMM batch sizes, comma-separated (overrides the default set)")
    ap.add_argument("--candidates", action="store_true",
                    help="also time every GEMM tile candidate and the MoE's parts")  # fmt: skip
    ap.add_argument("--tokens", help="MoE token counts, comma-separated (overrides the default)")
    ap.add_argument("--rows-per-expert",
                    help="MoE sizes as average rows per expert, comma-separated (1,2,4,8,16): "
                         "token counts per shape, on the releases' shapes")  # fmt: skip
    ap.add_argument("--only", choices=["gemm", "moe"], help="run one half")
    ap.add_argument("--moe-shape", default="", help="only the MoE shapes named with this text")
    ap.add_argument("--slice-linears", action="store_true",
                    help="GEMM on the decode slice's INT4 linears (Kimi K2, group 32) and the "
                         "two target shapes")  # fmt: skip
    ap.add_argument("--sglang-kernels", type=Path, help="SGLang's fused_moe_triton_kernels.py")
    ap.add_argument(
        "--marlin", type=Path, help="folder of Marlin's modules built by bench/sglang_jit_build.py"
    )
    ap.add_argument("--deepgemm", action="store_true",
                    help="also time SGLang's block-FP8 linear through DeepGEMM (deepgemm.py; "
                         "DeepGEMM built by deepgemm_build.py, SGLang's fp8_kernel.py beside "
                         "--sglang-kernels or installed)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--commit", default="", help="the tree's commit, recorded in the results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    kernel = load_sglang_moe_kernel(args.sglang_kernels) if args.sglang_kernels else None
    if args.marlin:
        global MARLIN
        MARLIN = Marlin(args.marlin)
    if args.deepgemm:
        global DEEPGEMM
        DEEPGEMM = DeepGemm(args.sglang_kernels.parent if args.sglang_kernels else None)
    m_values = (1, 4, 16, 64) if args.quick else M_VALUES
    if args.m:
        m_values = tuple(int(v) for v in args.m.split(","))
    gemm_shapes = dict(list(GEMM_SHAPES.items())[:2]) if args.quick else GEMM_SHAPES
    if args.slice_linears:
        gemm_shapes = {**{f"slice N{n}_K{k} g32": (n, k, 32) for n, k in SLICE_LINEARS},
                       **dict(list(GEMM_SHAPES.items())[:2])}  # fmt: skip
    tokens = (1, 16, 64) if args.quick else MOE_TOKENS
    if args.tokens:
        tokens = tuple(int(v) for v in args.tokens.split(","))
    moe_shapes = {k: MOE_SHAPES[k] for k in QUICK_MOE_SHAPES} if args.quick else MOE_SHAPES
    rows_per_expert = None
    if args.rows_per_expert:
        rows_per_expert = [int(v) for v in args.rows_per_expert.split(",")]
        moe_shapes = {k: MOE_SHAPES[k] for k in ROWS_MOE_SHAPES}
    moe_shapes = {k: v for k, v in moe_shapes.items() if args.moe_shape in k}
    if not moe_shapes:
        raise SystemExit(f"no MoE shape's name contains {args.moe_shape!r}: {list(MOE_SHAPES)}")
    t0 = time.time()
    results = {}
    runs = {
        "gemm": lambda: bench_gemm(m_values, gemm_shapes, args.candidates),
        "moe": lambda: bench_moe(tokens, moe_shapes, kernel, args.candidates, rows_per_expert),
    }
    for part, run in runs.items():
        if args.only in (None, part):
            results[part], about = [], meta(sys.argv, args.commit)
            for row in run():  # written after each row: a run cut short keeps what it measured
                results[part].append(row)
                doc = {**about, "seconds": round(time.time() - t0, 1), "rows": results[part]}
                (args.out / f"w4a16_{part}{args.tag}.json").write_text(json.dumps(doc, indent=1))
    print("\n== summary ==")
    for r in results.get("gemm", []):
        print(
            f"{r['shape']:32s} M={r['M']:5d}  x{r['x_vs_bf16']:5.2f} vs bf16  "
            f"x{r['x_vs_fp8']:5.2f} vs fp8  {r['int4_weight_TBps']:.2f} TB/s"
            + (f"  x{r['x_vs_marlin']:5.2f} vs marlin" if "x_vs_marlin" in r else "")
        )
    for r in results.get("moe", []):
        print(f"{r['shape']:34s} T={r['tokens']:4d}  "
              f"x{r['x_vs_bf16_experts']:5.2f} vs bf16 experts  "
              f"x{r['x_vs_sglang']:5.2f} vs sglang int4"
              + (f"  x{r['x_vs_marlin_moe']:5.2f} vs marlin moe" if "x_vs_marlin_moe" in r
                 else ""))  # fmt: skip


if __name__ == "__main__":
    main()
