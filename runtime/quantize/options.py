"""The converter's options and its read window: torch-free, so that the operator can render
and size the conversion Job without the converter's own dependencies."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.kernels.w4a16_layout import SUPPORTED_GROUP_SIZES
from tessera.runtime.quantize.tensors import DEFAULT_TARGETS, parse_targets

# Bytes read from one shard before it is reopened: safetensors keeps the pages it has read
# mapped until the file is closed, so this bounds the converter's memory (bench/quantize_memory.py).
REOPEN_BYTES = 256 << 20


@dataclass(frozen=True)
class Options:
    targets: tuple[str, ...] = DEFAULT_TARGETS
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group size {self.group_size} is not supported; use one of "
                             f"{SUPPORTED_GROUP_SIZES}")
        parse_targets(self.targets)
