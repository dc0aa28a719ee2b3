"""Each command imports only what its install carries.

The operator image installs `tessera[operator]` on a slim Python: no torch, triton, numpy,
safetensors, SGLang, no weight-fetch clients, nor the dev cluster's `cryptography`.
`tessera plan` runs on the base install (pyyaml, pydantic). Each check runs in a fresh
interpreter whose import system refuses the packages the install lacks, as an absent package
would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_AND_ENGINE = ("torch", "triton", "numpy", "safetensors", "sglang", "sgl_kernel", "mooncake")
FETCH_EXTRA = ("huggingface_hub", "hf_xet", "obstore")  # the runtime's fetch Job, not the operator
DEV_CLUSTER = ("cryptography",)
OPERATOR_EXTRA = ("kopf", "kubernetes", "prometheus_client")
NOT_IN_OPERATOR_IMAGE = GPU_AND_ENGINE + FETCH_EXTRA + DEV_CLUSTER
NOT_IN_BASE_INSTALL = NOT_IN_OPERATOR_IMAGE + OPERATOR_EXTRA

# Prepended to each child program: refuses `absent` packages and reports what got imported.
BLOCKER = textwrap.dedent("""
    import json, sys

    ABSENT = frozenset(json.loads(sys.argv[1]))

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ABSENT:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    assert not ABSENT & {m.partition(".")[0] for m in sys.modules}, "imported at start-up"
    sys.meta_path.insert(0, Absent())
""")


def run_without(absent: tuple[str, ...], program: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(program), json.dumps(absent)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1"})


IMPORT_EVERY_OPERATOR_MODULE = """
    import importlib, pkgutil
    import tessera.operator

    failures = []
    for module in pkgutil.walk_packages(tessera.operator.__path__, "tessera.operator."):
        try:
            importlib.import_module(module.name)
        except ImportError as err:
            failures.append(f"{module.name}: {err}")
    print("\\n".join(failures))
    sys.exit(1 if failures else 0)
"""


def test_every_operator_module_imports_with_only_the_operator_image() -> None:
    result = run_without(NOT_IN_OPERATOR_IMAGE, IMPORT_EVERY_OPERATOR_MODULE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_fails_when_the_boundary_is_crossed() -> None:
    # The same check, with the operator's own dependencies refused, must name the modules.
    result = run_without(NOT_IN_BASE_INSTALL, IMPORT_EVERY_OPERATOR_MODULE)
    assert result.returncode == 1
    assert "tessera.operator.handlers: No module named 'kopf'" in result.stdout
    blocked = run_without(NOT_IN_OPERATOR_IMAGE, "import tessera.kernels.w4a16_format")
    assert "No module named 'torch'" in blocked.stderr


@pytest.mark.parametrize("argv", [["operator", "--help"], ["operator", "run", "--help"]])
def test_operator_command_runs_with_only_the_operator_image(argv: list[str]) -> None:
    result = run_without(NOT_IN_OPERATOR_IMAGE, f"""
        from tessera.cli import main
        main({argv!r})
    """)
    assert result.returncode == 0, result.stderr
    assert "usage: tessera operator" in result.stdout


def test_operator_run_imports_its_handlers_with_only_the_operator_image() -> None:
    # What `tessera operator run` imports before it talks to the cluster.
    result = run_without(NOT_IN_OPERATOR_IMAGE, """
        import kopf, prometheus_client
        from tessera.operator import handlers, kube, leader
        from tessera.operator.cli import run_operator
    """)
    assert result.returncode == 0, result.stderr


def test_plan_runs_on_the_base_install() -> None:
    example = ROOT / "examples" / "01-kimi-k2" / "modeldeployment.yaml"
    result = run_without(NOT_IN_BASE_INSTALL, f"""
        from tessera.cli import main
        sys.exit(main(["plan", {str(example)!r}]))
    """)
    assert result.returncode == 0, result.stderr
    assert "decode" in result.stdout


def test_a_missing_package_says_what_to_install() -> None:
    result = run_without(NOT_IN_BASE_INSTALL, """
        from tessera.cli import main
        main(["operator", "run"])
    """)
    assert result.returncode == 1
    assert "tessera operator: needs the Python package 'kopf'" in result.stderr
    assert "pip install 'tessera[operator]'" in result.stderr
    assert "Traceback" not in result.stderr
