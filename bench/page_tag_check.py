"""Benchmark the batched page-tag check: the Triton kernel against its torch reference.

Shapes are requests x page positions per request (64 x 512, 256 x 4096, 1024 x 8192 by default;
page size 1 token, plus page size 64 at 256 x 4096). Each state is consistent and then carries a
few faults of every kind, so both paths also do the mismatch work; the counts must be
bit-identical before anything is timed. Times are `triton.testing.do_bench` medians of eager
calls (the scheduler launches the check eagerly), cycling through several independent states
so the working set is well above the 60 MB L2. Also timed: the whole host-visible check as the
scheduler runs it (`PageTagTracker.verify` plus the copy of the counts to the host).

    python bench/page_tag_check.py [--out DIR] [--shapes 64x512,256x4096]

Prints a table last and writes page_tag_check.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.testing
from tessera.kernels.page_tag_check import page_tag_check, page_tag_check_ref
from tessera.runtime.integrity.tracker import PageTagTracker, TrackerShape

L2_BYTES = 60 * 2**20
DEFAULT_SHAPES = ((64, 512, 1), (256, 4096, 1), (256, 4096, 64), (1024, 8192, 1))


@dataclass(frozen=True)
class State:
    tracker: PageTagTracker
    page_table: torch.Tensor  # SGLang's req_to_token layout: token slots per request row


def make_state(reqs: int, pages: int, page_size: int, seed: int) -> State:
    """A tracker whose every request holds distinct pages with recorded tags, then faults."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = reqs * pages
    shape = TrackerShape(num_pages, page_size, req_slots=reqs, max_pages_per_req=pages)
    tracker = PageTagTracker(shape, device="cuda")
    tracker.tags.copy_(
        torch.randint(0, 2**30, (num_pages + 1,), device="cuda", generator=g, dtype=torch.int32) * 2
        + 1
    )
    owned = (torch.randperm(num_pages, device="cuda", generator=g) + 1).view(reqs, pages)
    tracker.expected_pages[:-1] = owned.to(torch.int32)
    tracker.expected_tags[:-1] = tracker.tags[owned]
    table = torch.randint(0, page_size, (reqs, pages * page_size), device="cuda", generator=g)
    table[:, ::page_size] += owned * page_size
    faults = max(1, reqs // 8)
    rows = torch.randint(0, reqs, (3, faults), device="cuda", generator=g)
    cols = torch.randint(0, pages, (3, faults), device="cuda", generator=g)
    tracker.tags[owned[rows[0], cols[0]]] += 2  # re-allocated under the request
    table[rows[1], cols[1] * page_size] = 0  # remapped row
    tracker.expected_tags[rows[2], cols[2]] += 1  # handed out while in use
    return State(tracker, table.to(torch.int32))


def bench_shape(reqs: int, pages: int, page_size: int) -> dict:
    one = make_state(reqs, pages, page_size, seed=0)
    set_bytes = (
        one.page_table.numel() * 4
        + one.tracker.expected_pages.numel() * 8
        + one.tracker.tags.numel() * 4
    )
    sets = max(2, min(16, math.ceil(4 * L2_BYTES / set_bytes)))
    states = [one] + [make_state(reqs, pages, page_size, seed=s) for s in range(1, sets)]
    slots = torch.arange(reqs, device="cuda")
    seq_lens = torch.full((reqs,), pages * page_size, device="cuda")
    counts = (seq_lens + page_size - 1) // page_size

    def args(s: State) -> tuple:
        t = s.tracker
        return (
            s.page_table,
            page_size,
            slots,
            counts,
            t.expected_pages[:-1],
            t.expected_tags[:-1],
            t.tags,
        )

    identical = True
    bad_requests = 0
    for s in states:
        got, want = page_tag_check(*args(s)), page_tag_check_ref(*args(s))
        identical &= bool(torch.equal(got, want))
        bad_requests += int((want > 0).sum())

    def rotating(fn):
        i = iter(range(10**9))
        return lambda: fn(states[next(i) % sets])

    kernel_us = 1e3 * triton.testing.do_bench(
        rotating(lambda t: page_tag_check(*args(t))), return_mode="median"
    )
    ref_us = 1e3 * triton.testing.do_bench(
        rotating(lambda t: page_tag_check_ref(*args(t))), return_mode="median"
    )
    verify_us = 1e3 * triton.testing.do_bench(
        rotating(lambda s: s.tracker.verify(s.page_table, slots, seq_lens).tolist()),
        return_mode="median",
    )
    moved = reqs * pages * 16  # page-table slot, expected page, expected tag, tag per position
    return {
        "requests": reqs,
        "pages_per_request": pages,
        "page_size": page_size,
        "states_rotated": sets,
        "bit_identical": identical,
        "requests_flagged": bad_requests,
        "kernel_us": round(kernel_us, 2),
        "torch_reference_us": round(ref_us, 2),
        "speedup_vs_reference": round(ref_us / kernel_us, 2),
        "verify_to_host_us": round(verify_us, 2),
        "kernel_min_bytes": moved,
        "kernel_GBps": round(moved / kernel_us / 1e3, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--shapes", help="e.g. 64x512,256x4096x64 (requests x pages[x page size])")
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = DEFAULT_SHAPES
    if ns.shapes:
        parsed = [tuple(int(x) for x in s.split("x")) for s in ns.shapes.split(",")]
        shapes = tuple((s + (1,))[:3] for s in parsed)
    rows = [bench_shape(*s) for s in shapes]
    result = {
        "benchmark": "page_tag_check",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(["python", *sys.argv]),
        "timing": "triton.testing.do_bench median of eager calls, rotating states",
        "rows": rows,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "page_tag_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'shape':>16} {'kernel us':>10} {'torch us':>10} {'x':>6} {'verify+host':>12} "
        f"{'GB/s':>7} ok"
    )
    for r in rows:
        shape = f"{r['requests']}x{r['pages_per_request']}/ps{r['page_size']}"
        print(
            f"{shape:>16} {r['kernel_us']:>10} {r['torch_reference_us']:>10} "
            f"{r['speedup_vs_reference']:>6} {r['verify_to_host_us']:>12} {r['kernel_GBps']:>7} "
            f"{r['bit_identical']}"
        )
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
