"""Build SGLang 0.5.23's JIT kernels ahead of time, the way SGLang's JIT loader builds them on
first use, so a benchmark can load them without SGLang's runtime: Marlin (dense
``gptq_marlin_gemm``, MoE ``moe_wna16_marlin_gemm``, the weight repack ``gptq_marlin_repack``)
and the MoE router's GEMM (``tiny_gemm_bf16`` with fp32 output, one module per router shape, as
SGLang's DeepSeek-family gate runs it up to 16 tokens on Hopper).

SGLang compiles each kernel as one CUDA unit that includes the kernel's header and exports its
entry point through TVM-FFI, with ``-std=c++20 -O3 --expt-relaxed-constexpr
-DSGL_CUDA_ARCH=900 -gencode=arch=compute_90a,code=sm_90a``, and links it against libtvm_ffi
and libcudart. This script does the same with the same flags, plus ``--split-compile=0``
(device-code optimization on all cores; SGLang's loader runs one nvcc per unit, which took
over 6 minutes for Marlin on one core), building the units at once. Needs nvcc (no GPU), the
``apache-tvm-ffi`` package of the machine that will load the modules, and the kernels' source
tree (``sglang/kernels/jit`` of the sglang wheel: ``include/`` and ``csrc/gemm/``).

    python bench/sglang_jit_build.py --src JIT_DIR --out DIR [--only dense,moe,repack]
        [--router 384:7168 --router 256:6144 [--sms 132]]

Writes ``marlin_<unit>.so``, ``tiny_gemm_<N>x<K>.so`` and ``sglang_jit_build.json`` (commands,
seconds, compiler output) into DIR; a benchmark loads a module with ``tvm_ffi.load_module``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

# unit -> (header under csrc/, exported name, the C++ function it resolves to). The MoE's
# template flags are SGLang's defaults for bf16 without expert parallelism or bias.
UNITS = {
    "dense": ("gemm/marlin/gptq_marlin.cuh", "gptq_marlin_gemm", "gptq_marlin_gemm<bf16_t>"),
    "moe": (
        "gemm/marlin_moe/moe_wna16_marlin.cuh",
        "moe_wna16_marlin_gemm",
        "moe_wna16_marlin_gemm<bf16_t, false, false, false, false, false>",
    ),
    # GPTQ's packed codes [K / 8, N] into Marlin's tiles (what SGLang runs at weight load)
    "repack": ("gemm/marlin/gptq_marlin_repack.cuh", "gptq_marlin_repack", "gptq_marlin_repack"),
}
TINY_GEMM_MAX_M = 16  # SGLang's tiny_router_gemm_max_tokens on Hopper: the module's row limit
FFI_HEADERS = ("container/tensor.h", "dtype.h", "error.h", "extra/c_env_api.h", "function.h")


def tiny_gemm_unit(n: int, k: int, sms: int) -> tuple[str, str, str]:
    """The router GEMM's unit for weights ``[n, k]`` (k > n: SGLang's tiny-N variant, a block
    of k / 16 threads over K, walking ``n_split`` columns). ``n_split`` follows SGLang's
    ``_default_n_gemm_n_split``: the smallest divisor of n whose blocks (n / n_split) fit one
    wave of ``sms`` SMs, at most (k / 16) / 16."""
    block = k // 16
    if k <= n or k % 16 or block % 32 or not TINY_GEMM_MAX_M <= block <= 1024:
        raise SystemExit(f"router {n}:{k}: not a shape SGLang's tiny-N GEMM serves")
    splits = [d for d in range(1, min(n, block // TINY_GEMM_MAX_M) + 1) if n % d == 0]
    split = next((d for d in splits if n // d <= sms), splits[-1])
    function = f"TinyNGemmKernel<{n}, {k}, {TINY_GEMM_MAX_M}, {split}, fp32_t, true, bf16_t>::run"
    return "gemm/tiny_gemm.cuh", "run", function


def unit_source(header: Path, export: str, function: str) -> str:
    """The CUDA unit: TVM-FFI's headers, the kernel's header, one exported function."""
    lines = [f"#include <tvm/ffi/{h}>" for h in FFI_HEADERS]
    lines += [f'#include "{header}"', "namespace sglang {",
              f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({export}, ({function}));", "}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="sglang/kernels/jit of the wheel")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=",".join(UNITS),
                    help=f"comma-separated Marlin units to build, of {','.join(UNITS)} "
                         "(empty: none)")  # fmt: skip
    ap.add_argument("--router", action="append", default=[], metavar="N:K",
                    help="a router GEMM shape [N, K] to build SGLang's tiny GEMM for")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    args = ap.parse_args()
    from tvm_ffi.libinfo import find_dlpack_include_path, find_include_path, find_libtvm_ffi

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cuda_home = Path(nvcc).resolve().parent.parent
    lib = Path(find_libtvm_ffi())
    includes = [find_include_path(), find_dlpack_include_path(), str(args.src / "include")]
    flags = ["-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a",
             "-DSGL_CUDA_ARCH=900", "-std=c++20", "-O3", "--expt-relaxed-constexpr",
             "--split-compile=0", *(f"-I{p}" for p in includes)]  # fmt: skip
    link = ["-shared", f"-L{lib.parent}", f"-l{lib.stem.removeprefix('lib')}",
            f"-L{cuda_home}/lib64", f"-L{cuda_home}/lib",  # a toolkit's, or the pip wheels'
            "-lcudart", f"-Wl,-rpath,{lib.parent}"]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only.split(",") if n]
    if unknown := set(names) - set(UNITS):
        raise SystemExit(f"unknown units {sorted(unknown)}; choose from {', '.join(UNITS)}")
    units = {f"marlin_{name}": UNITS[name] for name in names}
    for shape in args.router:
        n, k = map(int, shape.split(":"))
        units[f"tiny_gemm_{n}x{k}"] = tiny_gemm_unit(n, k, args.sms)
    started, procs, record = {}, {}, {"nvcc": nvcc, "sms": args.sms, "units": {}}
    for name, (header, export, function) in units.items():
        unit = args.out / f"{name}.cu"
        unit.write_text(unit_source((args.src / "csrc" / header).resolve(), export, function))
        obj = args.out / f"{name}.o"
        cmd = [nvcc, *flags, "-c", str(unit), "-o", str(obj)]
        started[name] = time.monotonic()
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)  # fmt: skip
        record["units"][name] = {"compile": " ".join(cmd)}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        entry = record["units"][name]
        entry.update(compile_s=time.monotonic() - started[name], rc=proc.returncode,
                     log=out[-4000:])  # fmt: skip
        if proc.returncode == 0:
            so = args.out / f"{name}.so"
            cmd = ["g++", str(args.out / f"{name}.o"), *link, "-o", str(so)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            entry.update(link=" ".join(cmd), link_rc=res.returncode, link_log=res.stderr[-2000:],
                         so_bytes=so.stat().st_size if so.exists() else 0)  # fmt: skip
        print(f"{name}: rc {proc.returncode} in {entry['compile_s']:.0f} s", flush=True)
    (args.out / "sglang_jit_build.json").write_text(json.dumps(record, indent=1))
    os.sync()


if __name__ == "__main__":
    main()
