"""Benchmark the paged FP8 and BF16 KV-cache kernels against their peers on one GPU.

Decode attention (GQA and MLA): our BF16 and FP8 paged kernels, torch SDPA (BF16, contiguous
cache), and SGLang's Triton decode attention (BF16 and FP8 with a per-tensor scale, page size 1
token indices, its default 8 KV splits), read from SGLang's source file without importing the
rest of SGLang. Also quantize-on-write against the BF16 store (``cache[slots] = new``, what
SGLang does) and the BF16 -> FP8 page conversion. Every time is the median of CUDA-graph
replays of many calls cycling through several page sets (working set above the 60 MB L2),
all in this one run; bandwidth counts the KV bytes (and FP8 scales) each call must read.

    python bench/fp8_kv_decode.py [--quick] [--tune] [--variants] [--sglang-kernel PATH] [--out DIR]

Prints a table last and writes fp8_kv_decode.json (fp8_kv_tune.json with --tune,
fp8_kv_variants.json with --variants: kernel variants side by side on shared data, each also
checked against the float64 reference).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import itertools
import json
import math
import subprocess
import sys
import types
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from accuracy import rel_l2
from flashmla_peer import flashmla_decode
from tessera.kernels.fp8_kv_convert import convert_pages_bf16_to_fp8
from tessera.kernels.fp8_kv_quant import write_kv_fp8, write_kv_fp8_ref
from tessera.kernels.paged_decode_bf16 import (
    paged_decode_bf16,
    paged_decode_bf16_ref,
    paged_decode_mla_bf16,
    paged_decode_mla_bf16_ref,
)
from tessera.kernels.paged_decode_fp8 import (
    paged_decode_fp8,
    paged_decode_fp8_ref,
    paged_decode_mla_fp8,
    paged_decode_mla_fp8_ref,
)
from tessera.kernels.paged_decode_split import (
    MLA_FP8_E4M3,
    MLA_FP8_E4M3_128,
    MLA_FP8_E4M3_IN_PLACE,
    MLA_FP8_E4M3_Q_IN_CONSUMER,
    MLA_FP8_E4M3_STREAM,
    MLA_FP8_TRITON,
    MLA_FP8_WGMMA,
    MLA_HEADS_M,
    MLA_HEADS_M_STREAM,
    MLA_HEADS_TRITON,
    SHORT_SPLITS,
    DecodeConfig,
    num_sms,
    pick_config,
    split_plan_sm_share,
)
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable
from timing import copy_bandwidth, graph_time_us

# the decode slice's mix of lengths (bench/decode_slice_plan.py's CONTEXT_MIX, whose module needs
# the planner's dependencies)
CONTEXT_MIX = (1024, 2048, 4096, 8192)

L2_BYTES = 60 * 2**20
SGLANG_SPLITS = 8  # SGLang's default --triton-attention-num-kv-splits


def load_sglang_decode(path: Path):
    """SGLang's ``decode_attention_fwd_grouped`` from its source file. Its one SGLang import,
    ``sglang.srt.utils.is_hip``, is stubbed (benchmark only) so nothing else of SGLang loads."""
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False  # type: ignore[attr-defined]
    sys.modules["sglang.srt.utils"] = utils
    spec = importlib.util.spec_from_file_location("sglang_decode_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_attention_fwd_grouped


class PagedCase:
    """``sets`` disjoint page sets over one pool, each ``batch`` requests of ``ctx`` tokens (or of
    ``lens[i]`` tokens, a mix, ``ctx`` then being the longest)."""

    def __init__(self, batch, ctx, kv_heads, dim, page_size, bytes_per_token, with_scales=True,
                 lens=None):  # fmt: skip
        lens = list(lens) if lens is not None else [ctx] * batch
        ctx = max(lens)
        self.total_tokens = sum(lens)
        per_set = self.total_tokens * bytes_per_token
        self.sets = max(1, min(16, math.ceil(4 * L2_BYTES / per_set)))
        pages_per_req = math.ceil(ctx / page_size)
        num_pages = self.sets * batch * pages_per_req
        self.batch, self.ctx, self.page_size = batch, ctx, page_size
        perm = torch.randperm(num_pages, device="cuda").view(self.sets, batch, pages_per_req)
        self.lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pages_per_req
        self.tables = [
            PageTable(indptr, perm[s].flatten().to(torch.int32), self.lens, page_size, 1)
            for s in range(self.sets)
        ]
        self.block_tables = [perm[s].to(torch.int32).contiguous() for s in range(self.sets)]
        offs = torch.arange(page_size, device="cuda")
        token_slots = (perm[..., None] * page_size + offs).flatten(2)[..., :ctx]  # [sets, B, ctx]
        self.sg_indptr = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32,
                                      device="cuda")  # fmt: skip
        self.sg_indices = [torch.cat([token_slots[s, b, :n] for b, n in enumerate(lens)])
                           for s in range(self.sets)]  # int64  # fmt: skip
        self.sg_splits = torch.full((batch,), SGLANG_SPLITS, dtype=torch.int32, device="cuda")
        self.num_pages = num_pages
        self.token_slots = token_slots
        self.len_list = lens


def fp8_copies(rows_bf16: torch.Tensor):
    """(per-(token, head) FP8 cache, its scales, per-tensor FP8 cache, its scale)."""
    n = rows_bf16.shape[0] * rows_bf16.shape[1]
    slots = torch.arange(n, device="cuda")
    flat = rows_bf16.flatten(0, 1)
    c_tok = torch.empty(rows_bf16.shape, dtype=FP8_DTYPE, device="cuda")
    s_tok = torch.empty(rows_bf16.shape[:-1], device="cuda")
    write_kv_fp8(flat, c_tok, s_tok, slots)
    c_pt = torch.empty_like(c_tok)
    s_pt = torch.tensor(flat.abs().amax().float().item() / 448.0, device="cuda")
    write_kv_fp8(flat, c_pt, s_pt, slots)
    return c_tok, s_tok, c_pt, s_pt


def bench_gqa(batch, ctx, heads, kv_heads, dim, page_size, sglang, copy_bw, config=None):
    case = PagedCase(batch, ctx, kv_heads, dim, page_size, kv_heads * dim * 4)
    shape = (case.num_pages, page_size, kv_heads, dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    k8, ks, k8pt, kspt = fp8_copies(k)
    v8, vs, v8pt, vspt = fp8_copies(v)
    q = [torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
         for _ in range(case.sets)]  # fmt: skip
    out = torch.empty(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    sm = dim**-0.5
    cfg = {"config": config} if config else {}

    def ours_bf16(i):
        return paged_decode_bf16(q[i], k, v, case.tables[i], sm, max_seq_len=ctx, out=out, **cfg)

    def ours_fp8(i):
        return paged_decode_fp8(
            q[i], k8, v8, ks, vs, case.tables[i], sm, max_seq_len=ctx, out=out, **cfg
        )

    row = {"kind": "gqa", "batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads,
           "dim": dim, "page_size": page_size, "sets": case.sets}  # fmt: skip
    if config:
        row["config"] = asdict(config)
    row["ours_bf16_us"] = graph_time_us(ours_bf16, case.sets)
    row["ours_fp8_us"] = graph_time_us(ours_fp8, case.sets)
    kv_bytes_bf16 = batch * ctx * kv_heads * dim * 2 * 2
    kv_bytes_fp8 = batch * ctx * kv_heads * (dim * 2 + 2 * 4)
    row["ours_bf16_TBps"] = kv_bytes_bf16 / row["ours_bf16_us"] / 1e6
    row["ours_fp8_TBps"] = kv_bytes_fp8 / row["ours_fp8_us"] / 1e6
    row["ours_bf16_frac_copy_bw"] = row["ours_bf16_TBps"] * 1e12 / copy_bw
    row["fp8_vs_bf16"] = row["ours_bf16_us"] / row["ours_fp8_us"]
    if config:
        return row

    # torch SDPA over a contiguous BF16 cache: the same tokens gathered, [B, kv_heads, ctx, d]
    kc = [k.flatten(0, 1)[case.token_slots[s]].transpose(1, 2).contiguous()
          for s in range(case.sets)]  # fmt: skip
    vc = [v.flatten(0, 1)[case.token_slots[s]].transpose(1, 2).contiguous()
          for s in range(case.sets)]  # fmt: skip

    def sdpa(i):
        return F.scaled_dot_product_attention(
            q[i].unsqueeze(2), kc[i], vc[i], scale=sm, enable_gqa=True
        ).squeeze(2)

    row["sdpa_bf16_us"] = graph_time_us(sdpa, case.sets)
    ref = sdpa(0).clone()
    row["rel_l2_ours_bf16_vs_sdpa"] = rel_l2(ours_bf16(0), ref)
    fp8_out = ours_fp8(0)
    row["rel_l2_ours_fp8_vs_sdpa"] = rel_l2(fp8_out, ref)
    row["one_minus_cos_fp8"] = (
        1 - F.cosine_similarity(fp8_out.float().flatten(), ref.float().flatten(), dim=0).item()
    )
    row["fp8_vs_sdpa"] = row["sdpa_bf16_us"] / row["ours_fp8_us"]
    if sglang:
        logits = torch.empty(batch, heads, SGLANG_SPLITS, dim, device="cuda")
        lse = torch.empty(batch, heads, SGLANG_SPLITS, device="cuda")
        kb, vb = k.flatten(0, 1), v.flatten(0, 1)
        k8b, v8b = k8pt.flatten(0, 1), v8pt.flatten(0, 1)
        kscale, vscale = kspt.item(), vspt.item()

        def sg(i, kbuf, vbuf, k_scale, v_scale):
            sglang(q[i], kbuf, vbuf, out, case.sg_indptr, case.sg_indices[i], logits, lse,
                   case.sg_splits, SGLANG_SPLITS, sm * k_scale, v_scale)  # fmt: skip
            return out

        row["sglang_bf16_us"] = graph_time_us(lambda i: sg(i, kb, vb, 1.0, 1.0), case.sets)
        row["sglang_fp8_us"] = graph_time_us(lambda i: sg(i, k8b, v8b, kscale, vscale), case.sets)
        row["rel_l2_sglang_bf16_vs_sdpa"] = rel_l2(sg(0, kb, vb, 1.0, 1.0), ref)
        row["bf16_vs_sglang_bf16"] = row["sglang_bf16_us"] / row["ours_bf16_us"]
        row["fp8_vs_sglang_fp8"] = row["sglang_fp8_us"] / row["ours_fp8_us"]
    return row


def mla_reference(q, rows, slots, lens, sm, latent, requests=4):
    """Float64 MLA attention of the first ``requests`` requests over ``rows`` (float rows of
    ``latent`` + rope dims, flat slots), against which every kernel's output is checked."""
    out = []
    for r in range(min(requests, len(lens))):
        kv = rows[slots[r, : lens[r]]].double()  # [n, 576]
        p = (q[r].double() @ kv.T * sm).softmax(dim=-1)
        out.append(p @ kv[:, :latent])
    return torch.stack(out)


