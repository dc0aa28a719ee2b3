"""Peak memory of `tessera quantize convert` against shard size.

Builds synthetic FP8 checkpoints (Kimi K2 tensor names and roles, 2 MoE layers) whose shards
are 64 MiB .. 1 GiB while the largest tensor (the BF16 embedding, vocab x 1024) stays the same,
and one with a 4x larger embedding; converts each in a fresh
subprocess and reads that process's peak RSS over the conversion (Linux: VmHWM, restarted
through /proc/self/clear_refs once Python and torch are imported, since importing torch alone
peaks higher than a small conversion). The converter streams tensor by tensor, so the peak
above that baseline should follow the largest tensor, not the shard.

    python bench/quantize_memory.py [--cases 64:4096 256:4096 1024:4096 256:16384]
                                    [--devices cpu cuda] [--out bench/results]

A case is SHARD_MIB:VOCAB.

Prints a table last and writes quantize_memory.json under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tessera.runtime.quantize.synthetic import TINY_CONFIGS, tensor_specs, write_checkpoint

MIB = 1 << 20
MOE_LAYERS = 2

CHILD = """
import io, json, sys, time
from pathlib import Path
from tessera.runtime.quantize.convert import convert
from tessera.runtime.quantize.options import Options

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])

baseline = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from here
start = time.perf_counter()
convert(Path(sys.argv[1]), Path(sys.argv[2]), Options(), device=sys.argv[3],
        progress_stream=io.StringIO())
seconds = time.perf_counter() - start
print(json.dumps({"baseline_kib": baseline, "peak_kib": status("VmHWM"), "seconds": seconds}))
"""

def config_for(shard_bytes: int, vocab: int = 4096) -> dict:
    """Kimi K2 roles at hidden 1024 with enough experts for about two shards of data."""
    config = {**TINY_CONFIGS["kimi-k2"], "hidden_size": 1024, "intermediate_size": 2048,
              "moe_intermediate_size": 512, "vocab_size": vocab, "q_lora_rank": 384,
              "kv_lora_rank": 256, "num_attention_heads": 8, "num_key_value_heads": 8,
              "num_hidden_layers": 1 + MOE_LAYERS}
    expert_bytes = 3 * config["moe_intermediate_size"] * config["hidden_size"]  # FP8
    config["n_routed_experts"] = math.ceil(2 * shard_bytes / expert_bytes / MOE_LAYERS)
    return config


def measure(shard_mib: int, vocab: int, devices: list[str], scratch: Path) -> list[dict]:
    config = config_for(shard_mib * MIB, vocab)
    src = write_checkpoint(scratch / "src", config, max_shard_bytes=shard_mib * MIB)
    shard_sizes = [p.stat().st_size for p in src.glob("*.safetensors")]
    largest_tensor = max(s.nbytes for s in tensor_specs(config, "fp8"))
    rows = []
    for device in devices:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(src), str(scratch / "out"), device],
            capture_output=True, text=True, cwd=scratch)  # not a checkout: its tessera/ shadows
        if child.returncode:
            raise RuntimeError(f"conversion on {device} failed:\n{child.stderr}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
        shutil.rmtree(scratch / "out")
        rows.append({
            "device": device,
            "shard_mib_limit": shard_mib,
            "largest_shard_mib": max(shard_sizes) / MIB,
            "shards": len(shard_sizes),
            "checkpoint_mib": sum(shard_sizes) / MIB,
            "largest_tensor_mib": largest_tensor / MIB,
            "baseline_rss_mib": result["baseline_kib"] / 1024,
            "peak_rss_mib": result["peak_kib"] / 1024,
            "peak_above_baseline_mib": (result["peak_kib"] - result["baseline_kib"]) / 1024,
            "seconds": result["seconds"],
            "source_mb_per_s": sum(shard_sizes) / 1e6 / result["seconds"],
        })
    shutil.rmtree(src)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["64:4096", "256:4096", "1024:4096",
                                                        "256:16384"])
    parser.add_argument("--devices", nargs="+", default=["cpu"],
                        help="torch devices for the converter's arithmetic, e.g. cpu cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "quantize_memory",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "rows": [],
    }
    rows: list[dict] = record["rows"]
    with tempfile.TemporaryDirectory(prefix="tessera-quantize-bench-") as scratch:
        for case in args.cases:
            shard_mib, vocab = (int(v) for v in case.split(":"))
            rows += measure(shard_mib, vocab, args.devices, Path(scratch))
            # written after every case, so an interrupted run keeps what it measured
            (args.out / "quantize_memory.json").write_text(json.dumps(record, indent=2) + "\n")
            print(f"case {case} done", file=sys.stderr)
    header = (f"{'device':>6} {'shard MiB':>10} {'shards':>6} {'ckpt MiB':>9} "
              f"{'largest tensor MiB':>19} {'peak RSS MiB':>13} {'above baseline MiB':>19} "
              f"{'MB/s':>6}")
    print(header)
    for r in rows:
        print(f"{r['device']:>6} {r['largest_shard_mib']:>10.0f} {r['shards']:>6} "
              f"{r['checkpoint_mib']:>9.0f} {r['largest_tensor_mib']:>19.1f} "
              f"{r['peak_rss_mib']:>13.0f} {r['peak_above_baseline_mib']:>19.0f} "
              f"{r['source_mb_per_s']:>6.0f}")


if __name__ == "__main__":
    main()
