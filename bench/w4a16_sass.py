"""Count the machine instructions in the K loop of the W4A16 kernels, without a GPU.

Compiles ``_w4a16_gemm_kernel`` (and the MoE's ``_moe_gemm_kernel``) for sm_90 (Hopper) with
Triton's bundled ptxas, with the specialization the JIT gives real shapes (16-byte aligned
pointers, sizes and strides divisible by 16), disassembles with the bundled cuobjdump, finds the
K loop (the longest backward branch) and prints its instructions per weight per thread, the
opcode mix, and the registers and stack per thread. Decode at small M is bound by instruction
issue when this number is high: an SM issues about 128 thread-instructions per clock, so at
1.98 GHz and 132 SMs streaming INT4 at 4.2 TB/s leaves about 4 instructions per weight.

    python bench/w4a16_sass.py                      # the default tiles
    python bench/w4a16_sass.py 16,256,128,4,4       # BLOCK_M,BLOCK_N,group,warps[,stages[,BLOCK_K]]
    python bench/w4a16_sass.py --plain ...          # the plain-Triton decode instead of the PTX one
    python bench/w4a16_sass.py --moe ...            # the MoE grouped GEMM (INT4 experts)
    python bench/w4a16_sass.py --gemv 1,128,128,4   # the one-token CUDA-core GEMV (BLOCK_M unused)
    python bench/w4a16_sass.py --wgmma 64,64,32,4   # the Gluon warpgroup-MMA kernel (BM tokens)
    python bench/w4a16_sass.py --banks ...          # and each shared access's bank conflicts
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import shared_banks
import triton
from tessera.kernels.w4a16_gemm import _w4a16_gemm_kernel, _w4a16_gemv_kernel
from tessera.kernels.w4a16_moe import _moe_gemm_kernel
from tessera.kernels.w4a16_wgmma import w4a16_wgmma_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
GEMM_SIGNATURE = {
    "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16",
    "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "split_k": "i32",
    "stride_xm": "i32", "stride_qk": "i32", "stride_sk": "i32", "stride_om": "i32",
}  # fmt: skip
MOE_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16",
    "ws_ptr": "*fp32", "cnt_ptr": "*i32", "pair_ids_ptr": "*i32", "block_expert_ptr": "*i32",
    "routing_ptr": "*fp32", "N": "i32", "K": "i32", "num_pairs": "i32", "rows_per_x": "i32",
    "split_k": "i32", "sum_rows": "i32", "stride_xm": "i32", "stride_we": "i32",
    "stride_wk": "i32", "stride_se": "i32", "stride_sk": "i32",
}  # fmt: skip
GEMV_SIGNATURE = GEMM_SIGNATURE
WGMMA_SIGNATURE = {
    "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
    "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "split_k": "i32", "stride_xm": "i32",
    "stride_qk": "i32", "stride_sk": "i32", "stride_om": "i32",
}  # fmt: skip
NOT_DIVISIBLE = {"M", "split_k", "num_pairs", "rows_per_x", "sum_rows"}
CONFIGS = [  # (BLOCK_M, BLOCK_N, group, num_warps, num_stages)
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 256, 128, 4, 4),
    (16, 128, 32, 4, 4),
    (16, 256, 32, 4, 4),
    (32, 128, 128, 4, 4),
]


def compile_asm(
    cfg: tuple[int, ...],
    fast: bool = True,
    moe: bool = False,
    swap: bool = False,
    silu: bool = False,
    gemv: bool = False,
) -> dict:
    """A Triton W4A16 kernel built for sm_90 as the tuner's decode picks run it: its stages
    (``ttgir``, ``ptx``, ``cubin``, ...) by name."""
    bm, bn, group, warps, *rest = cfg
    stages = rest[0] if rest else 4
    block_k = rest[1] if len(rest) > 1 else 128
    # every constexpr given (Triton builds a kernel from source only so); K split and counted
    # in the launch, launched dependently, as the tuner's decode picks run
    common = {
        "GROUP": group, "HAS_ZEROS": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k,
        "FAST": fast, "EVEN_K": True, "EVEN_N": True, "SWAP": swap, "COUNTED": True,
        "FENCE": True, "PDL": 1,
    }  # fmt: skip
    if gemv:
        fn, sig = _w4a16_gemv_kernel, GEMV_SIGNATURE
        constexprs = {"GROUP": group, "HAS_ZEROS": False, "BLOCK_N": bn, "BLOCK_R": block_k // 8,
                      "SPLIT": True, "FAST": fast, "EVEN_K": True, "EVEN_N": True,
                      "COUNTED": True, "FENCE": True, "PDL": 1}  # fmt: skip
    elif moe:
        fn, sig = _moe_gemm_kernel, MOE_SIGNATURE
        constexprs = {**common, "INT4": True, "MUL_ROUTING": False, "SILU_MUL": silu,
                      "PAIR_BLOCKS": False}  # fmt: skip
    else:
        fn, sig = _w4a16_gemm_kernel, GEMM_SIGNATURE
        constexprs = {**common, "SPLIT": True}
    signature = {**sig, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {
        (fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in NOT_DIVISIBLE
    }
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    return kernel.asm


def tile_report(cfg: tuple[int, ...], banks: bool = False, **flags) -> dict:
    """A Triton kernel's registers and stack and its K loop's opcodes, for ``cfg`` (``BLOCK_M,
    BLOCK_N,group,warps[,stages[,BLOCK_K]]``) and :func:`compile_asm`'s ``flags``; with
    ``banks``, also its shared-memory accesses' lines (``bench/shared_banks.py``) from the same
    build. Also for ``tests/kernels/test_w4a16_tile_compile.py``."""
    scratch = Path.home() / ".cache" / "tessera" / "sass"
    scratch.mkdir(parents=True, exist_ok=True)
    named = "_".join(k for k, v in sorted(flags.items()) if v)
    cubin = scratch / f"w4a16_{named}_{'_'.join(map(str, cfg))}.cubin"
    asm = compile_asm(cfg, **flags)
    cubin.write_bytes(asm["cubin"])
    built = {"resources": resources(cubin), "loop": dict(loop_opcodes(cubin))}
    if banks:
        built["banks"] = shared_banks.summary(shared_banks.report(asm["ttgir"]))
    return built


def compile_wgmma_cubin(
    bm: int, group: int, split: bool = False, stages: int = 4, warps: int = 4,
    counted: bool = False, pdl: bool = False,
) -> tuple[bytes, int]:
    """The Gluon kernel (``w4a16_wgmma.py``) for ``bm`` tokens a tile: its cubin and shared
    memory in bytes. ``split``: K parts added into an fp32 output, or with ``counted`` met in
    the workspace; ``pdl``: launched dependently."""
    fn, sig = w4a16_wgmma_kernel, dict(WGMMA_SIGNATURE)
    if split and not counted:
        sig["out_ptr"] = "*fp32"
    constexprs = {"GROUP": group, "BM": bm, "SPLIT": split, "STAGES": stages,
                  "COUNTED": counted, "PDL": pdl}  # fmt: skip
    signature = {**sig, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {
        (fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in NOT_DIVISIBLE
    }
    src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return kernel.asm["cubin"], kernel.metadata.shared


def wgmma_report(
    bm: int, group: int, split: bool = False, stages: int = 4, warps: int = 4,
    counted: bool = False, pdl: bool = False,
) -> dict:
    """The Gluon kernel's registers and stack, shared memory and K-loop opcodes (the loop with
    the warpgroup MMAs), for ``tests/kernels/test_w4a16_wgmma_compile.py``."""
    scratch = Path.home() / ".cache" / "tessera" / "sass"
    scratch.mkdir(parents=True, exist_ok=True)
    name = f"w4a16_wgmma_{bm}_{group}_{split:d}{counted:d}{pdl:d}_{stages}_{warps}.cubin"
    cubin = scratch / name
    data, shared = compile_wgmma_cubin(bm, group, split, stages, warps, counted, pdl)
    cubin.write_bytes(data)
    loop = loop_instructions(cubin, innermost_with="HGMMA")
    # how many MMA groups each wait in the loop leaves in flight
    waits = [int(w, 16) for t in loop for w in re.findall(r"DEPBAR\.LE gsb0, (0x\w+)", t)]
    sass = subprocess.run([str(CUOBJDUMP), "--dump-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    # the whole kernel's global atomics by kind (the split's reductions, counts and exchanges)
    atomics = collections.Counter(re.findall(r"\b((?:REDG|ATOMG)\.E\.[A-Z0-9]+)", sass))
    return {"resources": resources(cubin), "shared": shared, "mma_waits": waits,
            "loop": dict(collections.Counter(opcode(t) for t in loop)),
            "atomics": dict(atomics),
            "a_operand_hazards": register_operand_hazards(cubin)}  # fmt: skip


# opcodes that write no general register first (stores, barriers, branches, waits, MMAs'
# accumulators, which chain in order)
_NO_REGISTER_WRITE = re.compile(
    r"^(ST|RED|BAR|BRA|EXIT|WARPGROUP|DEPBAR|LDGDEPBAR|LDGSTS|FENCE|MEMBAR|HGMMA|QGMMA|NOP|"
    r"ISETP|FSETP|HSETP|PLOP3|U[A-Z0-9]*|SYNCS|ARRIVES|CCTL|YIELD|BSSY|BSYNC|WARPSYNC|CALL|RET)"
)


def _unpredicated(text: str) -> str:
    """An instruction as cuobjdump prints it, without its guard predicate (``@P0``, ``@!UP1``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def _written_registers(body: str) -> set[int]:
    """The general registers an unpredicated instruction writes (its first operand, with the
    width its modifiers give)."""
    op, _, operands = body.partition(" ")
    if _NO_REGISTER_WRITE.match(op):
        return set()
    first = re.match(r"\s*R(\d+)\b", operands)
    if not first:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return set(range(int(first.group(1)), int(first.group(1)) + width))


def register_operand_hazards(cubin: Path, mma: str = "HGMMA") -> list[str]:
    """:func:`operand_hazards` of the loop of ``cubin`` that holds the ``mma`` instructions."""
    return operand_hazards(loop_instructions(cubin, innermost_with=mma), mma)


def operand_hazards(loop: list[str], mma: str = "HGMMA") -> list[str]:
    """Writes to a register that a warpgroup MMA still in flight reads as its A operand: PTX
    leaves undefined what such an MMA reads. The ``loop`` (instructions as cuobjdump prints
    them) is walked twice (its back edge included); each MMA (``mma``: ``HGMMA`` or ``QGMMA``)
    with a register A operand (``R<a>``: four registers) stays in flight until a
    ``WARPGROUP.DEPBAR.LE gsb0, n`` leaves at most ``n`` newer ones."""
    in_flight: list[tuple[str, set[int]]] = []
    hazards = []
    for text in loop + loop:
        body = _unpredicated(text)
        wait = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\w+)", body)
        if wait:
            keep = int(wait.group(1), 16)
            in_flight = in_flight[len(in_flight) - keep:] if keep else []
            continue
        issued = re.match(rf"{mma}\S* R\d+, R(\d+),", body)
        if issued:
            first = int(issued.group(1))
            in_flight.append((body, set(range(first, first + 4))))
            continue
        clobbered = _written_registers(body)
        for mma_text, regs in in_flight:
            if clobbered & regs:
                hazards.append(f"{body.split(' ')[0]} writes R{min(clobbered & regs)} "
                               f"read by {mma_text.split(',')[1].strip()} in flight")  # fmt: skip
    return sorted(set(hazards))