# set by --bound: the longest length ours are told of instead of the context (0: the context)
BOUND = 0


def with_table_bound(table: PageTable, tokens: int) -> PageTable:
    """``table`` with entries for ``tokens`` tokens (zeros past its own), so the bound on the
    batch's tokens the kernels read from it (``PageTable.max_tokens``) is ``tokens``."""
    entries = tokens * table.entries_per_page // table.page_size
    pad = max(entries - table.indices.numel(), 0)
    return replace(table, indices=torch.cat([table.indices, table.indices.new_zeros(pad)]))


def bench_mla(batch, ctx, heads, page_size, sglang, copy_bw, config=None, flashmla=None,
              lens=None, variants=None):  # fmt: skip
    """Ours (BF16, FP8 with a scale per token) against SGLang's Triton decode and FlashMLA
    (BF16, FP8 with one scale per tensor) on the same pages, tables and queries; ``lens`` gives
    each request's length (a mix), ``variants`` extra configs (name -> (dtype, config)) timed
    beside the defaults.
    Errors are rel-L2 against the float64 reference over the BF16 pages (``err_*``) and, for
    FP8, over that kernel's own dequantized pages (``err_*_vs_dequant``: the kernel's error
    alone), on the first requests of set 0."""
    latent, rope = 512, 64
    case = PagedCase(batch, ctx, 1, latent + rope, page_size, (latent + rope) * 2, lens=lens)
    ctx = case.ctx
    mixed = lens is not None
    kv = torch.randn(case.num_pages, page_size, 1, latent + rope, device="cuda").bfloat16()
    kv8, s8, kv8pt, s8pt = fp8_copies(kv)
    q = [torch.randn(batch, heads, latent + rope, device="cuda", dtype=torch.bfloat16)
         for _ in range(case.sets)]  # fmt: skip
    out = torch.empty(batch, heads, latent, device="cuda", dtype=torch.bfloat16)
    sm = (128 + rope) ** -0.5
    plan = {"max_seq_len": BOUND or ctx, "total_tokens": case.total_tokens if mixed else None}
    if BOUND:  # tables that address batch x BOUND tokens, as SGLang's graph buffers do
        case.tables = [with_table_bound(t, batch * BOUND) for t in case.tables]
    cfg = {"config": config} if config else {}

    def ours_bf16(i, c=cfg):
        return paged_decode_mla_bf16(q[i], kv, case.tables[i], sm, out=out, **plan, **c)

    def ours_fp8(i, c=cfg):
        return paged_decode_mla_fp8(q[i], kv8, s8, case.tables[i], sm, out=out, **plan, **c)

    row = {"kind": "mla", "batch": batch, "ctx": ctx, "heads": heads, "page_size": page_size,
           "sets": case.sets}  # fmt: skip
    if mixed:
        row["lens"] = "mix " + "/".join(str(n) for n in sorted(set(case.len_list)))
    if config:
        row["config"] = asdict(config)
    tokens = case.total_tokens
    if not mixed:  # equal lengths take the equal-parts plan: how much of the GPU it fills
        fp8_cfg = config or pick_config(latent, heads, True, fp8=True, tokens=tokens)
        row["fp8_split_plan_sm_share"] = split_plan_sm_share(fp8_cfg, batch, heads, BOUND or ctx,
                                                             num_sms(q[0].device))  # fmt: skip
    row["ours_bf16_us"] = graph_time_us(ours_bf16, case.sets)
    row["ours_fp8_us"] = graph_time_us(ours_fp8, case.sets)
    row["ours_bf16_TBps"] = tokens * (latent + rope) * 2 / row["ours_bf16_us"] / 1e6
    row["ours_fp8_TBps"] = tokens * (latent + rope + 4) / row["ours_fp8_us"] / 1e6
    row["ours_bf16_frac_copy_bw"] = row["ours_bf16_TBps"] * 1e12 / copy_bw
    row["fp8_vs_bf16"] = row["ours_bf16_us"] / row["ours_fp8_us"]
    if config:
        return row
    flat = kv.flatten(0, 1).squeeze(1)  # [slots, 576]
    slots0 = case.token_slots[0]
    ref = mla_reference(q[0], flat, slots0, case.len_list, sm, latent)
    n_ref = ref.shape[0]
    ref_tok = mla_reference(q[0], (kv8.float() * s8.unsqueeze(-1)).flatten(0, 1).squeeze(1),
                            slots0, case.len_list, sm, latent)  # fmt: skip
    ref_pt = mla_reference(q[0], kv8pt.float().flatten(0, 1).squeeze(1) * s8pt, slots0,
                           case.len_list, sm, latent)  # fmt: skip
    bf16_out = ours_bf16(0).clone()
    fp8_out = ours_fp8(0).clone()
    row["rel_l2_fp8_vs_bf16"] = rel_l2(fp8_out, bf16_out)
    row["err_ours_bf16"] = rel_l2(bf16_out[:n_ref], ref)
    row["err_ours_fp8"] = rel_l2(fp8_out[:n_ref], ref)
    row["err_ours_fp8_vs_dequant"] = rel_l2(fp8_out[:n_ref], ref_tok)
    runs = [(name, dt, vcfg) for name, (dtype, vcfg) in (variants or {}).items()
            for dt in (("bf16", "fp8") if dtype == "both" else (dtype,))]  # fmt: skip
    for name, dtype, vcfg in runs:
        call = ours_fp8 if dtype == "fp8" else ours_bf16
        try:
            timed = functools.partial(call, c={"config": vcfg})
            row[f"ours_{dtype}_{name}_us"] = graph_time_us(timed, case.sets)
            v_out = timed(0)[:n_ref]
            row[f"err_ours_{dtype}_{name}"] = rel_l2(v_out, ref)
            if dtype == "fp8":
                row[f"err_ours_fp8_{name}_vs_dequant"] = rel_l2(v_out, ref_tok)
        except Exception as e:  # one broken variant must not cost the others' numbers
            row[f"ours_{dtype}_{name}_error"] = repr(e)[:300]
    if flashmla is not None:
        try:
            _time_flashmla(row, flashmla, case, q, kv, kv8pt, s8pt, sm, latent, ref, ref_pt,
                           tokens)  # fmt: skip
        except Exception as e:  # recorded, not fatal: ours are still worth having
            row["flashmla_error"] = repr(e)[:300]
    if sglang and not mixed:
        logits = torch.empty(batch, heads, SGLANG_SPLITS, latent, device="cuda")
        lse = torch.empty(batch, heads, SGLANG_SPLITS, device="cuda")
        kb, k8b = kv.flatten(0, 1), kv8pt.flatten(0, 1)
        kscale = s8pt.item()

        def sg(i, kbuf, k_scale):
            sglang(q[i], kbuf, kbuf[..., :latent], out, case.sg_indptr, case.sg_indices[i],
                   logits, lse, case.sg_splits, SGLANG_SPLITS, sm * k_scale, k_scale)  # fmt: skip
            return out

        row["sglang_bf16_us"] = graph_time_us(lambda i: sg(i, kb, 1.0), case.sets)
        row["sglang_fp8_us"] = graph_time_us(lambda i: sg(i, k8b, kscale), case.sets)
        row["rel_l2_sglang_bf16_vs_ours_bf16"] = rel_l2(sg(0, kb, 1.0), bf16_out)
        row["bf16_vs_sglang_bf16"] = row["sglang_bf16_us"] / row["ours_bf16_us"]
        row["fp8_vs_sglang_fp8"] = row["sglang_fp8_us"] / row["ours_fp8_us"]
    return row


