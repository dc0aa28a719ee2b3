"""Registers, stack and the main loop's instruction mix of the MLA decode kernels, without a GPU.

Compiles the stage-1 Triton MLA kernel for a head count (``pick_config``'s, or where that is a
Gluon kernel the Triton one that runs in its place off Hopper: 16 heads a program below 64
heads, 64 heads with 8 warps from 64 on) for sm_90 with Triton's bundled ptxas, as the JIT
specializes it for real shapes (16-byte aligned pointers, strides divisible by 16), and prints
registers and stack (spills) per thread and the opcode mix of the tile loop (the longest
backward branch).

    python bench/mla_sass.py [--balanced] [--banks] [HEADS ...]   # default: 16 64 128

``--banks``: also the Triton kernel's shared-memory copies and loads, with their bank conflicts
(``bench/shared_banks.py``). ``--balanced``: the kernel compiled for balanced splits (a caller
that passes the batch's total length, as the decode slice does); without it, equal splits
(``bench/mla_profile.py``'s runs).
Run it with the Triton version of the GPU image: the register allocation differs between them.
It also compiles the Gluon kernels (written for the GPU image's Triton 3.6): at up to 16 heads
the warp-specialized FP8 kernel (``mla_decode_wgmma.py``), from 64 heads the heads-as-M kernel
(``mla_decode_heads.py``, BF16 and FP8), and prints their registers, stack, shared memory,
spill instructions and longest loop's opcode mix (the 64-heads kernel's tile loop; one
partition's loop in the warp-specialized one).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from shared_banks import report, summary
from tessera.kernels.mla_decode_e4m3 import mla_fp8_e4m3_kernel, mla_fp8_e4m3_stream_kernel
from tessera.kernels.mla_decode_e4m3_inplace import mla_fp8_e4m3_inplace_kernel
from tessera.kernels.mla_decode_heads import mla_heads_kernel, mla_heads_stream_kernel
from tessera.kernels.mla_decode_wgmma import mla_fp8_wgmma_kernel
from tessera.kernels.paged_decode_split import (
    MLA_FP8_TRITON,
    MLA_HEADS_TRITON,
    _mla_kernel,
    _mla_tokens_m_kernel,
    pick_config,
)
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from w4a16_sass import CUOBJDUMP, loop_opcodes, register_operand_hazards, resources

POINTERS = ("Q", "KV", "KV_SCALE", "seq_lens", "indptr", "indices", "part_out", "part_lse")
SCALARS = ("sm_scale_log2e", "num_splits", "fixed_split_len", "head_blocks", "num_heads",
           "stride_qb", "stride_qh", "stride_kv_slot", "stride_s_slot", "stride_pb", "stride_ph",
           "stride_ps")  # fmt: skip
SETMAXNREG = r"USETMAXREG\.\S+ (?:UP\d+, )?(0x[0-9a-f]+)"  # a partition's register limit
STRIDES = {"stride_qb", "stride_qh", "stride_kv_slot", "stride_pb", "stride_ph"}
STREAM_POINTERS = (*POINTERS[:6], "out", *POINTERS[6:])
STREAM_SCALARS = ("sm_scale_log2e", "batch", "num_heads", "stride_qb", "stride_qh",
                  "stride_kv_slot", "stride_s_slot", "stride_ob", "stride_oh", "stride_pb",
                  "stride_ph", "stride_ps")  # fmt: skip
STREAM_STRIDES = STRIDES | {"stride_ob", "stride_oh"}


def compile_asm(heads: int, fp8: bool, balanced: bool) -> tuple[dict, str]:
    """The stage-1 Triton kernel's stages (``ttgir``, ``cubin``, ...) and what it is."""
    cfg = pick_config(576, heads, True, fp8=fp8)
    # the Gluon kernels on Hopper (gluon_report builds them); their Triton counterparts here
    if cfg.wgmma:
        cfg = MLA_FP8_TRITON
    if cfg.heads_m:
        cfg = MLA_HEADS_TRITON
    fn = _mla_tokens_m_kernel if cfg.tokens_as_m else _mla_kernel
    types = {"Q": "*bf16", "KV": "*fp8e4nv" if fp8 else "*bf16", "KV_SCALE": "*fp32",
             "seq_lens": "*i32", "indptr": "*i32", "indices": "*i32", "part_out": "*fp32",
             "part_lse": "*fp32", "sm_scale_log2e": "fp32"}  # fmt: skip
    signature = {a: types.get(a, "i32") for a in (*POINTERS, *SCALARS)}
    constexprs = {"PAGE_SIZE": 64, "ENTRIES_PER_PAGE": 1, "LENS_ARE_ENDS": False,
                  "BALANCED": balanced, "D": 512, "D_ROPE": 64, "BLOCK_H": cfg.block_h,
                  "BLOCK_N": cfg.block_n, "FP8": fp8, "INTERPRETED": False,
                  "QK_PARTS": cfg.qk_fp8_parts, "PV_PARTS": cfg.pv_fp8_parts}  # fmt: skip
    signature |= dict.fromkeys(constexprs, "constexpr")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in (*POINTERS, *STRIDES)}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.max_registers:
        options["maxnreg"] = cfg.max_registers
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm, f"{fn.__name__} {cfg}"


