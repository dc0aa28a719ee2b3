"""Shared-memory bank conflicts of a Triton kernel's tile copies and loads, read from its TTGIR
without a GPU.

Each ``ttg.local_load``, ``ttg.local_store`` and ``ttg.async_copy_global_to_local`` of the TTGIR
names a register layout (blocked, MMA, dot operand or linear) and a shared encoding. Triton's own
layout code (through its Gluon builder) turns the register layout into a linear map from
(register, lane) to tensor index, and a swizzled encoding gives each index its address. Each
instruction moves one vector a lane, as many consecutive elements as the register layout and
the swizzle keep together, at most 16 bytes. Its cost is counted the way the SM's shared-memory
pipe serves it: a warp's 32-bit accesses in one pass, 64-bit in two half-warps, 128-bit in four
quarter-warps, and each pass takes as many wavefronts as the most distinct 4-byte words any one
of the 32 banks holds. The ideal is the distinct bytes over 128 a pass. Nsight Compute counts
the same wavefronts per instruction (``bench/ncu_opcodes.py``): on the W4A16 16-row tile the
model matched its ratios for the loads (2.0x) but not for an asynchronous copy (8.0x against
5.8x measured), so for copies it ranks layouts rather than predicting counts. Not modelled:
NVMMA (``wgmma``) encodings, which are skipped, and how ``ldmatrix`` serves a transposed load (a
dot operand read across the buffer's rows is counted as the per-lane 2-byte reads it stands
for).

    python bench/w4a16_sass.py --banks --moe --silu 16,128,128,4,4
    python bench/shared_banks.py kernel.ttgir [--json]    # any Triton kernel's TTGIR (the
                                                          # .ttgir files of Triton's cache)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

BANKS, BANK_BYTES, PASS_BYTES, MAX_VECTOR = 32, 4, 128, 16
ELEMENT_BYTES = {"i1": 1, "i8": 1, "f8E4M3FN": 1, "f8E5M2": 1, "i16": 2, "bf16": 2, "f16": 2,
                 "i32": 4, "f32": 4, "i64": 8, "f64": 8}  # fmt: skip
Index = tuple[int, ...]


@dataclass(frozen=True)
class Swizzle:
    """``#ttg.swizzled_shared``: within a row (the fastest dim, ``order[0]``), groups of ``vec``
    elements are XOR-ed with the row's phase, ``(row // per_phase) % max_phase``, the row being
    the index along ``order[1]``."""

    vec: int
    per_phase: int
    max_phase: int
    order: tuple[int, ...]

    def offset(self, index: Index, shape: Index) -> int:
        """The element offset of ``index`` in a buffer of ``shape``."""
        col = index[self.order[0]]
        row = index[self.order[1]] if len(self.order) > 1 else 0
        phase = (row // self.per_phase) % self.max_phase
        swizzled = ((col // self.vec) ^ phase) * self.vec + col % self.vec
        offset, stride = 0, 1
        for d in self.order:
            offset += (swizzled if d == self.order[0] else index[d]) * stride
            stride *= shape[d]
        return offset


@dataclass(frozen=True)
class Linear:
    """A register layout as Triton's linear map: each basis is the tensor index that one bit of
    the register or lane id selects, and an id's index is the XOR of its set bits' bases."""

    reg: tuple[Index, ...]
    lane: tuple[Index, ...]

    @staticmethod
    def index(bases: tuple[Index, ...], bits: int, rank: int) -> Index:
        out = (0,) * rank
        for i, basis in enumerate(bases):
            if bits >> i & 1:
                out = tuple(a ^ b for a, b in zip(out, basis, strict=True))
        return out


def wavefronts(addresses: list[int], width: int) -> tuple[int, int]:
    """(wavefronts, ideal) of one warp instruction whose lane ``l`` moves ``width`` bytes at
    byte address ``addresses[l]``."""
    per_pass = max(1, PASS_BYTES // max(width, BANK_BYTES))  # 32 lanes for 4 bytes, 8 for 16
    got = ideal = 0
    for first in range(0, len(addresses), per_pass):
        words = {
            (a + b) // BANK_BYTES
            for a in addresses[first:first + per_pass] for b in range(0, width, BANK_BYTES)
        }  # fmt: skip
        per_bank: dict[int, int] = {}
        for w in words:
            per_bank[w % BANKS] = per_bank.get(w % BANKS, 0) + 1
        got += max(per_bank.values())
        ideal += -(-len(words) * BANK_BYTES // PASS_BYTES)
    return got, ideal


@dataclass(frozen=True)
class Access:
    """One shared-memory copy or load of the TTGIR and its cost for one warp."""

    op: str
    name: str
    in_loop: bool
    shape: Index
    vector_bytes: int
    instructions: int  # a thread
    wavefronts: int  # a warp
    ideal: int

    def line(self) -> str:
        shape = "x".join(map(str, self.shape))
        return (f"{'loop' if self.in_loop else '    '} {self.op:<26} {self.name:<12} {shape:<9} "
                f"{self.vector_bytes:>2} B x {self.instructions:>3}: {self.wavefronts:>4} "
                f"wavefronts a warp, ideal {self.ideal:>4} ({self.wavefronts / self.ideal:.1f}x)")


def access_cost(layout: Linear, shared: Swizzle, shape: Index, element_bytes: int):
    """(vector bytes, instructions, wavefronts, ideal) of one warp moving its part of a
    ``shape`` tile between registers laid out as ``layout`` and shared memory as ``shared``."""
    rank, fast = len(shape), shared.order[0]
    vec_bits = 0  # leading register bits stepping 1, 2, 4, ... along the fastest dim
    while (vec_bits < len(layout.reg)
           and layout.reg[vec_bits] == tuple((1 << vec_bits) * (d == fast) for d in range(rank))
           and (shared.max_phase == 1 or 2 << vec_bits <= shared.vec)
           and (2 << vec_bits) * element_bytes <= MAX_VECTOR):  # fmt: skip
        vec_bits += 1
    width = element_bytes << vec_bits
    lanes = [Linear.index(layout.lane, lane, rank) for lane in range(32)]
    got = ideal = 0
    seen = set()
    for r in range(1 << (len(layout.reg) - vec_bits)):
        start = Linear.index(layout.reg, r << vec_bits, rank)
        addresses = tuple(
            shared.offset(tuple(a ^ b for a, b in zip(start, lane, strict=True)), shape)
            * element_bytes
            for lane in lanes
        )
        if addresses in seen:  # a register that repeats another (a broadcast layout)
            continue
        seen.add(addresses)
        w, i = wavefronts(list(addresses), width)
        got, ideal = got + w, ideal + i
    return width, len(seen), got, ideal


def _bracketed(text: str, start: int, open_: str = "<", close: str = ">") -> str:
    """The text inside the bracket that opens at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == open_) - (text[i] == close)
        if depth == 0:
            return text[start + 1:i]
    raise ValueError(f"unbalanced {open_}{close} in {text[start:start + 60]}")


