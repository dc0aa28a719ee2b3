"""The Gluon FP8 MLA kernel builds for Hopper without a GPU (Triton's bundled ptxas): no
register spills, within an SM's shared memory. Its results are checked on the GPU
(test_mla_variants.py); this catches, on CPU, a change to the kernel or to Gluon's API that
no longer builds or that spills.

Gluon does not build under Triton's interpreter, which the CPU test session switches on, so
the build runs in a child process without it (this file as a script)."""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SM90_SHARED_PER_BLOCK = 232_448  # 227 KB: the most one block may take on sm_90
POINTERS = ("Q", "KV", "KV_SCALE", "seq_lens", "indptr", "indices", "part_out", "part_lse")


def build(page_size: int, entries_per_page: int, balanced: bool) -> dict:
    """Compile for sm_90; its shared memory, resource line and whether the SASS has wgmma and
    spills."""
    import triton
    from tessera.kernels.mla_decode_wgmma import mla_fp8_wgmma_kernel as fn
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    types = {"Q": "*bf16", "KV": "*fp8e4nv", "KV_SCALE": "*fp32", "part_out": "*fp32",
             "part_lse": "*fp32", "sm_scale_log2e": "fp32"}  # fmt: skip
    constexprs = {"PAGE_SIZE": page_size, "ENTRIES_PER_PAGE": entries_per_page,
                  "LENS_ARE_ENDS": entries_per_page > 1, "BALANCED": balanced, "D": 512,
                  "D_ROPE": 64, "BLOCK_H": 16, "BLOCK_N": 64}  # fmt: skip
    signature = {a: "constexpr" if a in constexprs else types.get(a, "*i32" if a in POINTERS
                                                                   else "i32")
                 for a in fn.arg_names}  # fmt: skip
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in POINTERS}
    src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "mla.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage, sass = (
            subprocess.run([str(cuobjdump), flag, str(cubin)], capture_output=True, text=True,
                           check=True).stdout
            for flag in ("--dump-resource-usage", "-sass")
        )  # fmt: skip
    return {
        "shared": kernel.metadata.shared,
        "usage": " ".join(re.findall(r"\w+:\d+", usage)),
        "wgmma": "HGMMA" in sass,
        "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
    }


@pytest.mark.parametrize(("page_size", "entries_per_page", "balanced"),
                         [(64, 1, False), (64, 64, True), (16, 1, True)])  # fmt: skip
def test_gluon_mla_kernel_builds_for_hopper_without_spills(page_size, entries_per_page, balanced):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [str(page_size), str(entries_per_page), str(int(balanced))]
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert built["wgmma"], built
    assert built["spills"] == 0 and "STACK:0" in built["usage"], built
    assert built["shared"] <= SM90_SHARED_PER_BLOCK, built


if __name__ == "__main__":
    page, entries, balanced = (int(a) for a in sys.argv[1:4])
    print(json.dumps(build(page, entries, bool(balanced))))
