"""The runtime config: the one contract between the operator and the pods.

The operator renders one `RuntimeConfig` per engine phase (and one `RouterConfig` for the
router) into a ConfigMap; `tessera-runtime` reads it back inside the pod. Both sides import
these types, so a field renamed here breaks both at once, in tests, not in a cluster.

`schema_version` changes only when a field's meaning changes or a required field is added;
a runtime refuses a config written for another version with a message saying which.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCHEMA_VERSION = 1
# The SGLang release whose flags `sglang_args` emits; the runtime image pins the same one.
ENGINE_VERSION = "0.5.23"

# Env keys the runtime reads. TESSERA_RUNTIME_CONFIG holds the path of the mounted config file;
# the node-placement keys are per pod (multi-node tensor parallel only), so not in the ConfigMap.
ENV_CONFIG = "TESSERA_RUNTIME_CONFIG"
ENV_NODE_RANK = "TESSERA_NODE_RANK"
ENV_DIST_INIT_ADDR = "TESSERA_DIST_INIT_ADDR"
ENV_POD_NAME = "POD_NAME"

Phase = Literal["prefill", "decode", "single"]
WeightsDtype = Literal["bf16", "fp8", "int4"]
KVDtype = Literal["bf16", "fp8_e4m3"]
# How the checkpoint stores its weights: plain safetensors (BF16, or FP8 with the checkpoint's
# own `quant_method: fp8` config), or one of the INT4-capable quantization formats.
CheckpointFormat = Literal["safetensors", "compressed-tensors", "awq", "gptq"]
KernelImpl = Literal["tessera", "sglang"]
# Decode attention also has SGLang's FlashMLA backend (MLA models, 64-token pages), chosen by
# name because SGLang's own default on Hopper is FA3.
DecodeAttentionImpl = Literal["tessera", "sglang", "flashmla"]
FLASHMLA_PAGE_SIZE = 64
TransferBackend = Literal["mooncake", "nixl"]
# How the KV moves between the pods: over RDMA devices, or over the pod network by TCP.
Transport = Literal["rdma", "tcp"]
RouterPolicy = Literal["cache_aware", "round_robin", "random", "power_of_two"]

# Which checkpoint formats can hold which weight dtype.
FORMATS_FOR_DTYPE: dict[str, tuple[str, ...]] = {
    "bf16": ("safetensors",),
    "fp8": ("safetensors", "compressed-tensors"),
    "int4": ("compressed-tensors", "awq", "gptq"),
}
PAGE_SIZES = (1, 16, 32, 64, 128)
INT4_GROUP_SIZES = (32, 64, 128)


class ConfigError(ValueError):
    """A runtime config that cannot be used; the message says what to fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    name: str = Field(min_length=1, description="served model name, as clients ask for it")
    path: str = Field(min_length=1, description="checkpoint directory inside the pod")
    uri: str | None = Field(default=None, description="where the checkpoint came from")
    context_length: int = Field(default=131072, ge=1)
    trust_remote_code: bool = False


class WeightsConfig(_Frozen):
    dtype: WeightsDtype = "bf16"
    format: CheckpointFormat = "safetensors"
    group_size: int | None = Field(default=None, description="INT4 quantization group size")

    @model_validator(mode="after")
    def _format_holds_dtype(self) -> Self:
        allowed = FORMATS_FOR_DTYPE[self.dtype]
        if self.format not in allowed:
            raise ValueError(
                f"weights format {self.format!r} cannot hold {self.dtype} weights; "
                f"use one of {', '.join(allowed)}"
            )
        if self.group_size is not None:
            if self.dtype != "int4":
                raise ValueError("weights.group_size applies to int4 weights only; remove it")
            if self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"weights.group_size must be one of {INT4_GROUP_SIZES}")
        return self


class KVCacheConfig(_Frozen):
    dtype: KVDtype = "bf16"
    page_size: int = 64

    @field_validator("page_size")
    @classmethod
    def _known_page_size(cls, v: int) -> int:
        if v not in PAGE_SIZES:
            raise ValueError(f"kv_cache.page_size must be one of {PAGE_SIZES}, got {v}")
        return v


