"""Throughput of `tessera-runtime fetch` from an S3 server on loopback.

The network is out of the picture (loopback), so this is the fetcher's own ceiling on this
machine: obstore's reads, the MD5 of every byte against the ETag, the writes and fsyncs to
the destination. Files of --file-mib each are seeded into tests/stores.py's S3 server (in
memory) and fetched with each --workers count into a fresh folder; then once more into the
folder already complete (the manifest's skip: what a restarted pod pays).

    python bench/fetch_loopback.py [--files 8] [--file-mib 128] [--workers 1 2 8]
                                   [--dest-root DIR] [--out bench/results]

--dest-root puts the destination on another file system (e.g. /dev/shm, to take the disk
out as well and leave the fetcher's CPU cost).

Prints a table last and writes fetch_loopback.json under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from stores import S3Server  # noqa: E402

MIB = 1 << 20


def fetch(env: dict[str, str], dest: Path, workers: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tessera.runtime.main", "fetch", "s3://bench/ckpt",
                    str(dest), "--workers", str(workers), "--termination-log",
                    str(dest.parent / "termination")],
                   env={**os.environ, "PYTHONSAFEPATH": "1", **env}, check=True,
                   capture_output=True, timeout=1800)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--file-mib", type=int, default=128)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--dest-root", type=Path, default=None,
                        help="where the destinations go (default: the temporary folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fetch-bench-"))
    try:
        source = work / "bucket" / "ckpt"
        source.mkdir(parents=True)
        for i in range(args.files):
            with (source / f"model-{i + 1:05d}-of-{args.files:05d}.safetensors").open("wb") as f:
                for _ in range(args.file_mib):
                    f.write(os.urandom(MIB))
        total_mib = args.files * args.file_mib
        server = S3Server({"bench": work / "bucket"}, work)
        rows = []
        try:
            for workers in args.workers:
                dest = (args.dest_root or work) / f"fetch-bench-dest-{workers}"
                seconds = fetch(server.env(), dest, workers)
                again = fetch(server.env(), dest, workers)
                rows.append({"workers": workers, "seconds": round(seconds, 2),
                             "mib_per_s": round(total_mib / seconds, 1),
                             "complete_rerun_seconds": round(again, 2)})
                shutil.rmtree(dest)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work)
    result = {"benchmark": "fetch_loopback",
              "date": datetime.datetime.now(datetime.UTC).isoformat(),
              # Where it was written is not part of what was measured.
              "command": " ".join(["fetch_loopback.py", *(
                  f"--{k.replace('_', '-')} {v}" for k, v in (
                      ("files", args.files), ("file_mib", args.file_mib),
                      ("dest_root", args.dest_root)) if v is not None),
                  "--workers", *map(str, args.workers)]),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()},
              "dest_root": str(args.dest_root or tempfile.gettempdir()),
              "load_average_1m_at_end": os.getloadavg()[0],
              "files": args.files, "file_mib": args.file_mib, "total_mib": total_mib,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fetch_loopback.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{total_mib} MiB in {args.files} files from S3 on loopback (MD5-verified) into "
          f"{result['dest_root']}; load average {result['load_average_1m_at_end']:.1f}")
    print(f"{'workers':>8} {'seconds':>8} {'MiB/s':>8} {'rerun s':>8}")
    for r in rows:
        print(f"{r['workers']:>8} {r['seconds']:>8} {r['mib_per_s']:>8} "
              f"{r['complete_rerun_seconds']:>8}")


if __name__ == "__main__":
    main()
