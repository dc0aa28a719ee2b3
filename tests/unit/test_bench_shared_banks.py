"""bench/shared_banks.py: the shared-memory pipe's wavefronts for hand-made access patterns, and
for a hand-written TTGIR with the W4A16 16-row tile's layouts (Triton 3.6 for sm_90): the
activation copy with lanes across rows (8 wavefronts where 1 would do), the same tile copied
along K as ``[16, 2, 64]`` (1), the activation fragments (2; Nsight Compute measured 2.0x) and
the words read as the MMA's B operand (2; measured 2.0x). The TTGIR goes through the script in
a child process, as a user runs it (Triton 3.9's layout bindings report leaks when a process
that used them exits)."""

# ruff: noqa: E501 (the TTGIR lines below are as Triton prints them)
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from shared_banks import Access, Swizzle, summary, wavefronts  # noqa: E402

LAYOUTS = """\
#across_rows = #ttg.blocked<{sizePerThread = [1, 1, 8], threadsPerWarp = [16, 2, 1], warpsPerCTA = [1, 4, 1], order = [2, 0, 1]}>
#along_k = #ttg.blocked<{sizePerThread = [1, 1, 8], threadsPerWarp = [4, 1, 8], warpsPerCTA = [4, 1, 1], order = [2, 0, 1]}>
#fragments = #ttg.linear<{register = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0], [0, 8, 0]], lane = [[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp = [[0, 0, 0], [0, 0, 0]], block = []}>
#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 4], instrShape = [16, 8]}>
#words = #ttg.swizzled_shared<{vec = 8, perPhase = 1, maxPhase = 4, order = [1, 0]}>
#plain = #ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, order = [2, 1, 0]}>
#flat = #ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, order = [0]}>
#smem = #ttg.shared_memory
#loc = loc("kernel.py":1:0)
#loc1 = loc("xs"(#loc))
#loc2 = loc("words"(#loc))
"""  # fmt: skip
BODY = """\
    %a = ttg.async_copy_global_to_local %p, %b : tensor<16x16x8x!tt.ptr<bf16>, #across_rows> -> <16x16x8xbf16, #plain, #smem, mutable> loc(#loc1)
    %r:2 = scf.for %i = %c0 to %c8 step %c1 iter_args(%x = %a, %y = %a) -> (i32, i32) {
      %c = ttg.async_copy_global_to_local %p, %b : tensor<16x2x64x!tt.ptr<bf16>, #along_k> -> <16x2x64xbf16, #plain, #smem, mutable> loc(#loc1)
      %f = ttg.local_load %b token %t : !ttg.memdesc<16x16x8xbf16, #plain, #smem, mutable> -> tensor<16x16x8xbf16, #fragments> loc(#loc1)
      %w = ttg.local_load %q token %t : !ttg.memdesc<16x128xi32, #words, #smem, mutable> -> tensor<16x128xi32, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> loc(#loc2)
      %s = ttg.local_load %v token %t : !ttg.memdesc<128xf32, #flat, #smem, mutable> -> tensor<128xf32, #ttg.slice<{dim = 0, parent = #mma}>> loc(#loc)
      scf.yield %x, %y : i32, i32
    } loc(#loc)
"""  # fmt: skip


def test_a_warp_of_consecutive_words_is_one_wavefront() -> None:
    assert wavefronts([4 * lane for lane in range(32)], 4) == (1, 1)


def test_lanes_a_row_apart_share_a_bank() -> None:
    assert wavefronts([128 * lane for lane in range(32)], 4) == (32, 1)


def test_lanes_reading_one_word_are_served_at_once() -> None:
    assert wavefronts([0] * 32, 4) == (1, 1)


def test_16_byte_accesses_are_served_a_quarter_warp_at_a_time() -> None:
    assert wavefronts([16 * lane for lane in range(32)], 16) == (4, 4)
    two_rows = [256 * (lane // 4 % 2) + 32 * (lane % 4) for lane in range(32)]
    assert wavefronts(two_rows, 16) == (8, 4)  # the quarter's two rows: the same 4 x 4 banks


def test_swizzle_xors_groups_of_a_row_with_its_phase() -> None:
    words = Swizzle(vec=8, per_phase=1, max_phase=4, order=(1, 0))
    assert words.offset((0, 3), (16, 128)) == 3
    assert words.offset((1, 3), (16, 128)) == 128 + 8 + 3  # group 0 -> 1
    assert words.offset((6, 17), (16, 128)) == 6 * 128 + (2 ^ 2) * 8 + 1  # phase 2: group 2 -> 0
    assert words.offset((4, 9), (16, 128)) == 4 * 128 + 9  # phase 0 again


@pytest.fixture(scope="module")
def accesses(tmp_path_factory):
    ttgir = tmp_path_factory.mktemp("ttgir") / "tile.ttgir"
    ttgir.write_text(LAYOUTS + BODY)
    done = subprocess.run([sys.executable, str(BENCH / "shared_banks.py"), str(ttgir), "--json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = [Access(**{**a, "shape": tuple(a["shape"])}) for a in json.loads(done.stdout)]
    return {(a.op, a.in_loop, a.instructions): a for a in found}


def test_the_copy_with_lanes_across_rows_takes_eight_times_its_wavefronts(accesses) -> None:
    copy = accesses[("async_copy_global_to_local", False, 2)]
    assert (copy.name, copy.vector_bytes, copy.wavefronts, copy.ideal) == ("xs", 16, 64, 8)


def test_the_copy_along_k_is_conflict_free(accesses) -> None:
    copy = accesses[("async_copy_global_to_local", True, 2)]
    assert (copy.vector_bytes, copy.wavefronts, copy.ideal) == (16, 8, 8)


def test_the_fragments_of_an_unswizzled_tile_take_two_wavefronts_a_pass(accesses) -> None:
    fragments = accesses[("local_load", True, 8)]
    assert (fragments.vector_bytes, fragments.wavefronts, fragments.ideal) == (16, 64, 32)


def test_the_words_as_b_operand_meet_two_rows_a_phase(accesses) -> None:
    words = accesses[("local_load", True, 16)]
    assert (words.name, words.vector_bytes, words.wavefronts, words.ideal) == ("words", 4, 32, 16)


def test_a_row_read_in_the_accumulators_column_layout_is_shared_by_its_lanes(accesses) -> None:
    """A slice of the MMA layout (a row of scales): each lane holds 2 adjacent of every 8
    columns, the 8 lanes of a column pair read the same 8 bytes, so a half-warp pass is one
    wavefront of 32 distinct bytes."""
    row = next(a for a in accesses.values() if a.shape == (128,))
    assert (row.vector_bytes, row.instructions, row.wavefronts, row.ideal) == (8, 4, 8, 8)


def test_summary_totals_the_loop_only(accesses) -> None:
    lines = summary(list(accesses.values()))
    loop = [a for a in accesses.values() if a.in_loop]
    assert lines[-1] == (f"loop total: {sum(a.wavefronts for a in loop)} wavefronts a warp an "
                         f"iteration, ideal {sum(a.ideal for a in loop)}")  # fmt: skip