class ParallelConfig(_Frozen):
    """SGLang's sizes: with attention data parallel the GPUs of a replica are still `tensor`."""

    tensor: int = Field(default=1, ge=1)
    expert: int = Field(default=1, ge=1)
    attention_data: int = Field(default=1, ge=1)
    nnodes: int = Field(default=1, ge=1, description="nodes one replica spans")

    @model_validator(mode="after")
    def _divides_tensor(self) -> Self:
        for name in ("expert", "attention_data", "nnodes"):
            if self.tensor % getattr(self, name):
                raise ValueError(
                    f"parallel.{name} ({getattr(self, name)}) must divide "
                    f"parallel.tensor ({self.tensor})"
                )
        return self

    @property
    def gpus_per_node(self) -> int:
        return self.tensor // self.nnodes


class MemoryConfig(_Frozen):
    """The capacity plan for one GPU of this phase, as the operator's planner computed it."""

    mem_fraction_static: float | None = Field(default=None, gt=0.0, lt=1.0)
    planned_weights_bytes_per_gpu: int | None = Field(default=None, ge=0)
    planned_kv_pool_bytes_per_gpu: int | None = Field(default=None, ge=0)

    @property
    def planned_bytes_per_gpu(self) -> int | None:
        """Bytes one GPU must have free for the plan to hold, or None without a plan."""
        parts = (self.planned_weights_bytes_per_gpu, self.planned_kv_pool_bytes_per_gpu)
        return None if None in parts else sum(p for p in parts if p is not None)


class PortsConfig(_Frozen):
    http: int = Field(default=30000, ge=1, le=65535)
    bootstrap: int = Field(default=8998, ge=1, le=65535)  # PD KV handoff, prefill side
    metrics: int = Field(default=9400, ge=1, le=65535)  # tessera-runtime's own metrics


class DisaggregationConfig(_Frozen):
    """Prefill/decode transfer settings; unused by a single-pool phase.

    `rdma` says the pod was given RDMA devices (the spec's network.rdma): preflight checks
    them and the transfer runs over them. Without it the transfer runs over TCP, which
    works on any cluster. `ib_devices` empty means the transfer engine picks ("auto").
    """

    transfer_backend: TransferBackend = "mooncake"
    rdma: bool = False
    ib_devices: tuple[str, ...] = ()
    allow_tcp: bool = False  # RDMA devices missing: start over TCP instead of refusing
    kv_checksum: bool = False  # SGLang's PD checksum; must be the same on both roles

    @model_validator(mode="after")
    def _devices_need_rdma(self) -> Self:
        if self.ib_devices and not self.rdma:
            raise ValueError("disaggregation.ib_devices names RDMA devices: set rdma true too")
        return self

    @property
    def declared_transport(self) -> Transport:
        return "rdma" if self.rdma else "tcp"


class IntegrityConfig(_Frozen):
    """The per-page generation-tag check on the KV cache (off: a no-op tracker)."""

    enabled: bool = False


class KernelsConfig(_Frozen):
    """Per kernel family: tessera's Triton kernel, or SGLang's own (the fallback); decode
    attention may also name SGLang's FlashMLA backend."""

    decode_attention: DecodeAttentionImpl = "sglang"
    w4a16: KernelImpl = "sglang"