def _time_flashmla(row, flashmla, case, q, kv, kv8pt, s8pt, sm, latent, ref, ref_pt, tokens):
    """FlashMLA BF16 and FP8 (one scale per tensor, q cast to e4m3 with scale 1, as SGLang's
    flashmla backend calls it: ``flashmla_peer.py``) on the bench's pages and tables, into
    ``row``."""
    n_ref = ref.shape[0]
    bf16_calls = [flashmla_decode(flashmla, q[i], kv, case.block_tables[i], case.lens, latent, sm)
                  for i in range(case.sets)]  # fmt: skip
    fp8_calls = [flashmla_decode(flashmla, q[i], kv8pt, case.block_tables[i], case.lens, latent,
                                 sm, s8pt) for i in range(case.sets)]  # fmt: skip

    def fm_bf16(i):
        return bf16_calls[i]()

    def fm_fp8(i):
        return fp8_calls[i]()

    row["flashmla_bf16_us"] = graph_time_us(fm_bf16, case.sets)
    row["flashmla_fp8_us"] = graph_time_us(fm_fp8, case.sets)
    fb = fm_bf16(0)[:n_ref]
    f8 = fm_fp8(0)[:n_ref]
    row["err_flashmla_bf16"] = rel_l2(fb, ref)
    row["err_flashmla_fp8"] = rel_l2(f8, ref)
    row["err_flashmla_fp8_vs_dequant"] = rel_l2(f8, ref_pt)
    row["flashmla_fp8_TBps"] = tokens * kv.shape[-1] / row["flashmla_fp8_us"] / 1e6
    row["bf16_vs_flashmla_bf16"] = row["flashmla_bf16_us"] / row["ours_bf16_us"]
    row["fp8_vs_flashmla_fp8"] = row["flashmla_fp8_us"] / row["ours_fp8_us"]
    row["flashmla_fp8_vs_bf16"] = row["flashmla_bf16_us"] / row["flashmla_fp8_us"]


