"""The operator with only what its image carries, against the real local control plane.

images/operator/Dockerfile installs `tessera[operator]`, non-editable, on a bare Python. Here
the same set goes into a fresh virtual environment (no system site packages) from a copy of
the files the image copies; that environment's `tessera operator run` then reconciles both
examples and a deployment whose INT4 weights are converted by a Job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tessera.operator import constants as c
from test_operator_e2e import (
    Operator,
    apply,
    children,
    claim,
    conditions,
    get_md,
    poll,
    tiny,
    wait_ready,
)

from tessera.devcluster.nodes import NodePool, node_manifest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# What images/operator/Dockerfile copies into its build stage.
IMAGE_FILES = ("pyproject.toml", "setup.py", "README.md")
IMAGE_FOLDERS = ("tessera", "operator", "runtime", "kernels")
NOT_IN_IMAGE = ("torch", "triton", "numpy", "safetensors", "sglang", "huggingface_hub",
                "obstore", "cryptography")
INSTALL_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment holding `tessera[operator]` and its dependencies, nothing else."""
    where = tmp_path_factory.mktemp("operator-image")
    source = where / "src"
    source.mkdir()
    for name in IMAGE_FILES:
        shutil.copy2(ROOT / name, source / name)
    for folder in IMAGE_FOLDERS:
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_USER"))}
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
         "--quiet", "--no-compile", f"{source}[operator]"],
        cwd=where, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return venv


class ImageOperator(Operator):
    """`tessera operator run` from the image's environment, run outside the checkout."""

    def __init__(self, venv: Path, env: dict[str, str], log: Path) -> None:
        bare = {k: v for k, v in env.items() if not k.startswith("PYTHON")}
        super().__init__({**bare, "PYTHONSAFEPATH": "1"}, log)
        self.command = (str(venv / "bin" / "tessera"),)


@pytest.fixture(scope="module")
def spare_nodes(cluster: Any) -> Iterator[None]:
    """Room for both examples and the conversion deployment: a third decode node (Kimi K2
    takes two, GLM 5 one) and a node for the small model's one-GPU pods."""
    nodes = [node_manifest(NodePool("decode"), 2), node_manifest(NodePool("spare"), 0)]
    cluster.kubectl("apply", "-f", "-", input={"apiVersion": "v1", "kind": "List",
                                               "items": nodes})
    names = [n["metadata"]["name"] for n in nodes]
    cluster.kubectl("wait", "--for=condition=Ready", "--timeout=60s",
                    *(f"node/{n}" for n in names))
    yield
    cluster.kubectl("delete", "node", *names, "--wait=false", check=False)


def test_the_image_environment_lacks_the_gpu_and_dev_packages(image_venv: Path) -> None:
    python = str(image_venv / "bin" / "python")
    found = subprocess.run(
        [python, "-c", "import importlib.util, json, sys; print(json.dumps("
         "{m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))", *NOT_IN_IMAGE],
        cwd=image_venv, capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(found.stdout) == dict.fromkeys(NOT_IN_IMAGE, False)
    where = subprocess.run([python, "-c", "import tessera; print(tessera.__file__)"],
                           cwd=image_venv, capture_output=True, text=True, check=True,
                           timeout=60).stdout
    assert where.startswith(str(image_venv)), where  # the installed copy, not the checkout


def test_the_image_operator_reconciles_the_examples_and_a_conversion(
        image_venv: Path, spare_nodes: None, cluster: Any, kubectl: Any, namespace: str,
        tmp_path: Path) -> None:
    kubectl("apply", "-f", str(ROOT / "crds" / "modeldeployment.yaml"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s",
            "crd/modeldeployments.tessera.dev")
    # GLM 5 reads its INT4 weights from a claim; the conversion reads and writes another.
    for name in ("glm5-weights", "ckpt"):
        volume, pvc = claim(name, namespace, str(tmp_path / name))
        volume["metadata"]["name"] = pvc["spec"]["volumeName"] = f"{namespace}-{name}"
        for obj in (volume, pvc):
            apply(kubectl, namespace, obj)
    conv = tiny("conv")
    conv["spec"]["nodePool"] = {"nodeSelector": {"tessera.dev/pool": "spare"}}
    conv["spec"]["decode"]["weights"] = {"dtype": "int4", "uri": "pvc://ckpt/int4",
                                         "convertFrom": {"uri": "pvc://ckpt/fp8"}}

    operator = ImageOperator(image_venv, cluster.env, tmp_path / "operator.log")
    operator.start()
    try:
        for example in ("01-kimi-k2", "02-glm-5"):
            kubectl("apply", "-n", namespace, "-f",
                    str(ROOT / "examples" / example / "modeldeployment.yaml"))
        apply(kubectl, namespace, conv)
        for name in ("kimi-k2", "glm-5", "conv"):
            wait_ready(kubectl, namespace, name, timeout=120)
        # Each deployment's conditions, as the operator in the checkout reports them.
        expected = {"Ready": "True", "Progressing": "False", "Degraded": "False",
                    "PrecisionValid": "True", "CapacityPlanned": "True"}
        for name, extra in (("kimi-k2", {"KVIntegrity": "True"}), ("glm-5", {}),
                            ("conv", {c.WEIGHTS_READY: "True"})):
            md = get_md(kubectl, namespace, name)
            got = {t: cond["status"] for t, cond in conditions(md).items()}
            want = {**expected, **extra}
            assert {t: got.get(t) for t in want} == want, (name, conditions(md))
            assert md["status"]["observedGeneration"] == md["metadata"]["generation"]
        weights = conditions(get_md(kubectl, namespace, "conv"))[c.WEIGHTS_READY]
        assert weights["reason"] == "Converted"
        (job,) = json.loads(kubectl("get", "jobs", "-n", namespace, "-o", "json").stdout)["items"]
        assert job["metadata"]["labels"][c.LABEL_DEPLOYMENT] == "conv"
        memory = job["spec"]["template"]["spec"]["initContainers"][0]["resources"]["limits"]
        assert int(memory["memory"]) > 1 << 30  # sized without the converter's own code
        assert len(children(kubectl, namespace, "kimi-k2")) == 18
        poll("a resync after Ready", lambda: "resync:" in operator.text(), timeout=30)
    finally:
        operator.stop()
    log = operator.text()
    assert "Traceback" not in log and "No module named" not in log, log[-3000:]
