"""`tessera demo up|down` end to end, as `make demo` runs it, in a state directory of its own
(so it starts its own control plane beside the test session's): up brings the examples to
Ready and prints the deployments, capacity plans and endpoints; a second up reuses everything;
down stops the operator and the cluster and leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 240


def demo(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tessera", "demo", "--state-dir", str(state),
                           *args], capture_output=True, text=True, timeout=UP_TIMEOUT_S + 120)


def test_demo_up_is_idempotent_and_down_cleans_up(tmp_path: Path) -> None:
    state = tmp_path / "state"
    names = [yaml.safe_load(f.read_text())["metadata"]["name"]
             for f in sorted((ROOT / "examples").glob("*/modeldeployment.yaml"))]
    try:
        first = demo(state, "up", "--timeout", str(UP_TIMEOUT_S))
        out = first.stdout
        assert first.returncode == 0, out[-4000:] + first.stderr[-4000:]
        for name in names:
            assert f"{name:10} Ready=True" in out
            assert f"http://{name}-router.llm.svc:8000/v1" in out
        assert "KV tokens/replica" in out  # the capacity table
        assert "installed with 0 replicas" in out
        pid = int((state / "demo" / "operator.pid").read_text())
        assert Path(f"/proc/{pid}").exists()
        assert "command line (the chart's): tessera operator run --leader-election=" in out
        url = (state / "demo" / "operator-metrics-url").read_text().strip()
        with urllib.request.urlopen(url, timeout=10) as response:
            assert 'tessera_operator_reconciles_total{result="ok"}' in response.read().decode()

        second = demo(state, "up", "--timeout", "60")
        assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
        assert "dev cluster already up" in second.stdout
        assert f"operator already running (pid {pid}" in second.stdout
        assert "unchanged" in second.stdout  # kubectl apply of the examples changed nothing
    finally:
        down = demo(state, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"operator: stopped (pid {pid})" in down.stdout
    assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    assert not (state / "dev-cluster").exists() and not (state / "demo").exists()


def _zombie(pid: int) -> bool:
    """A stopped process whose parent (here: whatever adopted it) has not reaped it yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