def gluon_report(
    balanced: bool, page_size: int = 64, entries_per_page: int = 1, heads: int = 16,
    fp8: bool = True, e4m3: bool = False, in_place: bool = False, stream_batch: int = 0,
    wide_tiles: bool = False, q_in_consumer: bool = False, one_piece: bool = False,
) -> dict:
    """A Gluon MLA kernel built for sm_90: for up to 16 heads the warp-specialized FP8 kernel
    (``mla_decode_wgmma.py``, or with ``e4m3`` ``mla_decode_e4m3.py``, with ``in_place`` too
    ``mla_decode_e4m3_inplace.py``), from 64 heads the
    heads-as-M kernel (``mla_decode_heads.py``, BF16 or FP8); with ``stream_batch`` the e4m3
    kernel (from 64 heads the heads-as-M one) on the stream schedule (``mla_stream.py``) for
    batches of up to that many requests;
    with ``wide_tiles`` the e4m3 kernel on 128-token tiles (two consumer warpgroups); with
    ``q_in_consumer`` the e4m3 kernel's consumer writes the query (``Q_IN_CONSUMER``); with
    ``one_piece`` the e4m3 kernel built as the JIT builds it for one piece a split (``pieces``
    the constant 1; without, a runtime integer: two or more).
    Its shared memory in bytes, registers and stack (``resources``), each partition's register
    limit (``setmaxnreg``), whether its SASS has wgmma, whether ptxas serialized the wgmma
    (``wgmma_serialized``: its advisory C7512), how many spill instructions, and the
    opcodes of its longest loop (``loop``) and of its tile loop (``tile_loop``: the innermost
    one with an MMA: e4m3's ``QGMMA``, else ``HGMMA``).
    ``tests/kernels/test_mla_wgmma_compile.py`` checks these on CPU."""
    constexprs = {"PAGE_SIZE": page_size, "ENTRIES_PER_PAGE": entries_per_page,
                  "LENS_ARE_ENDS": entries_per_page > 1, "BALANCED": balanced, "D": 512,
                  "D_ROPE": 64}  # fmt: skip
    if heads >= 64:
        fn, num_warps = mla_heads_kernel, 8
        constexprs["FP8"] = fp8
    else:
        e4m3_kernel = mla_fp8_e4m3_inplace_kernel if in_place else mla_fp8_e4m3_kernel
        fn, num_warps = (e4m3_kernel if e4m3 else mla_fp8_wgmma_kernel), 4
        constexprs |= {"BLOCK_H": 16, "BLOCK_N": 64, "ONLY": 0}
        if wide_tiles:
            num_warps, constexprs["BLOCK_N"] = 8, 128
        if e4m3 and not in_place:
            constexprs["Q_IN_CONSUMER"] = q_in_consumer
    pointers, scalars, strides = POINTERS, SCALARS, STRIDES
    if e4m3 and not in_place and not stream_batch:
        scalars = (*SCALARS, "piece_len", "pieces")  # its splits in pieces (plan_pieces)
        if one_piece:  # Triton specializes an integer argument equal to 1 as a constant
            scalars = scalars[:-1]
            constexprs["pieces"] = 1
    if stream_batch:
        fn = mla_heads_stream_kernel if heads >= 64 else mla_fp8_e4m3_stream_kernel
        del constexprs["BALANCED"]
        constexprs.pop("Q_IN_CONSUMER", None)  # the stream consumer writes each piece's query
        constexprs["BATCH_P2"] = max(32 * num_warps, triton.next_power_of_2(stream_batch))
        pointers, scalars, strides = STREAM_POINTERS, STREAM_SCALARS, STREAM_STRIDES
    types = {"Q": "*bf16", "KV": "*fp8e4nv" if fp8 else "*bf16", "KV_SCALE": "*fp32",
             "seq_lens": "*i32", "indptr": "*i32", "indices": "*i32", "part_out": "*fp32",
             "part_lse": "*fp32", "sm_scale_log2e": "fp32", "out": "*bf16"}  # fmt: skip
    signature = {a: types.get(a, "i32") for a in (*pointers, *scalars)}
    signature |= dict.fromkeys(constexprs, "constexpr")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in (*pointers, *strides)}
    src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mla_gluon.cubin"
        path.write_bytes(kernel.asm["cubin"])
        listing = subprocess.run([str(CUOBJDUMP), "-sass", str(path)], check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
        mma = "QGMMA" if e4m3 else "HGMMA"
        return {"triton": triton.__version__, "shared": kernel.metadata.shared,
                "resources": resources(path),
                "wgmma_serialized": "C7512" in ptxas_advisories(kernel.asm["ptx"], tmp),
                "wgmma": bool(re.search(r"\b[HQ]GMMA\b", listing)),  # fp16/bf16 or e4m3
                "setmaxnreg": sorted({int(n, 16) for n in re.findall(SETMAXNREG, listing)}),
                "spills": len(re.findall(r"\b(?:STL|LDL)\b", listing)),
                "loop": dict(loop_opcodes(path).most_common()),
                "tile_loop": dict(loop_opcodes(path, mma).most_common()),
                "a_operand_hazards": register_operand_hazards(path, mma)}  # fmt: skip


def ptxas_advisories(ptx: str, tmp: str) -> str:
    """What Triton's own ptxas says of ``ptx`` with ``-v`` for sm_90a (Triton builds the same
    PTX without it): its performance advisories, e.g. C7512, wgmma serialized."""
    src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "again.cubin"
    src.write_text(ptx)
    return subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", str(out)],
                          check=True, capture_output=True, text=True).stderr  # fmt: skip


