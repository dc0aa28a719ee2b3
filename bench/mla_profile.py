"""One MLA decode shape for the profiler: ours BF16 and FP8 (the default configs; up to 16 heads
also FP8 in the Triton kernel that runs off Hopper, each side of the widening Gluon FP8 kernel
alone, the e4m3 one on 64-token tiles whole and by side, and on 128-token tiles by side,
from 64 heads both dtypes in the Triton 64-heads kernel that runs off Hopper) and FlashMLA's
BF16 and FP8 kernels, each launched twice on the same pages (the first launch compiles and
warms up).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats -k regex:"mla|flash|merge" --csv \\
        python bench/mla_profile.py [HEADS BATCH CTX] [--variants NAME,...] [--bound N]

The profile of the second launch of each kernel is the one to read; bench/results holds one.
``--variants`` launches only those FP8 variants of ``fp8_kv_decode.py`` (say, two plans of one
kernel), ``--bound`` tells ours a longest length of N tokens, as SGLang's CUDA graphs do.
(``merge`` in the filter adds our stage 2, the merge of the splits' partial outputs, beside
FlashMLA's combine kernel.)
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace

import torch
from flashmla_peer import flashmla_decode
from fp8_kv_decode import MLA_PEER_VARIANTS, PagedCase, fp8_copies, with_table_bound
from tessera.kernels.paged_decode_bf16 import paged_decode_mla_bf16
from tessera.kernels.paged_decode_fp8 import paged_decode_mla_fp8
from tessera.kernels.paged_decode_split import (
    MLA_FP8_E4M3,
    MLA_FP8_E4M3_128,
    MLA_FP8_TRITON,
    MLA_FP8_WGMMA,
    MLA_HEADS_TRITON,
)

# the Gluon kernels' sides alone (the other only hands buffers over): which side bounds them;
# the widening kernel's, the e4m3 one on 64-token tiles whole and by side, and on 128-token
# tiles (the long-context default, ``ours_fp8``) by side
GLUON_VARIANTS = {
    "producer_only": replace(MLA_FP8_WGMMA, only=1),
    "consumer_only": replace(MLA_FP8_WGMMA, only=2),
    "e4m3": MLA_FP8_E4M3,
    "e4m3_producer_only": replace(MLA_FP8_E4M3, only=1),
    "e4m3_consumer_only": replace(MLA_FP8_E4M3, only=2),
    "e4m3_128_producer_only": replace(MLA_FP8_E4M3_128, only=1),
    "e4m3_128_consumer_only": replace(MLA_FP8_E4M3_128, only=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="*", type=int, default=[16, 64, 16384],
                    help="HEADS BATCH CTX")  # fmt: skip
    ap.add_argument("--variants", default="", help="only these FP8 variants, comma-separated")
    ap.add_argument("--bound", type=int, default=0, help="the longest length told (0: CTX)")
    args = ap.parse_args()
    heads, batch, ctx = args.shape
    case = PagedCase(batch, ctx, 1, 576, 64, 576 * 2)
    table, told = case.tables[0], args.bound or ctx  # what ours are told: the bound, if given
    if args.bound:
        table = with_table_bound(table, batch * args.bound)
    kv = torch.randn(case.num_pages, 64, 1, 576, device="cuda").bfloat16()
    kv8, s8, kv8pt, s8pt = fp8_copies(kv)
    q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)
    sm = 192**-0.5
    fp8_call = functools.partial(paged_decode_mla_fp8, q, kv8, s8, table, sm,
                                 max_seq_len=told)  # fmt: skip
    if args.variants:
        runs = {name: functools.partial(fp8_call, config=MLA_PEER_VARIANTS[name][1])
                for name in args.variants.split(",")}  # fmt: skip
        return launch_twice(runs)
    runs = {
        "ours_bf16": lambda: paged_decode_mla_bf16(q, kv, table, sm, max_seq_len=told),
        "ours_fp8": fp8_call,
    }
    if heads >= 64:
        runs["ours_bf16_triton"] = lambda: paged_decode_mla_bf16(
            q, kv, table, sm, max_seq_len=told, config=MLA_HEADS_TRITON
        )
        runs["ours_fp8_triton"] = functools.partial(fp8_call, config=MLA_HEADS_TRITON)
    else:
        runs["ours_fp8_triton"] = functools.partial(fp8_call, config=MLA_FP8_TRITON)
        for name, config in GLUON_VARIANTS.items():
            runs[f"ours_fp8_{name}"] = functools.partial(fp8_call, config=config)
    try:
        import flash_mla

        table = case.block_tables[0]
        runs["flashmla_bf16"] = flashmla_decode(flash_mla, q, kv, table, case.lens, 512, sm)
        runs["flashmla_fp8"] = flashmla_decode(flash_mla, q, kv8pt, table, case.lens, 512, sm,
                                               s8pt)  # fmt: skip
    except ImportError:
        print("flash_mla not installed: ours only", file=sys.stderr)
    launch_twice(runs)


def launch_twice(runs) -> None:
    for name, run in runs.items():
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main()
