"""tessera-runtime's Prometheus metrics, served on the pod's `metrics` port.

Two kinds of metric, from two kinds of process:
- the runtime's own (info, preflight), in the `tessera-runtime` process, in a registry of
  its own (`RuntimeMetrics`);
- counters that run inside SGLang's scheduler processes (the KV integrity check). Those use
  prometheus-client's multiprocess mode: `tessera-runtime` starts SGLang with
  PROMETHEUS_MULTIPROC_DIR set to a directory it owns, every process writes its samples
  there, and `TesseraSamples` re-exports the `tessera_*` families on our port. SGLang's own
  /metrics (with --enable-metrics) reads the same directory, so they show up there as well.

Engine-side counters (`tessera.runtime.integrity.metrics.IntegrityMetrics`, and any later
ones) need only a name starting `tessera_`, created once in the process that counts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Enum, Gauge, Info
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from tessera.runtime.config import RuntimeConfig
from tessera.runtime.preflight import Failure, PreflightResult

PREFIX = "tessera_"
PREFLIGHT_STATES = ["pending", "passed", *(f.name.lower() for f in Failure)]


class RuntimeMetrics:
    """The runtime process's own metrics, in a registry that the metrics server exposes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.info = Info("tessera_runtime", "What this pod serves and with which versions",
                         registry=self.registry)
        self.preflight = Enum("tessera_preflight", "Result of the checks before the engine starts",
                              states=PREFLIGHT_STATES, registry=self.registry)
        self.gpu_free_bytes = Gauge("tessera_preflight_gpu_free_bytes",
                                    "Free memory per GPU when preflight ran", ["gpu"],
                                    registry=self.registry)
        self.gpu_capability = Gauge("tessera_preflight_gpu_compute_capability",
                                    "Compute capability per GPU (major.minor)", ["gpu"],
                                    registry=self.registry)
        self.planned_bytes = Gauge("tessera_plan_bytes_per_gpu",
                                   "GPU memory the capacity plan needs per GPU (weights + KV pool)",
                                   registry=self.registry)

    def describe(self, config: RuntimeConfig, versions: dict[str, str]) -> None:
        w, kv, par = config.weights, config.kv_cache, config.parallel
        self.info.info({
            "deployment": config.deployment, "namespace": config.namespace,
            "phase": config.phase, "schema_version": str(config.schema_version),
            "weights_dtype": w.dtype, "weights_format": w.format, "kv_dtype": kv.dtype,
            "page_size": str(kv.page_size), "tp": str(par.tensor), "ep": str(par.expert),
            "attn_dp": str(par.attention_data), "nnodes": str(par.nnodes),
            "integrity": str(config.integrity.enabled).lower(),
            "kernel_decode_attention": config.kernels.decode_attention,
            "kernel_w4a16": config.kernels.w4a16,
            **{f"{name}_version": v for name, v in sorted(versions.items())},
        })
        if config.memory.planned_bytes_per_gpu is not None:
            self.planned_bytes.set(config.memory.planned_bytes_per_gpu)
        self.preflight.state("pending")

    def record_preflight(self, result: PreflightResult) -> None:
        self.preflight.state("passed" if result.problem is None
                             else result.problem.failure.name.lower())
        for gpu in result.gpus:
            self.gpu_free_bytes.labels(str(gpu.index)).set(gpu.free_bytes)
            self.gpu_capability.labels(str(gpu.index)).set(
                float(f"{gpu.capability[0]}.{gpu.capability[1]}"))


class TesseraSamples(Collector):
    """The `tessera_*` families written by the engine's processes in multiprocess mode."""

    def __init__(self, multiproc_dir: str) -> None:
        self._all = MultiProcessCollector(registry=None, path=multiproc_dir)

    def collect(self) -> Iterator[Metric]:
        return (m for m in self._all.collect() if m.name.startswith(PREFIX))