def main() -> None:
    args = sys.argv[1:]
    balanced = "--balanced" in args
    banks = "--banks" in args
    heads = [int(h) for h in args if not h.startswith("--")] or [16, 64, 128]
    with tempfile.TemporaryDirectory() as tmp:
        for h in heads:
            for fp8 in (False, True):
                asm, what = compile_asm(h, fp8, balanced)
                path = Path(tmp) / f"mla_{h}_{int(fp8)}.cubin"
                path.write_bytes(asm["cubin"])
                ops = loop_opcodes(path)
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common(12))
                spills = sum(n for op, n in ops.items() if op in ("STL", "LDL"))
                print(f"{h} heads {'FP8' if fp8 else 'BF16'}: {resources(path)}; loop "
                      f"{sum(ops.values())} instructions, {spills} spill loads/stores "
                      f"(STL/LDL); {top}\n  {what}", flush=True)
                if banks:
                    print("\n".join("  " + line for line in summary(report(asm["ttgir"]))))
            for fp8 in (True,) if h <= 16 else (False, True):
                r = gluon_report(balanced, heads=h, fp8=fp8)
                # the 64-heads kernel's one loop is its tile loop; the warp-specialized one's
                # longest loop is one partition's
                top = ", ".join(f"{op} {n}" for op, n in list(r["loop"].items())[:14])
                print(f"{h} heads {'FP8' if fp8 else 'BF16'}, Gluon: "
                      f"{r['resources']}; setmaxnreg {r['setmaxnreg']}; shared {r['shared']} "
                      f"bytes; {r['spills']} spill loads/stores (STL/LDL); longest loop "
                      f"{sum(r['loop'].values())} instructions: {top}", flush=True)

if __name__ == "__main__":
    main()
