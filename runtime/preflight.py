"""Checks before the engine starts: can this pod serve its phase's precision at all?

The decisions are pure functions of small typed facts (`GpuFacts`, `CheckpointFacts`, the
installed SGLang version), so every failure is testable on a CPU. `probe_gpus` and
`read_checkpoint` are the thin adapters that gather those facts in the pod.

Each failure class has its own exit code, so `kubectl get pod` (Error, exit code N) and the
termination message together say what is wrong without reading logs.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from tessera.runtime.config import ENGINE_VERSION, RuntimeConfig, Transport

GiB = 1 << 30
INDEX_FILE = "model.safetensors.index.json"


class Failure(IntEnum):
    """Exit codes of `tessera-runtime`, one per failure class (1 is left to crashes)."""

    CONFIG = 2
    ENGINE_VERSION = 10
    NO_GPU = 11
    TOO_FEW_GPUS = 12
    COMPUTE_CAPABILITY = 13
    GPU_MEMORY = 14
    MODEL_FILES = 15
    CHECKPOINT_MISMATCH = 16
    RDMA_DEVICES = 17


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    capability: tuple[int, int]
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class CheckpointFacts:
    path: str
    is_dir: bool
    config: Mapping[str, Any] | None  # config.json, None when absent or unreadable
    weight_files: tuple[str, ...] = ()  # *.safetensors present
    missing_shards: tuple[str, ...] = ()  # listed in the index but absent


@dataclass(frozen=True)
class RdmaFacts:
    """The RDMA devices this pod can use: the kernel's names for them
    (/sys/class/infiniband) and the verbs device files a device plugin mounts
    (/dev/infiniband/uverbs*), without which no device is usable from the container."""

    devices: tuple[str, ...] = ()
    verbs_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Problem:
    failure: Failure
    message: str


@dataclass(frozen=True)
class PreflightResult:
    problem: Problem | None
    summary: str  # one line: what passed, or what failed and how to fix it
    gpus: tuple[GpuFacts, ...] = field(default=())
    transport: Transport | None = None  # how the KV moves (prefill and decode only)

    @property
    def passed(self) -> bool:
        return self.problem is None

    @property
    def exit_code(self) -> int:
        return 0 if self.problem is None else int(self.problem.failure)


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def capability_needs(config: RuntimeConfig) -> list[tuple[tuple[int, int], str]]:
    """(minimum compute capability, what needs it) for every feature this phase uses."""
    needs: list[tuple[tuple[int, int], str]] = [((8, 0), "BF16 compute")]
    if config.weights.dtype == "fp8":
        needs.append(((8, 9), "FP8 weights"))
    if config.kv_cache.dtype == "fp8_e4m3":
        needs.append(((8, 9), "an FP8 KV cache"))
    for family in ("decode_attention", "w4a16"):
        if getattr(config.kernels, family) == "tessera":
            needs.append(((9, 0), f"tessera's Hopper {family} kernels"))
    if config.kernels.decode_attention == "flashmla":
        needs.append(((9, 0), "SGLang's FlashMLA decode attention"))
    return needs


def check_gpus(config: RuntimeConfig, gpus: Sequence[GpuFacts]) -> Problem | None:
    want = config.parallel.gpus_per_node
    if not gpus:
        return Problem(Failure.NO_GPU,
                       f"no CUDA GPU is visible; this {config.phase} pod needs {want}: request "
                       f"nvidia.com/gpu: {want} on a node with the NVIDIA device plugin")
    if len(gpus) < want:
        return Problem(Failure.TOO_FEW_GPUS,
                       f"{len(gpus)} GPU(s) visible but tensor parallel {config.parallel.tensor} "
                       f"over {config.parallel.nnodes} node(s) needs {want} per pod")
    used = gpus[:want]
    for gpu in used:
        for minimum, what in capability_needs(config):
            if gpu.capability < minimum:
                return Problem(Failure.COMPUTE_CAPABILITY,
                               f"GPU {gpu.index} ({gpu.name}) has compute capability "
                               f"{_cc(gpu.capability)} but {what} needs {_cc(minimum)} or newer: "
                               "choose a precision this GPU supports or a newer GPU pool")
    planned = config.memory.planned_bytes_per_gpu
    if planned is not None:
        short = [g for g in used if g.free_bytes < planned]
        if short:
            g = min(short, key=lambda g: g.free_bytes)
            return Problem(Failure.GPU_MEMORY,
                           f"GPU {g.index} has {g.free_bytes / GiB:.1f} GiB free but the capacity "
                           f"plan needs {planned / GiB:.1f} GiB per GPU (weights "
                           f"{(config.memory.planned_weights_bytes_per_gpu or 0) / GiB:.1f} + KV "
                           f"pool {(config.memory.planned_kv_pool_bytes_per_gpu or 0) / GiB:.1f}):"
                           " free the GPU or plan a smaller KV pool")
    return None


@dataclass(frozen=True)
class CheckpointPrecision:
    dtype: str  # bf16 | fp8 | int4 | unknown
    format: str  # config.py's CheckpointFormat, or the quant_method when unknown
    group_size: int | None = None


def checkpoint_precision(quantization_config: Mapping[str, Any] | None) -> CheckpointPrecision:
    """What a Hugging Face `quantization_config` says the stored weights are."""
    if not quantization_config:
        return CheckpointPrecision("bf16", "safetensors")
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "fp8":
        return CheckpointPrecision("fp8", "safetensors")
    if method == "compressed-tensors":
        groups = quantization_config.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values()]
        kinds = {(w.get("num_bits"), w.get("type")) for w in weights}
        sizes = {w.get("group_size") for w in weights}
        group_size = sizes.pop() if len(sizes) == 1 else None
        if kinds == {(4, "int")}:
            return CheckpointPrecision("int4", "compressed-tensors", group_size)
        if kinds == {(8, "float")}:
            return CheckpointPrecision("fp8", "compressed-tensors")
        return CheckpointPrecision("unknown", f"compressed-tensors {sorted(map(str, kinds))}")
    if method in ("awq", "gptq"):
        bits = quantization_config.get("bits", quantization_config.get("w_bit"))
        group_size = quantization_config.get("group_size", quantization_config.get("q_group_size"))
        dtype = "int4" if bits == 4 else "unknown"
        return CheckpointPrecision(dtype, method, group_size)
    return CheckpointPrecision("unknown", method or "unnamed quant_method")


def check_checkpoint(config: RuntimeConfig, facts: CheckpointFacts) -> Problem | None:
    path = facts.path
    if not facts.is_dir:
        return Problem(Failure.MODEL_FILES,
                       f"model path {path} is not a directory: mount the checkpoint there "
                       "(model.path) before the engine starts")
    if facts.config is None:
        return Problem(Failure.MODEL_FILES,
                       f"{path}/config.json is missing or not JSON: the checkpoint is incomplete")
    if not facts.weight_files:
        return Problem(Failure.MODEL_FILES,
                       f"{path} has no *.safetensors weight files: the checkpoint is incomplete")
    if facts.missing_shards:
        return Problem(Failure.MODEL_FILES,
                       f"{len(facts.missing_shards)} shard(s) listed in {INDEX_FILE} are missing "
                       f"from {path}, e.g. {facts.missing_shards[0]}: finish the download")
    found = checkpoint_precision(facts.config.get("quantization_config"))
    want = config.weights
    if (found.dtype, found.format) != (want.dtype, want.format):
        return Problem(Failure.CHECKPOINT_MISMATCH,
                       f"weights.dtype {want.dtype} (format {want.format}) was requested but the "
                       f"checkpoint at {path} holds {found.dtype} weights (format {found.format}): "
                       "point model.path at a matching checkpoint or change weights.dtype/format")
    if want.group_size is not None and found.group_size not in (None, want.group_size):
        return Problem(Failure.CHECKPOINT_MISMATCH,
                       f"weights.group_size {want.group_size} was requested but the checkpoint "
                       f"at {path} uses group size {found.group_size}")
    return None


def check_engine(installed_version: str | None) -> Problem | None:
    if installed_version == ENGINE_VERSION:
        return None
    found = "SGLang is not installed" if installed_version is None else (
        f"SGLang {installed_version} is installed")
    return Problem(Failure.ENGINE_VERSION,
                   f"{found} but this runtime emits flags for SGLang {ENGINE_VERSION}: "
                   "use the tessera runtime image built for that version")


def choose_transport(config: RuntimeConfig,
                     rdma: RdmaFacts) -> tuple[Transport | None, Problem | None, str]:
    """(transport, problem, note): RDMA when the config asks for it and the devices are
    there; TCP when it does not ask, or when they are missing and TCP is allowed."""
    if config.phase == "single":
        return None, None, ""
    pd = config.disaggregation
    backend = pd.transfer_backend
    if not pd.rdma:
        return "tcp", None, f"KV transfer: {backend} over TCP (no RDMA configured)"
    wanted = ", ".join(pd.ib_devices) or "auto"
    missing = [d for d in pd.ib_devices if d not in rdma.devices]
    if not rdma.devices:
        why = "no RDMA device in /sys/class/infiniband"
    elif missing:
        why = (f"RDMA device(s) {', '.join(missing)} not in /sys/class/infiniband (found "
               f"{', '.join(rdma.devices)})")
    elif not rdma.verbs_files:
        why = (f"RDMA device(s) {', '.join(rdma.devices)} exist but /dev/infiniband has no "
               "uverbs device files, so the container cannot open them")
    else:
        return "rdma", None, (f"KV transfer: {backend} over RDMA "
                              f"({', '.join(pd.ib_devices or rdma.devices)})")
    if pd.allow_tcp:
        return "tcp", None, (f"KV transfer: {backend} over TCP, not RDMA: {why} "
                             "(allowed by spec.transfer.allowTCP)")
    return None, Problem(Failure.RDMA_DEVICES,
                         f"{why}, but this {config.phase} pod is configured for RDMA (devices: "
                         f"{wanted}): check that network.rdma names the resource "
                         "the node's RDMA device plugin advertises and network.ibDevices the "
                         "node's devices, or set spec.transfer.allowTCP to run over TCP"), ""


def describe_pass(config: RuntimeConfig, gpus: Sequence[GpuFacts]) -> str:
    used = gpus[: config.parallel.gpus_per_node]
    names = sorted({g.name for g in used})
    ccs = sorted({_cc(g.capability) for g in used})
    free = [g.free_bytes / GiB for g in used]
    total = max(g.total_bytes for g in used) / GiB
    planned = config.memory.planned_bytes_per_gpu
    plan = "no capacity plan given" if planned is None else f"plan needs {planned / GiB:.1f} GiB"
    w = config.weights
    return (f"preflight passed: {config.phase}, weights {w.dtype} ({w.format}), KV "
            f"{config.kv_cache.dtype}; {len(used)} x {'/'.join(names)}, compute capability "
            f"{'/'.join(ccs)}, free {min(free):.1f}-{max(free):.1f} of {total:.1f} GiB per GPU, "
            f"{plan}; checkpoint matches")


def run_preflight(config: RuntimeConfig, gpus: Sequence[GpuFacts], checkpoint: CheckpointFacts,
                  installed_engine: str | None,
                  rdma: RdmaFacts | None = None) -> PreflightResult:
    """The first problem found, in the order an operator would fix them, or a pass."""
    transport, transfer_problem, transfer_note = choose_transport(config, rdma or RdmaFacts())
    problem = (check_engine(installed_engine) or check_gpus(config, gpus) or transfer_problem
               or check_checkpoint(config, checkpoint))
    if problem is not None:
        return PreflightResult(problem, f"preflight failed: {problem.message}", tuple(gpus))
    summary = describe_pass(config, gpus) + (f"; {transfer_note}" if transfer_note else "")
    return PreflightResult(None, summary, tuple(gpus), transport)


# --- Adapters: gather the facts in the pod. ---

def probe_gpus() -> list[GpuFacts]:
    """The GPUs this process can see (CUDA_VISIBLE_DEVICES applies), via torch."""
    import torch

    if not torch.cuda.is_available():
        return []
    facts = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        facts.append(GpuFacts(index=i, name=torch.cuda.get_device_name(i),
                              capability=torch.cuda.get_device_capability(i),
                              total_bytes=total, free_bytes=free))
    return facts


def probe_gpus_isolated() -> list[GpuFacts]:
    """`probe_gpus` in a throwaway process: the CUDA contexts it opens (hundreds of MiB on
    every GPU) must be gone before the engine starts."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(probe_gpus)


