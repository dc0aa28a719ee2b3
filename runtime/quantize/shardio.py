"""Safetensors shards read and written one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a shard in memory at once; a converter
that must stay within a few tensors' worth of memory writes the header first (computed from
the planned shapes) and then streams each tensor's bytes, hashing as it goes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header for tensors laid out in `specs` order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8-byte alignment
    return struct.pack("<Q", len(text)) + text


class ShardWriter:
    """Writes one shard to `<path>.partial`, renamed into place only when complete.

    The tensors must arrive in the order of `specs`, with exactly those dtypes and shapes.
    """

    def __init__(self, path: Path, specs: list[TensorSpec]) -> None:
        self.path = path
        self._partial = path.with_name(path.name + ".partial")
        self._pending = list(reversed(specs))
        self._sha = hashlib.sha256()
        self._file: BinaryIO = open(self._partial, "wb")  # noqa: SIM115 - closed in finish/abort
        self._write(header_bytes(specs))

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._sha.update(data)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._pending.pop()
        got = TensorSpec(name, tensor.dtype, tuple(tensor.shape))
        if got != spec:
            raise RuntimeError(f"planned {spec} but produced {got}: planner and writer disagree")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._write(flat.view(torch.uint8).numpy().data)

    def finish(self) -> str:
        """Flush, rename into place, and return the file's sha256."""
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} planned tensors were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._file.close()
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abort()


def read_specs(path: Path) -> list[TensorSpec]:
    """The tensors a shard holds, from its header alone (no tensor data is read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    ordered = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    return [TensorSpec(n, DTYPES_BY_NAME[h["dtype"]], tuple(h["shape"])) for n, h in ordered]


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()
