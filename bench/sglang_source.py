"""SGLang's own Triton kernels, read from its source files without importing SGLang (whose
runtime needs packages the benchmark machines lack): the benchmarks run them as peers."""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

SGLANG_FILES = {  # file -> where the SGLang 0.5.23 wheel installs it
    "fused_moe_triton_kernels.py": "sglang/kernels/ops/moe",
    "fp8_kernel.py": "sglang/kernels/ops/quantization",
    "moe_fused_gate.py": "sglang/kernels/ops/moe",
}


def find_sglang_source(name: str, src_dir: Path | None = None) -> Path:
    """One of SGLang's kernel source files: in ``src_dir`` if given, else in the installed
    package (found on sys.path without importing SGLang)."""
    candidates = [src_dir / name] if src_dir else []
    candidates += [Path(p) / SGLANG_FILES[name] / name for p in sys.path if p]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"SGLang's {name} not found (pass --sglang-src)")


def load_triton_functions(path: Path, names: set[str]) -> dict[str, Any]:
    """The ``@triton.jit`` functions ``names`` of a source file, without importing the rest of
    its module. Triton reads a kernel's source lines, so they are written to a file first."""
    source = path.read_text()
    tree = ast.parse(source)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    if {n.name for n in nodes} != names:
        raise SystemExit(f"{path} lacks {names - {n.name for n in nodes}}")
    body = "\n\n\n".join("@triton.jit\n" + (ast.get_source_segment(source, n) or "") for n in nodes)
    imports = ("import triton", "import triton.language as tl",
               "from triton.language.extra import libdevice")  # fmt: skip
    text = "\n".join(imports) + "\n\n\n" + body + "\n"
    # one file per content, written whole before it appears: processes loading other functions
    # of the same source file at once (bench/deepgemm.py's compile pool) never read a partial one
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    scratch = Path(tempfile.gettempdir()) / "tessera_sglang_kernels" / f"{path.stem}_{digest}.py"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    if not scratch.exists():
        with tempfile.NamedTemporaryFile("w", dir=scratch.parent, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, scratch)
    namespace: dict[str, Any] = {"__name__": f"sglang_{path.stem}"}
    exec(compile(text, str(scratch), "exec"), namespace)
    return {name: namespace[name] for name in names}
