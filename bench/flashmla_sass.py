"""FlashMLA's FP8 decode kernel for Hopper, read from its cubin, without a GPU: which MMAs its
loops run and how many instructions a thread spends in each loop, to hold against the same
counts of our heads-as-M kernel (``bench/mla_sass.py 64``).

    python bench/flashmla_sass.py WHEEL   # sgl_flash_mla-1.0.0-*.whl, or its _C_legacy.abi3.so

The wheel's legacy SM90 kernels are what SGLang's flashmla backend runs on Hopper for FP8 pages
(``flash_fwd_splitkv_mla_kernel`` with ``float_e4m3_t``). The script disassembles the sm_90a
copies only (Triton's bundled disassembler reads no sm_107a) and prints, for every loop (a
backward branch) that holds an MMA, its instruction count, opcode mix and MMAs by shape and
types.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from w4a16_sass import CUOBJDUMP, loop_bodies

KERNEL = "flash_fwd_splitkv_mla_kernel"


def library(path: Path, scratch: Path) -> Path:
    """The shared library holding the legacy kernels, from the wheel or given directly."""
    if path.suffix != ".whl":
        return path
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith("_C_legacy.abi3.so"))
        return Path(wheel.extract(name, scratch))


def sm90_functions(so: Path) -> dict[str, list[tuple[int, str]]]:
    """Each sm_90a function's instructions ``(address, text)`` (predicates dropped; a function
    in several sm_90a cubins keeps its first copy)."""
    sass = subprocess.run([str(CUOBJDUMP), "-arch", "sm_90a", "--dump-sass", str(so)],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    functions: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :")[1].strip()
            current = [] if name not in functions else None
            if current is not None:
                functions[name] = current
        elif current is not None:
            hit = re.search(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
            if hit:
                current.append((int(hit.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", hit.group(2))))
    return functions


def mma_loops(code: list[tuple[int, str]]) -> list[dict]:
    """The loops (backward branches) that hold MMAs, innermost first, with their opcode mix."""
    out = []
    for body in loop_bodies(dict(code)):
        mmas = collections.Counter(t.split()[0] for t in body if "MMA" in t.split()[0])
        if mmas:
            ops = collections.Counter(t.split()[0].split(".")[0] for t in body)
            # conversions, shared-memory transposes and shuffles, with their full forms
            kinds = ("F2FP", "LDSM", "STSM", "SHFL")
            moves = collections.Counter(t.split()[0] for t in body if t.startswith(kinds))
            out.append({"instructions": len(body), "mma": dict(mmas),
                        "opcodes": dict(ops.most_common()), "moves": dict(moves)})  # fmt: skip
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        functions = sm90_functions(library(Path(sys.argv[1]), Path(scratch)))
    for name, code in functions.items():
        if KERNEL not in name or "float_e4m3" not in name or "Lb1E" in name:  # not causal
            continue
        print(f"{name[:100]}...: {len(code)} instructions")
        for loop in mma_loops(code):
            print(f"  loop of {loop['instructions']} instructions a thread: MMAs {loop['mma']}")
            print(f"    {loop['opcodes']}")
            print(f"    {loop['moves']}")


if __name__ == "__main__":
    main()