def bench_write(tokens, kv_heads, dim):
    slots_total = 16 * tokens
    rows = torch.empty(slots_total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    rows8 = torch.empty(slots_total, kv_heads, dim, device="cuda", dtype=FP8_DTYPE)
    scales = torch.empty(slots_total, kv_heads, device="cuda")
    one = torch.tensor(1.0, device="cuda")
    sets = 8
    new = [torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
           for _ in range(sets)]  # fmt: skip
    slots = [torch.randperm(slots_total, device="cuda")[:tokens] for _ in range(sets)]

    def store_bf16(i):
        rows[slots[i]] = new[i]

    row = {"kind": "write", "tokens": tokens, "kv_heads": kv_heads, "dim": dim}
    row["bf16_store_us"] = graph_time_us(store_bf16, sets)
    row["fp8_write_token_head_us"] = graph_time_us(
        lambda i: write_kv_fp8(new[i], rows8, scales, slots[i]), sets
    )
    row["fp8_write_per_tensor_us"] = graph_time_us(
        lambda i: write_kv_fp8(new[i], rows8, one, slots[i]), sets
    )
    row["fp8_vs_bf16_store_time"] = row["fp8_write_token_head_us"] / row["bf16_store_us"]
    return row


def bench_convert(pages, page_size, kv_heads, dim, copy_bw):
    src = torch.randn(2 * pages, page_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty(2 * pages, page_size, kv_heads, dim, device="cuda", dtype=FP8_DTYPE)
    scale = torch.empty(2 * pages, page_size, kv_heads, device="cuda")
    src_pages = [torch.randperm(2 * pages, device="cuda")[:pages] for _ in range(2)]
    dst_pages = [torch.randperm(2 * pages, device="cuda")[:pages] for _ in range(2)]
    t = graph_time_us(
        lambda i: convert_pages_bf16_to_fp8(src, dst, scale, src_pages[i], dst_pages[i]), 2
    )
    moved = pages * page_size * kv_heads * (dim * 3 + 4)
    return {"kind": "convert", "pages": pages, "page_size": page_size, "kv_heads": kv_heads,
            "dim": dim, "us": t, "TBps": moved / t / 1e6,
            "frac_copy_bw": moved / t / 1e6 * 1e12 / copy_bw}  # fmt: skip


# Kernel variants timed side by side by --variants (name -> config; None = the default, which
# differs by dtype for MLA). The first --variants run (fp8_kv_variants.json) chose the defaults.
MLA_VARIANTS = {
    "default": None,
    "old": DecodeConfig(32, 16, 4, 2),
    "q_pps3": DecodeConfig(32, 16, 4, 2, latent_quarters=True, programs_per_sm=3),
    "q_waves4": DecodeConfig(32, 16, 4, 2, True, 4, whole_waves=True),
    "q_waves2": DecodeConfig(32, 16, 4, 2, True, 2, whole_waves=True),
    "q_r168_waves3": DecodeConfig(32, 16, 4, 2, True, 3, whole_waves=True, max_registers=168),
    "q_bn64_waves2": DecodeConfig(64, 16, 4, 2, True, 2, whole_waves=True),
}
MLA_WIDE_VARIANTS = {  # 64+ heads: fewer programs re-reading each tile
    "default": None,
    "old": DecodeConfig(32, 16, 4, 2),
    "q_h64_w8": DecodeConfig(32, 64, 8, 2, latent_quarters=True),
    "q_h64_w8_waves1": DecodeConfig(32, 64, 8, 2, True, 1, whole_waves=True),
}
GQA_VARIANTS = {"default": None}

# --mla-peers: kernel variants timed beside the defaults and the peers (name -> (dtype, config)).
# "t_*": the transposed kernel (tokens the MMA's M, heads its N); qkN/pvN: e4m3 products with
# N e4m3 parts per operand (q, p); without pv the V tile is widened to fp16. The first run
# (fp8_kv_flashmla_variants.json) also timed 8 warps for "t", e4m3 PV products (pv1, pv2: 2x
# slower, the e4m3 V transposed byte by byte) and an fp16 V in the transposed kernel (2.4x
# slower): all lost, and are not timed again.
LONG_SPLITS = {field: getattr(DecodeConfig, field) for field in SHORT_SPLITS}  # the defaults
MLA_PEER_VARIANTS = {
    "t": ("bf16", DecodeConfig(64, 16, 4, 2, True, 3, whole_waves=True, tokens_as_m=True)),
    "t_qk2": (
        "fp8",
        DecodeConfig(64, 16, 4, 2, True, 2, whole_waves=True, qk_fp8_parts=2, tokens_as_m=True),
    ),
    # the FP8 kernels the default picks between by the batch's tokens
    # (E4M3_IN_PLACE_MIN_TOKENS, E4M3_MIN_TOKENS), each timed everywhere: the Triton one (what
    # runs off Hopper), the Gluon one that widens each tile to fp16, and the Gluon ones
    # with both products in e4m3 (q and p in two e4m3 parts; V^T an MMA operand in registers,
    # on 64- or 128-token tiles, or written over each tile's latent part by the producer)
    "triton": ("fp8", MLA_FP8_TRITON),
    "wgmma": ("fp8", MLA_FP8_WGMMA),
    "e4m3": ("fp8", MLA_FP8_E4M3),
    "e4m3_128": ("fp8", MLA_FP8_E4M3_128),
    # the 64- and 128-token ones with the query written by the consumer while the producer
    # starts copying tiles
    "e4m3_q_in_consumer": ("fp8", MLA_FP8_E4M3_Q_IN_CONSUMER),
    "e4m3_128_q_in_consumer": ("fp8", replace(MLA_FP8_E4M3_128, q_in_consumer=True)),
    "e4m3_in_place": ("fp8", MLA_FP8_E4M3_IN_PLACE),
    # the 128-token one on equal-parts plans of two and three waves of one program an SM, where
    # one wave leaves SMs idle at batch sizes that do not divide the SM count (the plan's
    # ``programs_per_sm`` is its waves: the kernel holds one program an SM)
    "e4m3_128_two_waves": ("fp8", replace(MLA_FP8_E4M3_128, programs_per_sm=2)),
    "e4m3_128_three_waves": ("fp8", replace(MLA_FP8_E4M3_128, programs_per_sm=3)),
    # the token cap kept by more splits where the lengths are unknown, not by pieces of each
    "e4m3_128_capped_by_splits": ("fp8", replace(MLA_FP8_E4M3_128, split_tokens_capped=True)),
    # the register one on the stream schedule (mla_stream.py): one program an SM, each an equal
    # run of the batch's tiles across requests
    "e4m3_stream": ("fp8", MLA_FP8_E4M3_STREAM),
    "e4m3_stream_two_waves": ("fp8", replace(MLA_FP8_E4M3_STREAM, balanced_waves=2)),
    "e4m3_stream_producer_only": ("fp8", replace(MLA_FP8_E4M3_STREAM, only=1)),
    "e4m3_stream_consumer_only": ("fp8", replace(MLA_FP8_E4M3_STREAM, only=2)),
    # the register one without its cap on a split's tokens (E4M3_MAX_SPLIT_TOKENS): faster on
    # long splits, less accurate (bench/results/fp8_kv_e4m3_split_cap.json)
    "e4m3_no_split_cap": ("fp8", replace(MLA_FP8_E4M3, max_split_tokens=0)),
    # (both e4m3 kernels with one-wave balanced plans were timed on the quick grid and lost on
    # the mixes, 0.82-0.99x, tied on equal lengths: fp8_kv_flashmla_one_wave_quick.json)
    "e4m3_producer_only": ("fp8", replace(MLA_FP8_E4M3, only=1)),
    "e4m3_consumer_only": ("fp8", replace(MLA_FP8_E4M3, only=2)),
    # the register one on 128-token tiles, each side alone
    "e4m3_128_producer_only": ("fp8", replace(MLA_FP8_E4M3_128, only=1)),
    "e4m3_128_consumer_only": ("fp8", replace(MLA_FP8_E4M3_128, only=2)),
    # the mixes (balanced splits): the Gluon kernel's splits always planned for one wave, beside
    # the default's one or two (plan_balanced_waves)
    "wgmma_one_wave": ("fp8", replace(MLA_FP8_WGMMA, balanced_waves=1)),
    # the Gluon kernel with splits planned for two programs an SM (one fits): shorter splits,
    # a second wave; the evidence for MLA_FP8_WGMMA.balanced_waves (faster on the mixes,
    # slower on equal lengths)
    "wgmma_pps2": ("fp8", DecodeConfig(64, 16, 4, 1, True, 2, whole_waves=True, wgmma=True)),
    # each side of the Gluon kernel alone (the other only hands buffers over; outputs are
    # meaningless): the producer's loads and widening, the consumer's products and softmax
    "wgmma_producer_only": ("fp8", replace(MLA_FP8_WGMMA, only=1)),
    "wgmma_consumer_only": ("fp8", replace(MLA_FP8_WGMMA, only=2)),
    # the 16-heads kernels on the split plans before SHORT_SPLITS (four tiles a split at least,
    # 64 splits at most, the serial merge), and the Triton FP8 kernel below 4,096 tokens then
    "bf16_long_splits": ("bf16", replace(pick_config(512, 16, mla=True), **LONG_SPLITS)),
    "wgmma_long_splits": ("fp8", replace(MLA_FP8_WGMMA, **LONG_SPLITS)),
    "e4m3_in_place_long_splits": ("fp8", replace(MLA_FP8_E4M3_IN_PLACE, **LONG_SPLITS)),
    "e4m3_128_long_splits": ("fp8", replace(MLA_FP8_E4M3_128, **LONG_SPLITS)),
}
MLA_WIDE_PEER_VARIANTS = {  # 64+ heads; the default is the Gluon heads-as-M kernel
    # the Triton 64-heads kernel: the default before the Gluon one, and what runs off Hopper
    "triton64": ("both", MLA_HEADS_TRITON),
    # the transposed Triton kernel, 64 heads a program: the BF16 default from 16k tokens before
    "t64": ("bf16", DecodeConfig(64, 64, 8, 2, True, 1, whole_waves=True, tokens_as_m=True)),
    # the mixes: splits planned for two waves where one wave's plan overflows
    "heads_m_2w": ("both", replace(MLA_HEADS_M, balanced_waves=2)),
    # the kernel on split plans and on the stream schedule (mla_stream.py), each timed
    # everywhere: the default takes the stream where the lengths are known to be uneven
    "heads_m": ("both", MLA_HEADS_M),
    "heads_m_stream": ("both", MLA_HEADS_M_STREAM),
}


def mla_peer_grid(quick: bool) -> list[tuple[int, int, int, tuple[int, ...] | None, bool]]:
    """(heads, batch, ctx, lens or None, with variants): first the shapes the targets name (with
    the variants), then 8/16/64/128 heads over batch 1-256 and context 1k-32k, and the decode
    slice's mix of lengths (bench/decode_slice_plan.py's CONTEXT_MIX)."""
    mix = CONTEXT_MIX
    named = [
        (16, 64, 4096, None),
        (16, 64, 16384, None),
        (16, 128, 8192, None),
        (8, 256, 2048, None),
        (8, 64, 16384, None),
        (16, 32, 8192, None),
        (64, 32, 4096, None),
        (128, 32, 4096, None),
        (16, 64, 0, mix),
        (8, 64, 0, mix),
        (16, 256, 0, mix),
    ]
    grid = [(*shape, True) for shape in named]  # fmt: skip
    if quick:
        return grid[:3] + grid[7:]
    for heads in (16, 8):
        for batch in (1, 8, 32, 64, 128, 256):
            for ctx in (1024, 4096, 8192, 16384, 32768):
                if batch * ctx <= 256 * 8192 and (heads == 16 or batch >= 32):
                    grid.append((heads, batch, ctx, None, False))
    for heads in (64, 128):
        for batch in (1, 8, 32, 64):
            for ctx in (1024, 4096, 16384):
                grid.append((heads, batch, ctx, None, False))
    for heads in (8, 16, 64, 128):
        for batch in (16, 32, 64, 256) if heads <= 16 else (16, 64):
            grid.append((heads, batch, 0, mix, False))
    seen, unique = set(), []
    for entry in grid:
        if entry[:4] not in seen:
            seen.add(entry[:4])
            unique.append(entry)
    return unique


def mla_peers(copy_bw, flashmla, sglang, quick, add, min_heads=0, only=(), shapes=()) -> None:
    grid = [(*shape, True) for shape in shapes] or mla_peer_grid(quick)
    for heads, batch, ctx, mix, named in grid:
        if heads < min_heads:
            continue
        lens = [mix[i % len(mix)] for i in range(batch)] if mix else None
        table = MLA_PEER_VARIANTS if heads <= 16 else MLA_WIDE_PEER_VARIANTS
        if only:  # a side-by-side run of a few variants
            table = {k: v for k, v in table.items() if k in only}
        if not named:  # everywhere: the kernels the defaults choose between or replaced (both
            # FP8 kernels at 8-16 heads, the Triton 64-heads one); on the mixes the other wave
            # plan too; the rest only on the named shapes
            keep = ("triton", "wgmma", "e4m3", "e4m3_128", "e4m3_in_place", "e4m3_stream",
                    "e4m3_q_in_consumer", "triton64", "heads_m", "heads_m_stream")
            keep += ("wgmma_one_wave", "heads_m_2w") if mix else ()
            table = {k: v for k, v in table.items() if k in keep}
        try:
            row = bench_mla(batch, ctx, heads, 64, sglang, copy_bw, flashmla=flashmla,
                            lens=lens, variants=table)  # fmt: skip
        except Exception as e:  # a failing shape must not cost the rest of the grid
            print(f"mla h{heads} B{batch} ctx{ctx}: FAILED {e!r}"[:300], flush=True)
            continue
        add(row, _peer_line)
        torch.cuda.empty_cache()


def _peer_line(r):
    lens = r.get("lens", f"ctx{r['ctx']}")
    best = {k[:-3]: v for k, v in r.items()  # a side alone computes nothing: not a candidate
            if k.startswith("ours_fp8_") and k.endswith("_us") and "_only" not in k}
    top = min(best, key=best.get)
    fm = (f" | FlashMLA bf16 {r['flashmla_bf16_us']:7.1f} fp8 {r['flashmla_fp8_us']:7.1f}"
          f" (err {r['err_flashmla_fp8']:.1e}) | ours/FM bf16 x{r['bf16_vs_flashmla_bf16']:.2f}"
          f" fp8 x{r['fp8_vs_flashmla_fp8']:.2f} best-fp8 x{r['flashmla_fp8_us'] / best[top]:.2f}"
          if "flashmla_fp8_us" in r else "")  # fmt: skip
    return (f"mla h{r['heads']:3d} B{r['batch']:3d} {lens:>16s}: bf16 {r['ours_bf16_us']:7.1f}us"
            f" fp8 {r['ours_fp8_us']:7.1f}us (err {r['err_ours_fp8']:.1e}) fastest fp8 "
            f"{top[9:] or 'default'} {best[top]:7.1f}{fm}")  # fmt: skip


def _check_variant(kind, config, heads):
    """rel-L2 and max error of a variant against the float64 reference: odd lengths, page 16,
    fresh data (BF16 and FP8 kernels each against attention over their own cache)."""
    lens = [2999, 1, 777, 1500, 64]
    page = 16
    counts = [math.ceil(n / page) for n in lens]
    perm = torch.randperm(sum(counts) + 2).tolist()
    pages, at = [], 0
    for c in counts:
        pages.append(perm[at : at + c])
        at += c
    table = PageTable.from_page_lists(pages, lens, page, "cuda")
    num_pages = len(perm)
    res = {}

    def err(out, ref):
        return {"rel_l2": rel_l2(out, ref), "max_abs": (out.float() - ref).abs().max().item(),
                "finite": bool(out.isfinite().all())}  # fmt: skip

    def quant(rows):
        cache = torch.empty(rows.shape, dtype=FP8_DTYPE, device="cuda")
        scale = torch.empty(rows.shape[:-1], device="cuda")
        write_kv_fp8_ref(rows.flatten(0, 1), cache, scale, torch.arange(rows.shape[0] * page,
                         device="cuda"))  # fmt: skip
        return cache, scale

    nan = float("nan")
    if kind == "mla":
        q = torch.randn(len(lens), heads, 576, device="cuda").bfloat16()
        kv = torch.randn(num_pages, page, 1, 576, device="cuda").bfloat16()
        sm = 192**-0.5
        out = torch.full((len(lens), heads, 512), nan, device="cuda", dtype=torch.bfloat16)
        paged_decode_mla_bf16(q, kv, table, sm, out=out, config=config)
        res["bf16"] = err(out, paged_decode_mla_bf16_ref(q, kv, table, sm))
        kv8, s8 = quant(kv)
        out.fill_(nan)
        paged_decode_mla_fp8(q, kv8, s8, table, sm, out=out, config=config)
        res["fp8"] = err(out, paged_decode_mla_fp8_ref(q, kv8, s8, table, sm))
    else:
        q = torch.randn(len(lens), heads, 128, device="cuda").bfloat16()
        k, v = (torch.randn(num_pages, page, 8, 128, device="cuda").bfloat16() for _ in "kv")
        out = torch.full((len(lens), heads, 128), nan, device="cuda", dtype=torch.bfloat16)
        paged_decode_bf16(q, k, v, table, 128**-0.5, out=out, config=config)
        res["bf16"] = err(out, paged_decode_bf16_ref(q, k, v, table, 128**-0.5))
        (k8, ks), (v8, vs) = quant(k), quant(v)
        out.fill_(nan)
        paged_decode_fp8(q, k8, v8, ks, vs, table, 128**-0.5, out=out, config=config)
        res["fp8"] = err(out, paged_decode_fp8_ref(q, k8, v8, ks, vs, table, 128**-0.5))
    return res


def variants(copy_bw) -> list[dict]:
    """Each variant on the same shapes (MLA 16 heads at 4k/16k and 64 heads at 4k, batch 64;
    GQA 32/8 d128 at 4k/16k), plus its accuracy check."""
    rows = []
    shapes = [
        ("mla", 64, 4096, 16, MLA_VARIANTS),
        ("mla", 64, 16384, 16, MLA_VARIANTS),
        ("mla", 8, 8192, 16, MLA_VARIANTS),
        ("mla", 64, 4096, 64, MLA_WIDE_VARIANTS),
        ("gqa", 64, 4096, 32, GQA_VARIANTS),
        ("gqa", 64, 16384, 32, GQA_VARIANTS),
    ]
    checked = set()
    for kind, batch, ctx, heads, table in shapes:
        for name, cfg in table.items():
            try:
                if kind == "mla":
                    r = bench_mla(batch, ctx, heads, 64, None, copy_bw, config=cfg)
                else:
                    r = bench_gqa(batch, ctx, heads, 8, 128, 64, None, copy_bw, config=cfg)
                r["variant"] = name
                key = (kind, heads, cfg)
                if key not in checked:
                    checked.add(key)
                    r["check"] = _check_variant(kind, cfg, heads)
            except Exception as e:  # one broken variant must not cost the others' numbers
                print(f"var {kind} h{heads} ctx{ctx} {name}: FAILED {e!r}"[:300], flush=True)
                continue
            rows.append(r)
            print(_variant_line(r), flush=True)
    return rows


def _variant_line(r):
    chk = r.get("check")
    acc = (f" | err bf16 {chk['bf16']['rel_l2']:.1e} fp8 {chk['fp8']['rel_l2']:.1e}"
           if chk else "")  # fmt: skip
    return (f"var {r['kind']} h{r['heads']:3d} B{r['batch']:3d} ctx{r['ctx']:6d} "
            f"{r['variant']:14s}: bf16 {r['ours_bf16_us']:8.1f}us "
            f"({r['ours_bf16_frac_copy_bw']:.2f} copy) fp8 {r['ours_fp8_us']:8.1f}us "
            f"({r['ours_fp8_TBps']:.2f} TB/s) x{r['fp8_vs_bf16']:.2f}{acc}")  # fmt: skip


def tune(copy_bw) -> list[dict]:
    rows = []
    gqa = [DecodeConfig(bn, 16, w, s) for bn, w, s in (
        (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3), (256, 4, 3),
        (256, 8, 3), (32, 4, 3))]  # fmt: skip
    for ctx in (4096, 16384):
        for c in gqa:
            rows.append(bench_gqa(64, ctx, 32, 8, 128, 64, None, copy_bw, config=c))
            print(_tune_line(rows[-1]), flush=True)
    mla = [DecodeConfig(bn, bh, w, s) for bn, bh, w, s in (
        (32, 16, 4, 2), (64, 16, 4, 2), (32, 16, 4, 3), (64, 16, 8, 2), (16, 16, 4, 2),
        (32, 16, 8, 2))]  # fmt: skip
    for heads in (16, 64):
        for c in mla:
            rows.append(bench_mla(64, 8192, heads, 64, None, copy_bw, config=c))
            print(_tune_line(rows[-1]), flush=True)
    return rows


def _tune_line(r):
    c = r["config"]
    return (f"tune {r['kind']} h{r['heads']:3d} ctx{r['ctx']:6d} bn{c['block_n']:4d} "
            f"bh{c['block_h']:3d} w{c['num_warps']} s{c['num_stages']}: "
            f"bf16 {r['ours_bf16_us']:8.1f}us ({r['ours_bf16_frac_copy_bw']:.2f} of copy) "
            f"fp8 {r['ours_fp8_us']:8.1f}us  x{r['fp8_vs_bf16']:.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs instead")
    ap.add_argument("--variants", action="store_true", help="time kernel variants instead")
    ap.add_argument(
        "--mla-peers",
        action="store_true",
        help="MLA only: ours (and variants) against FlashMLA and SGLang's Triton",
    )
    ap.add_argument(
        "--flashmla",
        action="store_true",
        help="time FlashMLA (the sgl-flash-mla wheel's legacy SM90 dense kernels)",
    )
    ap.add_argument("--min-heads", type=int, default=0,
                    help="--mla-peers: only the shapes of at least this many heads")  # fmt: skip
    ap.add_argument("--only", default="",
                    help="--mla-peers: only these variants (comma-separated) beside the defaults")
    ap.add_argument("--shapes", default="",
                    help="--mla-peers: these HEADSxBATCHxCONTEXT shapes (comma-separated; "
                         "CONTEXT 'mix': the decode slice's mix of lengths) instead of the "
                         "grid")  # fmt: skip
    ap.add_argument("--bound", type=int, default=0,
                    help="--mla-peers: tell ours the longest length is this (and the tables "
                         "address batch x this many tokens), as SGLang's adapter does under "
                         "CUDA graphs with the context length; FlashMLA is unchanged")  # fmt: skip
    ap.add_argument("--sglang-kernel", type=Path, help="SGLang's decode_attention.py")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--commit", default="", help="the tree's commit, recorded in the results")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "driver": subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip(),
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": args.commit or None,
        "command": _command_line(args), "copy_bw_TBps": copy_bw / 1e12,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tune:
        rows = tune(copy_bw)
        (args.out / "fp8_kv_tune.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        return
    if args.variants:
        rows = variants(copy_bw)
        (args.out / "fp8_kv_variants.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print("\n".join(_variant_line(r) for r in rows))
        return
    sglang = load_sglang_decode(args.sglang_kernel) if args.sglang_kernel else None
    flashmla = importlib.import_module("flash_mla") if args.flashmla else None

    rows = []
    name = "fp8_kv_flashmla" if args.mla_peers else "fp8_kv_decode"
    if args.mla_peers and args.min_heads:
        name += f"_from{args.min_heads}heads"
    if args.mla_peers and args.shapes:
        name += "_shapes"
    if args.bound:
        global BOUND
        BOUND = args.bound
        name += f"_bound{args.bound}"
    out_file = args.out / (f"{name}_quick.json" if args.quick else f"{name}.json")

    def add(row, line):  # saved after every row: a run cut short keeps what it measured
        rows.append(row)
        out_file.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(line(row), flush=True)

    if args.mla_peers:
        only = tuple(filter(None, args.only.split(",")))
        shapes = [_shape(s) for s in filter(None, args.shapes.split(","))]
        mla_peers(copy_bw, flashmla, sglang, args.quick, add, args.min_heads, only, shapes)
        print("\n".join(_peer_line(r) for r in rows))
        return
    mla_grid = [(64, 8192, 16), (64, 4096, 64)]
    if not args.quick:
        mla_grid = [(64, 4096, 16), (64, 16384, 16), (8, 8192, 16), (64, 4096, 64), (64, 4096, 128)]
    for batch, ctx, heads in mla_grid:  # MLA first: the models this serves are MLA
        add(bench_mla(batch, ctx, heads, 64, sglang, copy_bw, flashmla=flashmla), _mla_line)
    if args.quick:
        gqa_grid = [(64, 64, 4096), (64, 64, 16384), (64, 8, 1024), (64, 1, 256)]
    else:
        gqa_grid = [
            (64, b, c)
            for b in (1, 8, 32, 64, 128)
            for c in (256, 1024, 4096, 16384, 32768)
            if b * c <= 64 * 32768
        ]
        gqa_grid += [(16, b, c) for b in (8, 64) for c in (1024, 4096, 16384)]
    for page_size, batch, ctx in gqa_grid:
        add(bench_gqa(batch, ctx, 32, 8, 128, page_size, sglang, copy_bw), _gqa_line)
    for heads, kvh, dim in ((64, 8, 128), (16, 4, 64), (8, 2, 256)):
        add(bench_gqa(64, 8192, heads, kvh, dim, 64, sglang, copy_bw), _gqa_line)
    for tokens in (64, 1024, 8192):
        for kvh, dim in ((8, 128), (1, 576)):
            add(bench_write(tokens, kvh, dim), _write_line)
    add(bench_convert(2048, 64, 8, 128, copy_bw), _convert_line)
    print("\n".join([f"copy bandwidth {copy_bw / 1e12:.2f} TB/s"]
                    + [_gqa_line(r) if r["kind"] == "gqa" else _mla_line(r)
                       for r in rows if r["kind"] in ("gqa", "mla")]))  # fmt: skip


def _shape(text: str) -> tuple[int, int, int, tuple[int, ...] | None]:
    """``HEADSxBATCHxCONTEXT`` -> (heads, batch, context, None); CONTEXT ``mix`` -> (heads,
    batch, 0, the decode slice's mix of lengths)."""
    heads, batch, ctx = text.split("x", 2)
    if ctx == "mix":
        return int(heads), int(batch), 0, CONTEXT_MIX
    return int(heads), int(batch), int(ctx), None


def _write_line(r):
    return (f"write {r['tokens']:5d} tok {r['kv_heads']}x{r['dim']}: bf16 store "
            f"{r['bf16_store_us']:7.1f}us fp8 {r['fp8_write_token_head_us']:7.1f}us (per tensor "
            f"{r['fp8_write_per_tensor_us']:7.1f}us)  x{r['fp8_vs_bf16_store_time']:.2f}"
            " of bf16 time")  # fmt: skip


def _convert_line(r):
    return (
        f"convert {r['pages']} pages of {r['page_size']}x{r['kv_heads']}x{r['dim']}: "
        f"{r['us']:.1f}us {r['TBps']:.2f} TB/s ({r['frac_copy_bw']:.2f} of copy)"
    )


def _command_line(args) -> str:
    """The command as run, without this machine's paths: files inside the repository relative to
    it, the output folder as OUT_DIR."""
    repo = Path(__file__).resolve().parent.parent
    words = ["python", "bench/fp8_kv_decode.py"]
    flags = ("quick", "tune", "variants", "mla_peers", "flashmla")
    words += [f"--{flag.replace('_', '-')}" for flag in flags if getattr(args, flag)]
    if args.min_heads:
        words += ["--min-heads", str(args.min_heads)]
    if args.only:
        words += ["--only", args.only]
    if args.shapes:
        words += ["--shapes", args.shapes]
    if args.bound:
        words += ["--bound", str(args.bound)]
    if args.sglang_kernel:
        path = args.sglang_kernel.resolve()
        shown = path.relative_to(repo) if path.is_relative_to(repo) else path.name
        words += ["--sglang-kernel", str(shown)]
    return " ".join(words + ["--out", "OUT_DIR"])


def _gqa_line(r):
    sg = (f" sglang bf16 {r['sglang_bf16_us']:7.1f} fp8 {r['sglang_fp8_us']:7.1f}"
          f" | ours/sg bf16 x{r['bf16_vs_sglang_bf16']:.2f} fp8 x{r['fp8_vs_sglang_fp8']:.2f}"
          if "sglang_bf16_us" in r else "")  # fmt: skip
    return (f"gqa {r['heads']}/{r['kv_heads']} d{r['dim']} P{r['page_size']:2d} "
            f"B{r['batch']:3d} ctx{r['ctx']:6d}: bf16 {r['ours_bf16_us']:7.1f}us "
            f"({r['ours_bf16_frac_copy_bw']:.2f} copy) fp8 {r['ours_fp8_us']:7.1f}us "
            f"x{r['fp8_vs_bf16']:.2f} | sdpa {r['sdpa_bf16_us']:7.1f} x{r['fp8_vs_sdpa']:.2f}"
            f"{sg} | err {r['rel_l2_ours_fp8_vs_sdpa']:.3f}")  # fmt: skip


def _mla_line(r):
    sg = (f" sglang bf16 {r['sglang_bf16_us']:7.1f} fp8 {r['sglang_fp8_us']:7.1f}"
          f" | ours/sg bf16 x{r['bf16_vs_sglang_bf16']:.2f} fp8 x{r['fp8_vs_sglang_fp8']:.2f}"
          if "sglang_bf16_us" in r else "")  # fmt: skip
    return (f"mla h{r['heads']:3d} P{r['page_size']} B{r['batch']:3d} ctx{r['ctx']:6d}: "
            f"bf16 {r['ours_bf16_us']:7.1f}us ({r['ours_bf16_frac_copy_bw']:.2f} copy) "
            f"fp8 {r['ours_fp8_us']:7.1f}us x{r['fp8_vs_bf16']:.2f}{sg} "
            f"| err {r['rel_l2_fp8_vs_bf16']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
