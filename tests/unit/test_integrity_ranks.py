"""Cross-rank agreement: a mismatch seen on any attention-TP rank aborts the request on all.

Real processes and torch.distributed's gloo backend on CPU, as SGLang's attention-TP CPU group.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tessera.runtime.integrity.sglang_adapter import check_batch
from tessera.runtime.integrity.tracker import PageTagTracker, TrackerShape

PAGE_SIZE = 2
REQUESTS = 6


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, corrupt: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tracker = PageTagTracker(
            TrackerShape(64, PAGE_SIZE, req_slots=REQUESTS, max_pages_per_req=4)
        )
        page_table = torch.zeros(REQUESTS, 4 * PAGE_SIZE, dtype=torch.int32)
        for row in range(REQUESTS):  # every rank holds the same pages for the same requests
            slots = torch.arange(1 + 4 * row, 5 + 4 * row) * PAGE_SIZE
            tracker.on_alloc(slots)
            page_table[row, ::PAGE_SIZE] = slots.to(torch.int32)
            tracker.record(torch.full((4,), row), torch.arange(4) * PAGE_SIZE, slots)
        for row in corrupt.get(str(rank), []):  # this rank's own fault
            tracker.on_free(torch.tensor([int(page_table[row, 0]) // PAGE_SIZE]))
        rows = torch.arange(REQUESTS)
        seq_lens = torch.full((REQUESTS,), 4 * PAGE_SIZE)
        local = (tracker.verify(page_table, rows, seq_lens) > 0).int().tolist()
        agreed = check_batch(tracker, page_table, rows, seq_lens, dist.group.WORLD)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"local": local, "agreed": agreed}))
    finally:
        dist.destroy_process_group()


def test_any_rank_mismatch_flags_the_request_on_every_rank(tmp_path: Path) -> None:
    world = 2
    corrupt = {"0": [1, 3], "1": [3, 4]}  # row 3 on both ranks, rows 1 and 4 on one each
    mp.start_processes(
        _rank_main,
        args=(world, str(tmp_path / "init"), str(tmp_path), corrupt),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    bad_rows = {row for rows in corrupt.values() for row in rows}
    for rank, result in enumerate(results):
        mine = set(corrupt.get(str(rank), []))
        assert result["local"] == [int(row in mine) for row in range(REQUESTS)]
        assert [bool(n) for n in result["agreed"]] == [row in bad_rows for row in range(REQUESTS)]
    assert len({json.dumps(r["agreed"]) for r in results}) == 1  # every rank drops the same set