def _ints(text: str, key: str) -> list[int]:
    return [int(v) for v in re.search(key + r"\s*=\s*\[([^\]]*)\]", text).group(1).split(",")]


def _int(text: str, key: str) -> int:
    return int(re.search(key + r"\s*=\s*(\d+)", text).group(1))


def _bases(text: str, key: str) -> tuple[Index, ...]:
    """A ``#ttg.linear`` attribute's ``key = [[0, 1], [8, 0]]`` as tuples."""
    inner = _bracketed(text, text.index("[", text.index(key + " =")), "[", "]")
    return tuple(tuple(int(v) for v in b.split(",")) for b in re.findall(r"\[([\d, ]+)\]", inner))


def _tensor_type(text: str) -> tuple[Index, str, str]:
    """A tensor or memdesc type's body (``16x128xi32, #enc, ...``) as shape, element type and
    encoding."""
    dims, rest = re.match(r"((?:\d+x)+)(.*)", text.strip()).groups()
    element, _, encoding = rest.partition(",")
    element = re.sub(r"!tt\.ptr<(\w+)>", r"\1", element.strip())  # pointers: what they load
    depth = 0  # the encoding ends at the first top-level comma (a memdesc lists more after it)
    for i, ch in enumerate(encoding):
        depth += (ch in "<{[") - (ch in ">}]")
        if ch == "," and depth == 0:
            encoding = encoding[:i]
            break
    return tuple(int(d) for d in dims.rstrip("x").split("x")), element, encoding.strip()


