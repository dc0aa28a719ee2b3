"""Shared fixtures: one real local control plane for the whole run, a namespace per test.

- `cluster` (session): a started `tessera.devcluster.DevCluster` with `.kubeconfig`,
  `.kubectl(*args, check=True, input=None)`, `.env` and `.audit_log`; stopped at the end.
- `namespace` (function): a fresh namespace, deleted after the test.
- `kubectl` (function): `cluster.kubectl`, e.g. `kubectl("get", "pods", "-n", namespace)`.

Tests marked `gpu` are skipped unless torch sees a CUDA device; without one, Triton kernels run
under its interpreter.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import CompletedProcess
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported when a test asks for the cluster: GPU machines lack its packages
    from tessera.devcluster import DevCluster


def pytest_configure(config: pytest.Config) -> None:
    """Without a CUDA device, Triton kernels run under the interpreter. Triton reads the switch
    when a kernel is defined, triton.language's own helpers included, so it is set before any
    test module is imported: e2e modules import runtime code that imports triton."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only paid for when a gpu test is collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


OPERATOR_LOG_LINES = 80


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """A failed test that ran an operator shows the end of the operator's log beside the
    failure (CI keeps nothing else of the run)."""
    report: pytest.TestReport = yield
    operator = getattr(item, "funcargs", {}).get("operator")
    if report.failed and call.when == "call" and hasattr(operator, "text"):
        tail = operator.text().splitlines()[-OPERATOR_LOG_LINES:]
        report.sections.append((f"operator log, last {len(tail)} lines", "\n".join(tail)))
    return report


@pytest.fixture(scope="session")
def cluster() -> Iterator[DevCluster]:
    from tessera.devcluster import DevCluster, ensure_binaries

    binaries = ensure_binaries()
    state_dir = Path(tempfile.mkdtemp(prefix="tessera-cluster-"))
    with DevCluster.create(state_dir, binaries) as running:
        yield running


def _namespace_name(test_name: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"t-{stem}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    cluster.kubectl("create", "namespace", name)
    # Pods are refused until the service-account controller has made `default` here.
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {name}: no default service account after 30 s")
        time.sleep(0.2)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def kubectl(cluster: DevCluster) -> Callable[..., CompletedProcess[str]]:
    return cluster.kubectl
