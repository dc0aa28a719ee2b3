"""bench/ncu_opcodes.py on a hand-written Nsight Compute source-page export: every launch's
instructions, stall samples and shared-memory wavefronts summed by opcode, predicated
instructions counted under their own opcode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from ncu_opcodes import launches, summary  # noqa: E402
from w4a16_sass import opcode  # noqa: E402

COLUMNS = ('"Address","Source","Instructions Executed","L1 Wavefronts Shared",'
           '"L1 Wavefronts Shared Ideal","stall_math","stall_mio",'
           '"stall_mio (Not Issued)"')  # fmt: skip
EXPORT = "\n".join([
    '"Kernel Name","_moe_gemm_kernel",',
    COLUMNS,
    '"0x0","      HMMA.16816.F32.BF16 R0, R4, R8, R0","3000000","0","0","40","0","9"',
    '"0x10","      LDS.128 R12, [R2+0x4000]","1000000","8000000","4000000","0","25","9"',
    '"0x20","  @!P1 LDS R14, [R3]","1000000","2000000","2000000","0","5","9"',
    '"Kernel Name","Marlin",',
    COLUMNS,
    '"0x0","      HADD2.BF16_V2 R0, R0, R1","2000000","0","0","3","0","0"',
])  # fmt: skip


def test_opcode_drops_predicates_and_modifiers() -> None:
    assert opcode("  @!P1 LDS R14, [R3]") == "LDS"
    assert opcode("HMMA.16816.F32.BF16 R0, R4, R8, R0") == "HMMA"


def test_launches_are_summed_by_opcode_with_their_stalls_and_wavefronts() -> None:
    found = launches(EXPORT)
    assert [name for name, _ in found] == ["_moe_gemm_kernel", "Marlin"]
    ours = summary(found[0][1], top=5)
    assert ours[0] == "warp instructions 5.00 M; stall samples math 40, mio 30"
    assert ours[1].split() == ["HMMA", "3.00", "M", "60.0%", "samples", "40:", "math", "40"]
    assert ours[2].split()[:4] == ["LDS", "2.00", "M", "40.0%"]
    assert ours[3:] == ["shared-memory wavefronts 10.00 M (ideal 6.00 M)",
                        "  LDS          10.00 M (ideal 6.00 M)"]  # fmt: skip
    assert summary(found[1][1], top=5)[1].split()[:2] == ["HADD2", "2.00"]
