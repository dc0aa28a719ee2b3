"""The KV transfer inside the pod: preflight finds (or misses) the RDMA devices the config
names and picks the transport, the backend's environment says that transport, and SGLang's
own parser reads the argv that goes with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tessera.runtime.config import (
    ENGINE_VERSION,
    ConfigError,
    DisaggregationConfig,
    KVCacheConfig,
    ModelConfig,
    RuntimeConfig,
)
from tessera.runtime.main import engine_env
from tessera.runtime.preflight import (
    CheckpointFacts,
    Failure,
    GpuFacts,
    RdmaFacts,
    probe_rdma,
    run_preflight,
)
from tessera.runtime.sglang_args import TRANSFER_ENV, sglang_argv, transfer_env

GPUS = [GpuFacts(index=i, name="NVIDIA H200", capability=(9, 0), total_bytes=141 << 30,
                 free_bytes=140 << 30) for i in range(8)]
CHECKPOINT = CheckpointFacts(path="/models/kimi", is_dir=True, config={},
                             weight_files=("model.safetensors",))
TWO_NICS = RdmaFacts(devices=("mlx5_0", "mlx5_1"), verbs_files=("uverbs0", "uverbs1"))


def config(phase: str = "decode", **disaggregation) -> RuntimeConfig:
    return RuntimeConfig(deployment="kimi", namespace="llm", phase=phase,
                         model=ModelConfig(name="kimi", path="/models/kimi"),
                         kv_cache=KVCacheConfig(dtype="bf16"),
                         disaggregation=DisaggregationConfig(**disaggregation))


def preflight(cfg: RuntimeConfig, rdma: RdmaFacts | None):
    return run_preflight(cfg, GPUS, CHECKPOINT, ENGINE_VERSION, rdma)


def test_rdma_present_runs_over_rdma():
    result = preflight(config(rdma=True, ib_devices=("mlx5_1",)), TWO_NICS)
    assert result.passed and result.transport == "rdma"
    assert result.summary.endswith("; KV transfer: mooncake over RDMA (mlx5_1)")


def test_rdma_auto_uses_whatever_the_pod_has():
    result = preflight(config(rdma=True, transfer_backend="nixl"), TWO_NICS)
    assert result.passed and result.transport == "rdma"
    assert result.summary.endswith("; KV transfer: nixl over RDMA (mlx5_0, mlx5_1)")


@pytest.mark.parametrize("facts, ib_devices, why", [
    (RdmaFacts(), (), "no RDMA device in /sys/class/infiniband, but this decode pod is "
                      "configured for RDMA (devices: auto)"),
    (TWO_NICS, ("mlx5_0", "mlx5_4"), "RDMA device(s) mlx5_4 not in /sys/class/infiniband "
                                     "(found mlx5_0, mlx5_1)"),
    (RdmaFacts(devices=("mlx5_0",)), (), "RDMA device(s) mlx5_0 exist but /dev/infiniband has "
                                         "no uverbs device files"),
], ids=["absent", "named-device-missing", "no-device-files"])
def test_rdma_absent_refuses_to_start(facts, ib_devices, why):
    result = preflight(config(rdma=True, ib_devices=ib_devices), facts)
    assert not result.passed and result.transport is None
    assert result.exit_code == Failure.RDMA_DEVICES == 17
    assert why in result.summary
    assert "set spec.transfer.allowTCP to run over TCP" in result.summary


def test_rdma_absent_with_tcp_allowed_starts_over_tcp():
    result = preflight(config(rdma=True, ib_devices=("mlx5_0",), allow_tcp=True), RdmaFacts())
    assert result.passed and result.transport == "tcp"
    assert result.summary.endswith(
        "; KV transfer: mooncake over TCP, not RDMA: no RDMA device in /sys/class/infiniband "
        "(allowed by spec.transfer.allowTCP)")


def test_no_rdma_configured_is_tcp_and_needs_no_devices():
    result = preflight(config(), None)
    assert result.passed and result.transport == "tcp"
    assert result.summary.endswith("; KV transfer: mooncake over TCP (no RDMA configured)")


def test_a_single_pool_has_no_transfer():
    result = preflight(config("single"), None)
    assert result.passed and result.transport is None
    assert "KV transfer" not in result.summary
    assert engine_env(config("single"), result) == {}


def test_probe_reads_the_injected_roots(tmp_path: Path):
    sys_root, dev_root = tmp_path / "sys", tmp_path / "dev"
    assert probe_rdma(sys_root, dev_root) == RdmaFacts()  # neither exists
    for name in ("mlx5_1", "mlx5_0"):
        (sys_root / name).mkdir(parents=True)
    dev_root.mkdir()
    for name in ("uverbs0", "rdma_cm", "umad0"):
        (dev_root / name).touch()
    assert probe_rdma(sys_root, dev_root) == RdmaFacts(devices=("mlx5_0", "mlx5_1"),
                                                       verbs_files=("uverbs0",))


@pytest.mark.parametrize("backend, transport, expected", [
    ("mooncake", "rdma", {"MOONCAKE_PROTOCOL": "rdma"}),
    ("mooncake", "tcp", {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}),
    ("nixl", "rdma", {"UCX_TLS": "rc,cuda_copy,cuda_ipc"}),
    ("nixl", "tcp", {"UCX_TLS": "tcp,cuda_copy"}),
])
def test_the_engine_environment_names_the_transport(backend, transport, expected):
    pd = DisaggregationConfig(transfer_backend=backend, rdma=True)
    assert transfer_env(pd, transport) == expected
    result = preflight(config(transfer_backend=backend, rdma=True, allow_tcp=True),
                       TWO_NICS if transport == "rdma" else RdmaFacts())
    assert result.transport == transport
    assert engine_env(config(transfer_backend=backend), result) == expected


def test_every_backend_has_both_transports():
    assert set(TRANSFER_ENV) == {(b, t) for b in ("mooncake", "nixl") for t in ("rdma", "tcp")}


def test_ib_devices_need_rdma():
    with pytest.raises(ConfigError, match="ib_devices names RDMA devices: set rdma true"):
        RuntimeConfig.from_dict({
            "deployment": "kimi", "namespace": "llm", "phase": "decode",
            "model": {"name": "kimi", "path": "/models/kimi"},
            "disaggregation": {"ib_devices": ["mlx5_0"]}})


# --- SGLang's own parser and the environment it reads (scripts/sglang-no-deps.txt). ---


def test_sglang_reads_the_argv_and_the_mooncake_protocol(monkeypatch):
    server_args = pytest.importorskip("sglang.srt.server_args")
    environ = pytest.importorskip("sglang.srt.environ")
    cfg = config("prefill", rdma=True, ib_devices=("mlx5_0", "mlx5_1"))
    parsed = server_args.prepare_server_args(sglang_argv(cfg, transport="rdma"))
    assert parsed.disaggregation_transfer_backend == "mooncake"
    assert parsed.disaggregation_ib_device == "mlx5_0,mlx5_1"
    assert server_args.prepare_server_args(
        sglang_argv(cfg, transport="tcp")).disaggregation_ib_device is None
    # The variable SGLang hands Mooncake's TransferEngine.initialize as the protocol.
    for transport in ("rdma", "tcp"):
        for key, value in transfer_env(cfg.disaggregation, transport).items():
            monkeypatch.setenv(key, value)
        assert environ.envs.MOONCAKE_PROTOCOL.get() == transport
    assert os.environ["MC_FORCE_TCP"] == "1"  # SGLang then skips choosing RDMA devices
