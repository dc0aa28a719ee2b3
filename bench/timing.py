"""GPU timing shared by the benchmarks: CUDA-graph replays (launch gaps out of the numbers,
inputs cycled so the working set outruns the L2), the device's copy bandwidth, and the
results file."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from tessera.kernels.w4a16_gemm import capture_graph


def graph_time_us(calls: Callable[[int], object], sets: int, replays: int = 9) -> float:
    """Median time in microseconds of one ``calls(i)``, from CUDA-graph replays of many calls
    with ``i`` cycling over ``sets`` input sets. Warm-up (compilation, autotuning) runs first,
    outside the capture."""
    per_graph = max(sets, 12)

    def cycle() -> None:
        for i in range(per_graph):
            calls(i % sets)

    graph = capture_graph(cycle)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, read + write counted: the best of an elementwise copy
    kernel in a graph and ``copy_`` outside one (inside a graph ``copy_`` becomes a memcpy node,
    which ran at about 2.8 TB/s on the H200, below what kernels reach)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    t_kernel = graph_time_us(lambda i: torch.mul(src, 1.0, out=dst), 1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    t_copy = start.elapsed_time(end) * 1e3 / 10
    return 2 * src.numel() * 4 / (min(t_kernel, t_copy) * 1e-6)


def parse_results_args(ap: argparse.ArgumentParser, needs: str = "a GPU") -> argparse.Namespace:
    """``ap``'s arguments plus the ones every :func:`write_results` script takes (``--out``,
    ``--commit``), after checking there is a GPU to time on."""
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--commit", default="", help="the tree's commit, recorded in the results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"this benchmark needs {needs}")
    return args


def write_results(out: Path, name: str, commit: str, how: str, rows: list, **extra) -> Path:
    """``out/name`` as JSON: the device, commit and date, ``extra``, how the rows were timed,
    and the rows."""
    doc = {
        "device": torch.cuda.get_device_name(), "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **extra, "how": how, "rows": rows,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return path
