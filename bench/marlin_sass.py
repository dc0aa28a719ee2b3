"""SGLang's Marlin MoE kernel (what it runs for W4A16 experts), read from the JIT-built library
without a GPU: for every variant with 4-bit weights (uint4 with a bias of 8), the K loop's
instructions per decoded weight per thread, to hold against ours (``bench/w4a16_sass.py --moe``).

    python bench/marlin_sass.py DIR   # the folder bench/sglang_jit_build.py wrote (marlin_moe.so)

Marlin's dequantization subtracts the zero point from each pair of weights with one ``HADD2``,
so a loop's weights per thread are twice its ``HADD2`` count (the same count its ``HMMA``s
give); the loop is the innermost one holding MMAs. Template arguments are printed as the
demangler gives them (``c++filt``, from binutils).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flashmla_sass import mma_loops, sm90_functions

UINT4B8 = 1125899907892224  # SGLang's ScalarType id: exponent 0, mantissa 4, unsigned, bias 8


def main() -> None:
    functions = sm90_functions(Path(sys.argv[1]) / "marlin_moe.so")
    names = list(functions)
    pretty = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                            check=True).stdout.splitlines()  # fmt: skip
    for name, readable in zip(names, pretty, strict=True):
        if f"{UINT4B8}l" not in readable:
            continue
        loops = mma_loops(functions[name])
        pairs = loops[0]["opcodes"].get("HADD2", 0) if loops else 0
        if not pairs:
            continue
        loop = loops[0]
        args = readable[readable.index("<") + 1 : readable.index(">")]
        print(f"Marlin<{args}>: loop {loop['instructions']} instructions a thread, "
              f"{2 * pairs} weights, {loop['instructions'] / (2 * pairs):.2f} a weight; "
              f"MMAs {loop['mma']}")  # fmt: skip


if __name__ == "__main__":
    main()
