"""The Gluon FP8 MLA kernel builds for Hopper without a GPU (Triton's bundled ptxas): with
wgmma, no register spills, within an SM's shared memory. Its results are checked on the GPU
(test_mla_variants.py); this catches, on CPU, a change to the kernel or to Gluon's API that
no longer builds or that spills. Every build runs twice: with the installed Triton and with the
engine image's (``scripts/gpu-image-triton.txt``, which makes the binaries that run on the GPU;
``scripts/setup.sh`` puts it in the cache). Where the two allocate registers differently, the
strict checks hold for the image's.

Gluon does not build under Triton's interpreter, which the CPU test session switches on, so
``bench/mla_sass.py``'s report runs in a child process without it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tessera.kernels.paged_decode_split import HEADS_STREAM_MAX_BATCH, STREAM_MAX_BATCH

from tessera.devcluster.build import cache_root

SM90_SHARED_PER_BLOCK = 232_448  # 227 KB: the most one block may take on sm_90
ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
GPU_IMAGE_TRITON = next(line.removeprefix("triton==") for line in
                        (ROOT / "scripts" / "gpu-image-triton.txt").read_text().splitlines()
                        if line and not line.startswith("#"))  # fmt: skip


def gpu_image_triton_dir() -> Path:
    """Where ``scripts/setup.sh`` installs the engine image's Triton."""
    return cache_root() / "gpu-image-triton" / GPU_IMAGE_TRITON


@pytest.fixture(params=["installed", "gpu_image"])
def triton_dir(request) -> Path | None:
    """Where the Triton to build with is: None for the installed one, or the engine image's."""
    if request.param == "installed":
        return None
    path = gpu_image_triton_dir()
    if not (path / "triton" / "__init__.py").exists():
        pytest.skip(f"Triton {GPU_IMAGE_TRITON} is not in {path}: run scripts/setup.sh")
    return path


@pytest.fixture
def report(triton_dir):
    """``_report`` with the installed Triton, or with the engine image's."""
    return lambda call: _report(call, triton_dir)


@pytest.mark.parametrize(("page_size", "entries_per_page", "balanced"),
                         [(64, 1, False), (64, 64, True), (16, 1, True)])  # fmt: skip
@pytest.mark.parametrize(("heads", "fp8"), [(16, True), (64, False)])
def test_gluon_mla_kernel_builds_for_hopper_without_spills(
    page_size, entries_per_page, balanced, heads, fp8, report
):
    """The 16-heads FP8 kernel and the 64-heads kernel over BF16 pages. The 64-heads kernel
    over FP8 pages uses all 255 registers and spills outside its tile loop (a test below)."""
    built = report(f"gluon_report({balanced}, {page_size}, {entries_per_page}, {heads}, {fp8})")
    assert built["spills"] == 0 and "STACK:0" in built["resources"], built


@pytest.mark.parametrize(("page_size", "entries_per_page", "balanced"),
                         [(64, 1, False), (64, 64, True), (16, 1, True)])  # fmt: skip
@pytest.mark.parametrize("in_place", [False, True])
def test_gluon_e4m3_kernel_builds_for_hopper_without_spills(
    page_size, entries_per_page, balanced, in_place, report
):
    """The kernel with both products in e4m3: five tile slots, q, p and the scratch within an
    SM's shared memory (its partial output is stored from the MMA's layout for that). It uses
    all 255 registers (V^T is an MMA operand in registers): no spills with the GPU image's
    Triton 3.6; 3.9 allocates them differently (a few spill instructions), so there only the
    build is checked. The in-place version (V^T written over the tile by the producer) has no
    spills with either."""
    built = report(f"gluon_report({balanced}, {page_size}, {entries_per_page}, 16, True, True, "
                   f"{in_place})")
    if not in_place:  # its producer copies the scales with each tile: no global load waits
        assert not built["tile_loop"].get("LDG"), built
    if in_place or built["triton"] == GPU_IMAGE_TRITON:
        assert built["spills"] == 0 and "STACK:0" in built["resources"], built


@pytest.mark.parametrize(("page_size", "entries_per_page", "balanced"),
                         [(64, 1, False), (64, 64, True), (16, 1, True)])  # fmt: skip
def test_gluon_e4m3_kernel_on_128_token_tiles_builds_without_spills(
    page_size, entries_per_page, balanced, report
):
    """The register kernel on 128-token tiles (two consumer warpgroups, two tile slots, the
    producer holding half a tile in registers): within shared memory, an e4m3 MMA and no global
    load in the tile loop; no spills with the GPU image's Triton 3.6 (3.9: 8 bytes of stack)."""
    built = report(f"gluon_report({balanced}, {page_size}, {entries_per_page}, 16, True, True, "
                   f"False, 0, True)")
    assert built["shared"] <= SM90_SHARED_PER_BLOCK, built
    loop = built["tile_loop"]
    if built["triton"] == GPU_IMAGE_TRITON:
        assert built["spills"] == 0 and "STACK:0" in built["resources"], built
    assert loop.get("QGMMA") and not loop.get("LDG"), built


@pytest.mark.parametrize("one_piece", [True, False], ids=["one_piece", "pieces"])
def test_gluon_e4m3_kernel_on_128_token_tiles_keeps_its_mmas_in_flight(one_piece, report):
    """ptxas does not serialize the 128-token kernel's wgmma (its advisory C7512, "insufficient
    register resources": each MMA would wait for the one before). Two binaries: the one the JIT
    builds for one piece a split (``pieces`` the constant 1), and the one for two or more, whose
    MMAs ptxas serialized while the pieces were a loop around the tile loop
    (docs/kernels-fp8-kv.md, "The token cap in pieces")."""
    built = report(f"gluon_report(False, 64, 1, 16, True, True, False, 0, True, False, "
                   f"{one_piece})")
    assert not built["wgmma_serialized"], built