def loop_opcodes(cubin: Path, innermost_with: str | None = None) -> collections.Counter:
    """Opcodes between the target of the longest backward branch and the branch; with
    ``innermost_with``, of the shortest loop that holds that opcode instead."""
    return collections.Counter(opcode(text) for text in loop_instructions(cubin, innermost_with))


def opcode(text: str) -> str:
    """An instruction's mnemonic without its guard predicate and modifiers (``@!P1 LDS.128 ...``
    -> ``LDS``)."""
    return _unpredicated(text.strip()).split()[0].split(".")[0]


def loop_instructions(cubin: Path, innermost_with: str | None = None) -> list[str]:
    """The instructions of :func:`loop_opcodes`' loop, as cuobjdump prints them."""
    sass = subprocess.run(
        [str(CUOBJDUMP), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    code = {int(a, 16): t.strip() for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)}
    bodies = loop_bodies(code)
    if innermost_with:
        return next((b for b in bodies if any(opcode(t) == innermost_with for t in b)), [])
    return bodies[-1] if bodies else []


def loop_bodies(code: dict[int, str]) -> list[list[str]]:
    """The loops of ``code`` (address -> instruction): for each backward branch, the
    instructions from its target to it; the shortest loop first."""
    loops = []
    for addr, text in code.items():
        target = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    loops.sort(key=lambda lp: lp[1] - lp[0])
    return [[t for a, t in code.items() if start <= a <= end] for start, end in loops]


def resources(cubin: Path) -> str:
    out = subprocess.run(
        [str(CUOBJDUMP), "--dump-resource-usage", str(cubin)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return " ".join(re.findall(r"(?:REG|STACK):\d+", out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="BLOCK_M,BLOCK_N,group,warps[,stages[,BLOCK_K]]")
    ap.add_argument("--plain", action="store_true", help="plain-Triton decode (FAST=False)")
    ap.add_argument("--moe", action="store_true", help="the MoE grouped GEMM kernel")
    ap.add_argument("--swap", action="store_true", help="weights as the dot's first operand")
    ap.add_argument("--silu", action="store_true", help="MoE up GEMM with SiLU-and-mul epilogue")
    ap.add_argument("--gemv", action="store_true", help="the one-token CUDA-core GEMV")
    ap.add_argument("--banks", action="store_true",
                    help="each shared-memory copy and load's wavefronts (bench/shared_banks.py)")
    ap.add_argument("--wgmma", action="store_true",
                    help="the Gluon warpgroup-MMA kernel (BLOCK_M: tokens; BLOCK_N 64, 4 warps)")
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs] or CONFIGS
    if args.wgmma:
        for bm, _, group, warps, *_ in configs:
            built = wgmma_report(bm, group, warps=warps)
            total = sum(built["loop"].values())
            loop = collections.Counter(built["loop"])
            top = ", ".join(f"{op} {n}" for op, n in loop.most_common(10))
            print(f"wgmma BM={bm:3d} g{group:<3d} warps={warps}: {built['resources']}, "
                  f"shared {built['shared']}, K loop {total} instr = "
                  f"{total / (64 * 128 // 128):.1f} per weight per thread; "
                  f"{top}", flush=True)  # fmt: skip
        return
    kind = "moe" if args.moe else "gemv" if args.gemv else "gemm"
    kind += "-plain" if args.plain else ""
    kind += ("-swap" if args.swap else "") + ("-silu" if args.silu else "")
    for cfg in configs:
        bm, bn, group, warps, *rest = cfg
        block_k = rest[1] if len(rest) > 1 else 128
        built = tile_report(cfg, banks=args.banks, fast=not args.plain, moe=args.moe,
                            swap=args.swap, silu=args.silu, gemv=args.gemv)  # fmt: skip
        ops = collections.Counter(built["loop"])
        weights_per_thread = bn * block_k // (32 * warps)  # one K step
        total = sum(ops.values())
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(10))
        print(f"{kind} BM={bm:3d} BN={bn:3d} g{group:<3d} warps={warps} {rest}: "
              f"{built['resources']}, K loop {total} instr = {total / weights_per_thread:.1f} "
              f"per weight per thread; {top}", flush=True)  # fmt: skip
        for line in built.get("banks", []):
            print("  " + line)


if __name__ == "__main__":
    main()
