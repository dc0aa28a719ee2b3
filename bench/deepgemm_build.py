"""Build DeepGEMM's Python extension (``deep_gemm._C``) in place, against the installed torch.

SGLang 0.5.23 pins the ``sgl-deep-gemm`` wheel (its fork of DeepGEMM, 0.2.3.post2), whose
library is linked against another torch's C++ ABI: on the GPU machine's torch 2.11 it fails to
load (undefined ``c10::cuda::CUDAErrorLogCapture``), and the wheel carries no sources to rebuild
it. This builds upstream DeepGEMM instead, from a checkout with its ``cutlass`` and ``fmt``
submodules, as its setup.py does minus the packaging: cute's and cutlass's headers copied into
``deep_gemm/include`` (where its JIT compiler looks for them when it compiles a kernel), then one
g++ call for ``csrc/python_api.cpp`` with torch's, Python's and CUDA's headers. After it,
``PYTHONPATH=SRC`` imports ``deep_gemm``; its kernels compile with nvcc on first use.

    python bench/deepgemm_build.py --src DEEPGEMM_DIR [--cuda /usr/local/cuda]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="DeepGEMM checkout with submodules")
    ap.add_argument("--cuda", type=Path, default=Path("/usr/local/cuda"))
    args = ap.parse_args()
    src, cuda = args.src.resolve(), args.cuda
    include = src / "deep_gemm" / "include"
    for name in ("cute", "cutlass"):  # the JIT's include path
        if not (include / name).exists():
            shutil.copytree(src / "third-party" / "cutlass" / "include" / name, include / name)
    torch_lib = Path(torch.__file__).parent / "lib"
    out = src / "deep_gemm" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    command = [
        "g++", "-std=c++20", "-O3", "-fPIC", "-shared", "-Wno-psabi",
        "-Wno-deprecated-declarations",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{d}" for d in cpp_extension.include_paths()),
        f"-I{sysconfig.get_paths()['include']}", f"-I{cuda / 'include'}",
        f"-I{cuda / 'include' / 'cccl'}", f"-I{include}",
        f"-I{src / 'third-party' / 'fmt' / 'include'}",
        str(src / "csrc" / "python_api.cpp"), "-o", str(out),
        f"-L{cuda / 'lib64'}", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}",
        "-lcudart", "-lnvrtc", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        "-lc10_cuda", "-ltorch_cuda",
    ]  # fmt: skip
    t0 = time.time()
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    print(f"built {out} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