@pytest.mark.parametrize("wide_tiles", [False, True])
def test_gluon_e4m3_kernel_with_the_query_in_its_consumer_builds(wide_tiles, report):
    """The consumer writing the query (``Q_IN_CONSUMER``) takes no more shared memory, and its
    tile loop is the same (built with the engine image's Triton, the same MMAs, shared-memory
    and barrier instructions: its integer bookkeeping may schedule one apart), an e4m3 MMA and
    no global load; no spills with Triton 3.6."""
    built = report(f"gluon_report(True, 64, 64, 16, True, True, False, 0, {wide_tiles}, True)")
    main = report(f"gluon_report(True, 64, 64, 16, True, True, False, 0, {wide_tiles}, False)")
    assert built["shared"] == main["shared"] <= SM90_SHARED_PER_BLOCK, built
    if built["triton"] == GPU_IMAGE_TRITON:
        assert _work(built["tile_loop"]) == _work(main["tile_loop"]), (built, main)
    else:
        assert built["tile_loop"] == main["tile_loop"], (built, main)
    assert built["tile_loop"].get("QGMMA") and not built["tile_loop"].get("LDG"), built
    if built["triton"] == GPU_IMAGE_TRITON:
        assert built["spills"] == 0 and "STACK:0" in built["resources"], built


@pytest.mark.parametrize(("entries_per_page", "batch"), [(1, 300), (64, STREAM_MAX_BATCH)])
def test_gluon_stream_kernel_builds_with_a_spill_free_tile_loop(entries_per_page, batch, report):
    """The e4m3 kernel on the stream schedule, up to its largest batch (the requests' ends in
    shared memory beside the tile slots). Setting up a piece and storing its output spill; with
    the GPU image's Triton 3.6 the tile loop does not (3.9 reloads 5 words in it, so there only
    the build is checked, as for the register kernel above)."""
    built = report(f"gluon_report(False, 64, {entries_per_page}, 16, True, True, False, {batch})")
    loop = built["tile_loop"]
    assert loop.get("QGMMA") and not loop.get("LDG"), built
    if built["triton"] == GPU_IMAGE_TRITON:
        assert not loop.get("STL") and not loop.get("LDL"), built


@pytest.mark.parametrize(("page_size", "entries_per_page"), [(64, 1), (64, 64)])
def test_gluon_heads_kernel_over_fp8_pages_keeps_spills_out_of_its_tile_loop(
    page_size, entries_per_page, report
):
    """All 255 registers: the GPU image's Triton 3.6 spills 3 words (8 bytes of stack) while
    setting up a split, none in the tile loop; 3.9 spills 88-104 bytes, in the loop too, so
    there only the build is checked."""
    built = report(f"gluon_report(True, {page_size}, {entries_per_page}, 64, True)")
    loop = built["tile_loop"]
    assert loop.get("HGMMA"), built
    if built["triton"] == GPU_IMAGE_TRITON:
        assert not loop.get("STL") and not loop.get("LDL"), built


@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_heads_stream_kernel_fits_its_largest_batch(fp8, report):
    """The heads-as-M kernel on the stream schedule at HEADS_STREAM_MAX_BATCH requests: their
    ends fit in shared memory beside the query, two tiles and p (``_report`` checks the 227
    KB), and its tile loop is the split kernel's: 40 MMAs (36 for the scores, 4 for the
    output), with no spill in it with the GPU image's Triton 3.6 (setting up a piece spills)."""
    built = report(f"gluon_report(False, 64, 64, 64, {fp8}, False, False, "
                   f"{HEADS_STREAM_MAX_BATCH})")  # fmt: skip
    loop = built["tile_loop"]
    assert loop.get("HGMMA") == 40, built
    if built["triton"] == GPU_IMAGE_TRITON:
        assert not loop.get("STL") and not loop.get("LDL"), built


def _work(loop: dict) -> dict:
    """A loop's MMA, memory and barrier opcodes with their counts."""
    kinds = ("QGMMA", "HGMMA", "WARPGROUP", "LD", "ST", "SYNCS", "BAR")
    return {op: n for op, n in loop.items() if op.startswith(kinds)}


def offline_build(script: str, call: str, triton_dir: Path | None = None) -> dict:
    """The JSON of ``call`` (a report function of ``bench/<script>.py`` on a build for sm_90),
    run in a child process without the interpreter (with ``triton_dir``: the Triton there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_dir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(triton_dir),
                                                          env.get("PYTHONPATH")]))  # fmt: skip
    function = call.split("(")[0]
    program = (f"import json, sys; sys.path.insert(0, {str(BENCH)!r}); "
               f"from {script} import {function}; print(json.dumps({call}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(call: str, triton_dir: Path | None = None) -> dict:
    """``bench/mla_sass.py``'s report on a build, checked for wgmma, an SM's shared memory and
    the MMAs' register operands."""
    built = offline_build("mla_sass", call, triton_dir)
    assert built["wgmma"], built
    assert built["shared"] <= SM90_SHARED_PER_BLOCK, built
    # no register an MMA in flight reads as its A operand (the e4m3 kernels' P) is written
    # before that MMA is waited for (the INT4 Gluon GEMM once lost parts of elements so)
    assert built["a_operand_hazards"] == [], built
    return built
