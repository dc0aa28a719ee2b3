"""tessera-runtime as a process: exit codes, termination messages, the engine supervisor."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tessera.runtime.config import (
    ENV_CONFIG,
    ENV_DIST_INIT_ADDR,
    ENV_NODE_RANK,
    ModelConfig,
    ParallelConfig,
    PortsConfig,
    RuntimeConfig,
)
from tessera.runtime.main import Stop, main, node_placement, run_engine
from tessera.runtime.preflight import Failure
from tessera.runtime.sglang_args import NodePlacement

no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="checks the no-GPU path; this machine has a GPU")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp_path: Path, **fields) -> Path:
    config = RuntimeConfig(deployment="glm", namespace="llm", phase="single",
                           model=ModelConfig(name="glm", path=str(tmp_path / "model")),
                           ports=PortsConfig(metrics=free_port()), **fields)
    path = tmp_path / "runtime.json"
    path.write_text(config.to_json())
    return path


@no_gpu_here
@pytest.mark.parametrize("command", ["preflight", "serve"])
def test_no_gpu_stops_with_its_code_and_message(tmp_path, caplog, command):
    config, term = write_config(tmp_path), tmp_path / "termination-log"
    code = main([command, "--config", str(config), "--termination-log", str(term)])
    assert code == Failure.NO_GPU == 11
    message = term.read_text()
    assert message.startswith("preflight failed: no CUDA GPU is visible; this single pod needs 1")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [message]  # one log line, the same text


def test_config_from_env_when_no_flag(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CONFIG, str(tmp_path / "missing.json"))
    term = tmp_path / "termination-log"
    assert main(["preflight", "--termination-log", str(term)]) == Failure.CONFIG
    assert "cannot read runtime config" in term.read_text()
    assert "missing.json" in term.read_text()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("phase: decode\n", "deployment: Field required"),
        ("{not yaml", "not valid JSON or YAML"),
    ],
)
def test_bad_config_exits_2_with_the_reason(tmp_path, text, message):
    config, term = tmp_path / "runtime.yaml", tmp_path / "termination-log"
    config.write_text(text)
    assert main(["serve", "--config", str(config), "--termination-log", str(term)]) == 2
    assert message in term.read_text()


def test_no_config_at_all(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    term = tmp_path / "termination-log"
    assert main(["router", "--termination-log", str(term)]) == Failure.CONFIG
    assert "pass --config PATH or set $TESSERA_RUNTIME_CONFIG" in term.read_text()


def test_node_placement_from_env(tmp_path):
    two_nodes = RuntimeConfig.from_file(write_config(
        tmp_path, parallel=ParallelConfig(tensor=16, nnodes=2)))
    one_node = RuntimeConfig.from_file(write_config(tmp_path))
    assert node_placement(one_node, {}) is None
    env = {ENV_NODE_RANK: "1", ENV_DIST_INIT_ADDR: "glm-0.glm:20000"}
    assert node_placement(two_nodes, env) == NodePlacement(1, "glm-0.glm:20000")
    with pytest.raises(Stop, match="set .TESSERA_NODE_RANK .0..1. and .TESSERA_DIST_INIT_ADDR"):
        node_placement(two_nodes, {ENV_NODE_RANK: "x"})


def test_engine_exit_code_is_passed_on():
    assert run_engine([sys.executable, "-c", "raise SystemExit(7)"], os.environ) == 7


SUPERVISOR = """
import os, sys
from tessera.runtime.main import run_engine
child = "import time; print('up', flush=True); time.sleep(60)"
sys.exit(run_engine([sys.executable, "-c", child], os.environ))
"""


def test_sigterm_reaches_the_engine():
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGTERM)
        # The child dies of the forwarded SIGTERM; the supervisor reports 128 + 15.
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