class _Versioned(_Frozen):
    schema_version: int = SCHEMA_VERSION
    deployment: str = Field(min_length=1, description="ModelDeployment name (for events)")
    namespace: str = Field(min_length=1)

    @field_validator("schema_version")
    @classmethod
    def _supported_version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {v} is not supported by this runtime (it reads version "
                f"{SCHEMA_VERSION}); run a runtime image that matches the operator"
            )
        return v

    @classmethod
    def from_dict(cls, data: Any, source: str = "runtime config") -> Self:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<top>'}: {err['msg']}"
                for err in e.errors()
            )
            raise ConfigError(f"{source}: {problems}") from None

    @classmethod
    def from_text(cls, text: str, source: str = "runtime config") -> Self:
        """Parse JSON or YAML (JSON is YAML)."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid JSON or YAML: {e}") from None
        return cls.from_dict(data, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Self:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read runtime config {path}: {e.strerror}") from None
        return cls.from_text(text, source=str(path))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Self:
        """Load the file named by $TESSERA_RUNTIME_CONFIG."""
        env = os.environ if environ is None else environ
        path = env.get(ENV_CONFIG)
        if not path:
            raise ConfigError(
                f"${ENV_CONFIG} is not set; set it to the runtime config file's path "
                "or pass --config"
            )
        return cls.from_file(path)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        """Stable text (sorted keys): its hash changes only when the config does."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=True)


class RuntimeConfig(_Versioned):
    """One engine phase's config: what SGLang runs and what preflight checks."""

    phase: Phase
    engine_version: str = ENGINE_VERSION
    model: ModelConfig
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    ports: PortsConfig = Field(default_factory=PortsConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    integrity: IntegrityConfig = Field(default_factory=IntegrityConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)

    @model_validator(mode="after")
    def _phase_consistent(self) -> Self:
        if self.phase == "single" and self.disaggregation != DisaggregationConfig():
            raise ValueError(
                "disaggregation settings apply to prefill and decode phases only; "
                "remove them from a single-pool phase"
            )
        # SGLang would silently switch to 64-token pages, unlike the pool the plan sized.
        if (self.kernels.decode_attention == "flashmla"
                and self.kv_cache.page_size != FLASHMLA_PAGE_SIZE):
            raise ValueError(
                f"kernels.decode_attention flashmla reads {FLASHMLA_PAGE_SIZE}-token pages, the "
                f"KV cache has {self.kv_cache.page_size}; set kv_cache.page_size "
                f"{FLASHMLA_PAGE_SIZE} or choose tessera or sglang"
            )
        return self


class PrefillWorker(_Frozen):
    url: str = Field(min_length=1)
    bootstrap_port: int | None = Field(default=8998, ge=1, le=65535)


class StaticWorkers(_Frozen):
    """Worker URLs known up front (disaggregated: prefill + decode; single: single)."""

    prefill: tuple[PrefillWorker, ...] = ()
    decode: tuple[str, ...] = ()
    single: tuple[str, ...] = ()


class Discovery(_Frozen):
    """Find workers by pod labels; a prefill pod's bootstrap port comes from its
    `sglang.ai/bootstrap-port` annotation."""

    namespace: str = Field(min_length=1)
    port: int = Field(default=30000, ge=1, le=65535)
    prefill_selector: dict[str, str] = {}
    decode_selector: dict[str, str] = {}
    single_selector: dict[str, str] = {}


class RouterConfig(_Versioned):
    """The router in front of the engine pods."""

    mode: Literal["disaggregated", "single"]
    port: int = Field(default=8000, ge=1, le=65535)
    metrics_port: int = Field(default=29000, ge=1, le=65535)
    policy: RouterPolicy = "cache_aware"
    static: StaticWorkers | None = None
    discovery: Discovery | None = None

    @model_validator(mode="after")
    def _workers_named_once(self) -> Self:
        if (self.static is None) == (self.discovery is None):
            raise ValueError("set exactly one of router.static and router.discovery")
        if self.static is not None:
            s = self.static
            have = {"prefill": bool(s.prefill), "decode": bool(s.decode), "single": bool(s.single)}
        else:
            assert self.discovery is not None
            d = self.discovery
            have = {"prefill": bool(d.prefill_selector), "decode": bool(d.decode_selector),
                    "single": bool(d.single_selector)}
        want = {"prefill", "decode"} if self.mode == "disaggregated" else {"single"}
        named = {k for k, v in have.items() if v}
        if named != want:
            raise ValueError(
                f"a {self.mode} router needs workers for {sorted(want)} and no others; "
                f"got {sorted(named) or 'none'}"
            )
        return self
