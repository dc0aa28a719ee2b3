"""bench/w4a16_sass.py's check that no register a warpgroup MMA in flight reads is rewritten
before the MMA is waited for (the compile tests assert it finds none in every Gluon build), on
hand-written SASS loops: it finds the hazard the INT4 GEMM once had, and none once the wait
comes first."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from w4a16_sass import operand_hazards  # noqa: E402

MMA = "HGMMA.64x64x16.F32.BF16 R24, R40, gdesc[UR4], R24, gsb0"


def test_a_decode_that_rewrites_an_mma_operand_in_flight_is_a_hazard() -> None:
    loop = [MMA, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "HFMA2 R42, R8, R9, R10", "BRA 0x100"]
    assert operand_hazards(loop) == ["HFMA2 writes R42 read by R40 in flight"]
    # a predicated 64-bit write covering the operand's last register counts too
    wide = [MMA, "@P0 IMAD.WIDE R42, R2, R3, R4", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert operand_hazards(wide) == ["IMAD.WIDE writes R42 read by R40 in flight"]


def test_waiting_first_or_writing_other_registers_is_not() -> None:
    waited = [MMA, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "HFMA2 R42, R8, R9, R10", "BRA 0x100"]
    assert operand_hazards(waited) == []
    elsewhere = [MMA, "HFMA2 R44, R8, R9, R10", "STS [R42], R43", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert operand_hazards(elsewhere) == []


def test_the_back_edge_is_walked() -> None:
    """A write before the MMA in the loop's text, reached again after it on the next turn."""
    loop = ["HFMA2 R41, R8, R9, R10", MMA, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "BRA 0x100"]
    assert operand_hazards(loop) == ["HFMA2 writes R41 read by R40 in flight"]
    fp8 = ["QGMMA.64x64x32.F32.E4M3.E4M3 R24, R40, gdesc[UR4], R24, gsb0",
           "F2FP.BF16.F32.PACK_AB R40, R1, R2"]  # fmt: skip
    expected = ["F2FP.BF16.F32.PACK_AB writes R40 read by R40 in flight"]
    assert operand_hazards(fp8, "QGMMA") == expected
    assert operand_hazards(fp8) == []  # HGMMA asked for: the QGMMA is not tracked