class _Layouts:
    """The TTGIR's named attributes (``#blocked2 = ...``) and its register layouts as
    :class:`Linear`, converted by Triton's own layout code."""

    def __init__(self, ttgir: str):
        from triton._C.libtriton import gluon_ir, ir

        self.named = dict(re.findall(r"^(#[\w.]+) = (#ttg\.\w+<.*>)\s*$", ttgir, re.M))
        self.context = ir.context()
        ir.load_dialects(self.context)
        self.builder = gluon_ir.GluonOpBuilder(self.context)

    def _resolve(self, text: str) -> str:
        return self.named.get(text.strip(), text.strip())

    def _gluon(self, text: str):
        from triton.experimental.gluon import language as gl

        text = self._resolve(text)
        if text.startswith("#ttg.blocked"):
            return gl.BlockedLayout(_ints(text, "sizePerThread"), _ints(text, "threadsPerWarp"),
                                    _ints(text, "warpsPerCTA"), _ints(text, "order"))  # fmt: skip
        if text.startswith("#ttg.nvidia_mma"):
            return gl.NVMMADistributedLayout(
                [_int(text, "versionMajor"), _int(text, "versionMinor")],
                _ints(text, "warpsPerCTA"), _ints(text, "instrShape"),
            )  # fmt: skip
        if text.startswith("#ttg.slice"):
            parent = re.search(r"parent\s*=\s*(#[\w.]+)", text).group(1)
            return gl.SliceLayout(_int(text, "dim"), self._gluon(parent))
        if text.startswith("#ttg.dot_op"):
            parent = re.search(r"parent\s*=\s*(#[\w.]+)", text).group(1)
            return gl.DotOperandLayout(_int(text, "opIdx"), self._gluon(parent),
                                       _int(text, "kWidth"))  # fmt: skip
        raise ValueError(f"no model of the register layout {text[:80]}")

    def linear(self, text: str, shape: Index) -> Linear:
        text = self._resolve(text)
        if text.startswith("#ttg.linear"):
            return Linear(_bases(text, "register"), _bases(text, "lane"))
        layout = self.builder.to_linear_layout(self._gluon(text)._to_ir(self.builder), list(shape))
        return Linear(tuple(map(tuple, layout.reg_bases)), tuple(map(tuple, layout.lane_bases)))

    def swizzle(self, text: str) -> Swizzle | None:
        text = self._resolve(text)
        if not text.startswith("#ttg.swizzled_shared"):
            return None  # NVMMA (wgmma) encodings: not modelled
        return Swizzle(_int(text, "vec"), _int(text, "perPhase"), _int(text, "maxPhase"),
                       tuple(_ints(text, "order")))  # fmt: skip


def report(ttgir: str) -> list[Access]:
    """Every copy and load between registers and swizzle-encoded shared memory in ``ttgir``,
    named by the source variable Triton kept for it."""
    layouts = _Layouts(ttgir)
    names = dict(re.findall(r'^(#loc\d+) = loc\("([^"]+)"\(', ttgir, re.M))
    out = []
    regions: list[bool] = []  # the open regions, True for a loop's body
    for line in ttgir.splitlines():
        if line.rstrip().endswith("{"):
            regions.append("scf.for" in line)
        elif line.lstrip().startswith("}") and regions:
            regions.pop()
        op = re.search(r"ttg\.(local_load|local_store|async_copy_global_to_local)\b", line)
        if not op:
            continue
        tensor = line.index("tensor<") + len("tensor")
        buffer = line.index("memdesc<") + len("memdesc") if "memdesc<" in line else (
            line.index("-> <") + len("-> "))  # an async copy's destination type
        shape, _, register_layout = _tensor_type(_bracketed(line, tensor))
        buffer_shape, element, encoding = _tensor_type(_bracketed(line, buffer))
        shared = layouts.swizzle(encoding)
        if shared is None:
            continue
        loc = re.search(r"loc\((#loc\d+)\)\s*$", line)
        name = names.get(loc.group(1)) if loc else None
        name = name or re.match(r"\s*(%[\w.]+)", line).group(1)
        cost = access_cost(layouts.linear(register_layout, shape), shared,
                           buffer_shape[-len(shape):], ELEMENT_BYTES[element])  # fmt: skip
        out.append(Access(op.group(1), name, any(regions), shape, *cost))
    return out


def summary(accesses: list[Access]) -> list[str]:
    """One line an access, then the loop's total a warp an iteration."""
    loop = [a for a in accesses if a.in_loop]
    got, ideal = sum(a.wavefronts for a in loop), sum(a.ideal for a in loop)
    total = f"loop total: {got} wavefronts a warp an iteration, ideal {ideal}"
    return [a.line() for a in accesses] + ([total] if loop else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ttgir", type=Path, help="a kernel's TTGIR (Triton's cache keeps one a build)")
    ap.add_argument("--json", action="store_true", help="the accesses as a JSON list")
    args = ap.parse_args()
    accesses = report(args.ttgir.read_text())
    if args.json:
        print(json.dumps([dataclasses.asdict(a) for a in accesses]))
    else:
        print("\n".join(summary(accesses)))


if __name__ == "__main__":
    main()
