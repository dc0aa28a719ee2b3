"""Paged decode over mixed context lengths: each request split in equal parts (the plan without
the batch's total) against every split holding the same tokens (``total_tokens`` given).

The decode slice's requests hold 1k, 2k, 4k and 8k tokens in turn; with the context split into
the same number of parts per request, the 8k requests' programs run 8x longer than the 1k ones
and the kernel waits for them. Both plans run side by side in one process on the same cache,
table and queries; outputs are compared with each other.

    python bench/decode_split_balance.py [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
from accuracy import rel_l2
from decode_slice_plan import CONTEXT_MIX, PAGE_SIZE, context_lengths, pages_for
from tessera.kernels.paged_decode_bf16 import paged_decode_bf16, paged_decode_mla_bf16
from tessera.kernels.paged_decode_fp8 import paged_decode_fp8, paged_decode_mla_fp8
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable
from timing import graph_time_us

# (kind, query heads, kv heads, head dim, batch): MLA at the 8 and 16 heads a GPU holds at TP 8
# and TP 4 (GLM 5's slice reaches 205 requests with FP8 KV), one GQA shape
CASES = [("mla", 8, 1, 576, b) for b in (32, 64, 114, 128, 205)]
CASES += [("mla", 16, 1, 576, 64), ("gqa", 32, 8, 128, 64)]


def mixed_table(batch: int, device: str) -> tuple[PageTable, list[int], int]:
    lengths = context_lengths(batch)
    need = [pages_for(n) for n in lengths]
    order = torch.randperm(sum(need)).tolist()  # pages shuffled, as after churn
    pages, at = [], 0
    for n in need:
        pages.append(order[at : at + n])
        at += n
    return PageTable.from_page_lists(pages, lengths, PAGE_SIZE, device), lengths, sum(need)


def bench_case(kind: str, heads: int, kv_heads: int, dim: int, batch: int, kv: str) -> dict:
    table, lengths, num_pages = mixed_table(batch, "cuda")
    shape = (num_pages, PAGE_SIZE, kv_heads, dim)
    k = torch.randn(shape, device="cuda").bfloat16()
    v = k if kind == "mla" else torch.randn(shape, device="cuda").bfloat16()
    scales = None
    if kv == "fp8":
        k, v = (t.clamp(-448, 448).to(FP8_DTYPE) for t in (k, v))  # per-tensor scale 1
        scales = torch.ones((), device="cuda")
    dv = 512 if kind == "mla" else dim
    qs = [torch.randn(batch, heads, dim, device="cuda").bfloat16() for _ in range(4)]
    out = torch.empty(batch, heads, dv, device="cuda", dtype=torch.bfloat16)
    sm = (128 + 64) ** -0.5 if kind == "mla" else dim**-0.5
    known = {"equal_parts": {}, "balanced": {"total_tokens": sum(lengths)}}

    def call(i: int, plan: str) -> torch.Tensor:
        extra = {"max_seq_len": max(lengths), "out": out, **known[plan]}
        if kind == "mla" and scales is None:
            return paged_decode_mla_bf16(qs[i], k, table, sm, **extra)
        if kind == "mla":
            return paged_decode_mla_fp8(qs[i], k, scales, table, sm, **extra)
        if scales is None:
            return paged_decode_bf16(qs[i], k, v, table, sm, **extra)
        return paged_decode_fp8(qs[i], k, v, scales, scales, table, sm, **extra)

    row = {"kind": kind, "kv": kv, "heads": heads, "kv_heads": kv_heads, "dim": dim,
           "batch": batch, "tokens": sum(lengths)}  # fmt: skip
    outs = {plan: call(0, plan).clone() for plan in known}
    row["rel_l2_balanced_vs_equal_parts"] = rel_l2(outs["balanced"], outs["equal_parts"])
    for plan in known:
        row[f"{plan}_us"] = graph_time_us(lambda i, p=plan: call(i, p), len(qs))
    cache_bytes = sum(lengths) * kv_heads * dim * k.element_size() * (1 if kind == "mla" else 2)
    for plan in known:
        row[f"{plan}_TBps"] = cache_bytes / row[f"{plan}_us"] / 1e6
    row["speedup"] = row["equal_parts_us"] / row["balanced_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--commit", default="", help="the tree's commit, recorded in the results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    doc = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "commit": args.commit or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python bench/decode_split_balance.py",
        "context_mix": CONTEXT_MIX, "page_size": PAGE_SIZE,
        "timing": "median of CUDA-graph replays (bench/timing.py)", "rows": [],
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "decode_split_balance.json"
    for kind, heads, kv_heads, dim, batch in CASES:
        for kv in ("bf16", "fp8"):
            r = bench_case(kind, heads, kv_heads, dim, batch, kv)
            doc["rows"].append(r)
            path.write_text(json.dumps(doc, indent=1))  # after every row: a cut run keeps them
            print(f"{kind} h{heads} {kv:4s} b{batch:4d}: equal parts {r['equal_parts_us']:8.1f} us "
                  f"({r['equal_parts_TBps']:.2f} TB/s)  balanced {r['balanced_us']:8.1f} us "
                  f"({r['balanced_TBps']:.2f} TB/s)  x{r['speedup']:.2f}  "
                  f"rel {r['rel_l2_balanced_vs_equal_parts']:.1e}", flush=True)  # fmt: skip
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
