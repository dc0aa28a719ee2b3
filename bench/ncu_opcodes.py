"""Where each kernel's warps wait, by opcode, from Nsight Compute's per-instruction source page.

    ncu --section WarpStateStats --section SourceCounters -o prof python bench/w4a16_profile.py ...
    ncu -i prof.ncu-rep --csv --page source --print-source sass > prof_sass.csv
    python bench/ncu_opcodes.py prof_sass.csv [--top 20]

For every profiled launch: the warp instructions it executed, the stall samples by reason, and
per opcode (the mnemonic without its modifiers) the instructions executed, their share, and the
reasons its samples were taken for; then the shared-memory wavefronts of each memory opcode
against the ideal (no bank conflicts) count. Two kernels' tables side by side say which
instructions one spends more of (for example tensor-core ``HMMA`` against packed ``HADD2``) and
what each waits on. (The export may list a launch twice, with the same counts.)
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path

from w4a16_sass import opcode


def launches(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, its instruction rows) for every launch in a ``--page source --csv`` export."""
    found, name, lines = [], None, []
    for line in [*text.splitlines(), '"Kernel Name",""']:
        if line.startswith('"Kernel Name"'):
            if name is not None:
                found.append((name, list(csv.DictReader(lines))))
            name, lines = next(csv.reader([line]))[1], []
        else:
            lines.append(line)
    return found


def summary(rows: list[dict[str, str]], top: int) -> list[str]:
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    executed: collections.Counter = collections.Counter()
    waits: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    wavefronts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row in rows:
        op = opcode(row["Source"])
        executed[op] += int(row["Instructions Executed"] or 0)
        for c in stalls:
            waits[op][c.removeprefix("stall_")] += int(row[c] or 0)
        for i, c in enumerate(("L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal")):
            wavefronts[op][i] += int(row.get(c) or 0)
    total = sum(executed.values())
    reasons: collections.Counter = sum(waits.values(), collections.Counter())
    out = [f"warp instructions {total / 1e6:.2f} M; stall samples "
           + ", ".join(f"{r} {n}" for r, n in reasons.most_common(10))]  # fmt: skip
    for op, n in executed.most_common(top):
        why = ", ".join(f"{r} {k}" for r, k in waits[op].most_common(4) if k)
        out.append(f"  {op:10s} {n / 1e6:7.2f} M {100 * n / total:5.1f}%  "
                   f"samples {sum(waits[op].values()):6d}: {why}")  # fmt: skip
    shared = {op: w for op, w in wavefronts.items() if w[0]}
    out.append(f"shared-memory wavefronts {sum(w[0] for w in shared.values()) / 1e6:.2f} M "
               f"(ideal {sum(w[1] for w in shared.values()) / 1e6:.2f} M)")  # fmt: skip
    for op, (real, ideal) in sorted(shared.items(), key=lambda kv: -kv[1][0]):
        out.append(f"  {op:10s} {real / 1e6:7.2f} M (ideal {ideal / 1e6:.2f} M)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=20, help="opcodes shown per launch")
    args = ap.parse_args()
    for i, (name, rows) in enumerate(launches(args.csv.read_text())):
        print(f"launch {i}: {name[:100]}")
        print("\n".join(summary(rows, args.top)))


if __name__ == "__main__":
    main()