def read_checkpoint(path: str) -> CheckpointFacts:
    """Reads config.json and the shard index only; never the weights."""
    directory = Path(path)
    if not directory.is_dir():
        return CheckpointFacts(path=path, is_dir=False, config=None)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    weight_files = tuple(sorted(p.name for p in directory.glob("*.safetensors")))
    missing: tuple[str, ...] = ()
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = tuple(f for f in listed if f not in weight_files)
        except (OSError, ValueError, KeyError, AttributeError):
            missing = (f"{INDEX_FILE} itself (unreadable)",)
    return CheckpointFacts(path=path, is_dir=True, config=config,
                           weight_files=weight_files, missing_shards=missing)


def probe_rdma(sys_root: Path = Path("/sys/class/infiniband"),
               dev_root: Path = Path("/dev/infiniband")) -> RdmaFacts:
    """The RDMA devices visible in this pod (roots injectable for tests)."""
    def names(root: Path, prefix: str = "") -> tuple[str, ...]:
        try:
            return tuple(sorted(p.name for p in root.iterdir() if p.name.startswith(prefix)))
        except OSError:  # absent: no RDMA stack or nothing mounted
            return ()

    return RdmaFacts(devices=names(sys_root), verbs_files=names(dev_root, "uverbs"))


def installed_engine_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None
