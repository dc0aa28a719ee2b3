"""Runtime metrics: info and preflight in the runtime's registry; the engine processes'
tessera_* counters aggregated from prometheus multiprocess files, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

from prometheus_client import generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from tessera.runtime.config import (
    KVCacheConfig,
    MemoryConfig,
    ModelConfig,
    RuntimeConfig,
    WeightsConfig,
)
from tessera.runtime.metrics import RuntimeMetrics, TesseraSamples
from tessera.runtime.preflight import Failure, GpuFacts, PreflightResult, Problem

CONFIG = RuntimeConfig(
    deployment="kimi-k2", namespace="llm", phase="decode",
    model=ModelConfig(name="kimi", path="/models/kimi"),
    weights=WeightsConfig(dtype="int4", format="compressed-tensors"),
    kv_cache=KVCacheConfig(dtype="fp8_e4m3"),
    memory=MemoryConfig(planned_weights_bytes_per_gpu=3 << 30,
                        planned_kv_pool_bytes_per_gpu=1 << 30),
)
GPU = GpuFacts(index=0, name="NVIDIA H200", capability=(9, 0), total_bytes=150 << 30,
               free_bytes=140 << 30)


def text(metrics: RuntimeMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def value(exposition: str, name: str, **labels: str) -> float:
    """The one sample called `name` with exactly these labels."""
    found = [s.value for family in text_string_to_metric_families(exposition)
             for s in family.samples if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_info_and_passed_preflight():
    metrics = RuntimeMetrics()
    metrics.describe(CONFIG, {"sglang": "0.5.23", "tessera": "0.1.0"})
    assert 'tessera_preflight{tessera_preflight="pending"} 1.0' in text(metrics)
    metrics.record_preflight(PreflightResult(None, "preflight passed", (GPU,)))
    out = text(metrics)
    info = next(line for line in out.splitlines() if line.startswith("tessera_runtime_info{"))
    for label in ('phase="decode"', 'weights_dtype="int4"', 'kv_dtype="fp8_e4m3"',
                  'sglang_version="0.5.23"', 'deployment="kimi-k2"', 'integrity="false"',
                  'kernel_w4a16="sglang"'):
        assert label in info
    assert 'tessera_preflight{tessera_preflight="passed"} 1.0' in out
    assert 'tessera_preflight{tessera_preflight="pending"} 0.0' in out
    assert value(out, "tessera_preflight_gpu_free_bytes", gpu="0") == 140 << 30
    assert value(out, "tessera_preflight_gpu_compute_capability", gpu="0") == 9.0
    assert value(out, "tessera_plan_bytes_per_gpu") == 4 << 30


def test_failed_preflight_names_its_class():
    metrics = RuntimeMetrics()
    metrics.describe(CONFIG, {})
    metrics.record_preflight(PreflightResult(Problem(Failure.GPU_MEMORY, "short"), "failed"))
    assert 'tessera_preflight{tessera_preflight="gpu_memory"} 1.0' in text(metrics)


# Runs in a separate process, as an SGLang scheduler rank would.
ENGINE_PROCESS = """
import sys
from prometheus_client import Counter
from tessera.runtime.integrity.metrics import IntegrityMetrics
m = IntegrityMetrics()
m.checked(int(sys.argv[1]))
m.mismatched(requests=int(sys.argv[2]), pages=2 * int(sys.argv[2]))
Counter("sglang_engine_requests", "an engine metric that is not ours").inc(5)
"""


def test_engine_counters_are_summed_across_processes_and_served(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for checks, aborted in ((3, 1), (4, 0)):
        subprocess.run([sys.executable, "-c", ENGINE_PROCESS, str(checks), str(aborted)],
                       env=env, check=True, timeout=60)
    metrics = RuntimeMetrics()
    metrics.registry.register(TesseraSamples(str(tmp_path)))
    metrics.describe(CONFIG, {})
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            out = response.read().decode()
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert value(out, "tessera_kv_integrity_checks_total") == 7
    assert value(out, "tessera_kv_integrity_aborted_requests_total") == 1
    assert value(out, "tessera_kv_integrity_mismatched_pages_total") == 2
    assert "sglang_engine_requests" not in out
    assert "tessera_runtime_info{" in out
