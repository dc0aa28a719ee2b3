"""The Gluon INT4 GEMM (``w4a16_wgmma.py``) builds for Hopper without a GPU (Triton's bundled
ptxas): its K loop runs warpgroup MMAs whose decoded weights never pass through shared memory
(the loop's only shared stores are the eight activation planes; the packed words arrive
through a ``cp.async`` ring), with no register spills, with per-weight scales one step's MMAs
still running through the next step's copies and staging, and no register an MMA in flight
reads rewritten before it is waited for. Its results are checked on the GPU
(test_w4a16_kernels.py).

Gluon does not build under Triton's interpreter, which the CPU test session switches on, so
``bench/w4a16_sass.py``'s report runs in a child process without it."""

import pytest
from test_mla_wgmma_compile import SM90_SHARED_PER_BLOCK, offline_build


@pytest.mark.parametrize(("bm", "warps"), [(8, 4), (64, 4), (16, 8), (64, 8)])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize(("split", "stages"), [(False, 4), (True, 8)])
def test_wgmma_gemm_builds_with_register_weights(bm, warps, group, split, stages):
    built = offline_build("w4a16_sass", f"wgmma_report({bm}, {group}, {split}, {stages}, {warps})")
    loop = built["loop"]
    assert loop.get("HGMMA") == 8, built  # eight planes a K step (a warpgroup's own)
    assert loop.get("STS") == 8, built  # the activation planes only: no decoded weights
    assert "STACK:0" in built["resources"] and not loop.get("STL"), built
    assert built["shared"] <= SM90_SHARED_PER_BLOCK, built
    # per-weight scales: one step's eight MMAs stay in flight (7: the wait after their issue
    # leaves them) through the next step's copies and staging, and are waited for (0) before
    # its decode rewrites the registers they read; group 128 waits for each step's partial sum
    assert built["mma_waits"] == ([0, 7] if group < 128 else [0]), built
    # no register an MMA in flight reads as its A operand is written before the MMA is waited
    # for (PTX leaves what it then reads undefined; the kernel once lost parts of elements so)
    assert built["a_operand_hazards"] == [], built


@pytest.mark.parametrize(("bm", "warps"), [(8, 4), (64, 8)])
def test_counted_split_builds_its_reduction_and_keeps_the_loop(bm, warps):
    # K splits met in the workspace, launched dependently: the same K loop, no spills, and an
    # epilogue that adds each part, counts it, and exchanges the count and the sum back to zero
    built = offline_build("w4a16_sass", f"wgmma_report({bm}, 32, True, 4, {warps}, True, True)")
    assert built["loop"].get("HGMMA") == 8 and built["mma_waits"] == [0, 7], built
    assert built["a_operand_hazards"] == [], built
    assert "STACK:0" in built["resources"] and not built["loop"].get("STL"), built
    elements = 64 * warps // 4 * bm // (32 * warps)  # a thread's share of the output tile
    adds = built["atomics"].get("REDG.E.ADD", 0) + built["atomics"].get("ATOMG.E.ADD", 0)
    assert adds == 2 * elements, built  # its part and its count, per element
    assert built["atomics"].get("ATOMG.E.EXCH") == 2 * elements, built  # count and sum reset
