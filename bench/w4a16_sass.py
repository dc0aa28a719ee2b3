"""Count the machine instructions in the K loop of the W4A16 GEMM kernel, without a GPU.

Compiles ``_w4a16_gemm_kernel`` for sm_90 (Hopper) with Triton's bundled ptxas, disassembles it
with the bundled cuobjdump, finds the K loop (the longest backward branch) and prints its
instruction count per weight per thread, the opcode mix, and the registers and stack per thread.
Decode at small M is bound by instruction issue when this number is high: an SM issues about
128 thread-instructions per clock, so 10 instructions per weight cap it near 13 weights per clock.

    python bench/w4a16_sass.py
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

import triton
from tessera.kernels.w4a16_gemm import _w4a16_gemm_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SIGNATURE = {
    "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16",
    "M": "i32", "N": "i32", "K": "i32",
    "stride_xm": "i32", "stride_qk": "i32", "stride_sk": "i32", "stride_om": "i32",
}  # fmt: skip
CONFIGS = [  # (BLOCK_M, BLOCK_N, group, num_warps)
    (16, 64, 128, 4),
    (16, 64, 32, 4),
    (64, 128, 128, 8),
]


def compile_cubin(
    block_m: int, block_n: int, group: int, warps: int, stages: int = 2, fast: bool = True
) -> bytes:
    constexprs = {
        "GROUP": group, "HAS_ZEROS": False, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "BLOCK_K": 128, "SPLIT_K": 1, "FAST": fast, "EVEN_K": True, "EVEN_N": True,
    }  # fmt: skip
    signature = {**SIGNATURE, **dict.fromkeys(constexprs, "constexpr")}
    # what the launcher's JIT specializes at real shapes: 16-byte aligned pointers, and sizes
    # and strides divisible by 16 (M is not)
    fn = _w4a16_gemm_kernel
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in SIGNATURE if a != "M"}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    return kernel.asm["cubin"]


def loop_opcodes(cubin: Path) -> collections.Counter:
    """Opcodes between the target of the longest backward branch and the branch."""
    sass = subprocess.run(
        [str(CUOBJDUMP), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    code = {}
    loop = (0, 0)
    for addr_hex, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        addr = int(addr_hex, 16)
        code[addr] = text
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            if addr - start > loop[1] - loop[0]:
                loop = (start, addr)
    opcodes = (re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in code.items()
               if loop[0] <= a <= loop[1])  # fmt: skip
    return collections.Counter(opcodes)


def resources(cubin: Path) -> str:
    out = subprocess.run(
        [str(CUOBJDUMP), "--dump-resource-usage", str(cubin)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return " ".join(re.findall(r"(?:REG|STACK):\d+", out))


def main() -> None:
    import sys

    configs = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]] or CONFIGS
    scratch = Path.home() / ".cache" / "tessera" / "sass"
    scratch.mkdir(parents=True, exist_ok=True)
    for bm, bn, group, warps, *stages in configs:
        cubin = scratch / f"w4a16_m{bm}_n{bn}_g{group}_w{warps}.cubin"
        cubin.write_bytes(compile_cubin(bm, bn, group, warps, *stages))
        ops = loop_opcodes(cubin)
        weights_per_thread = bn * 128 // (32 * warps)  # one K step of 128 rows
        total = sum(ops.values())
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(10))
        print(f"BM={bm:3d} BN={bn:3d} g{group:<3d} warps={warps}: {resources(cubin)}, "
              f"K loop {total} instr = {total / weights_per_thread:.1f} per weight per thread; "
              f"{top}")  # fmt: skip


if __name__ == "__main__":
    main()
