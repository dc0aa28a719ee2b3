"""The streaming converter: FP8/BF16 checkpoint -> INT4 W4A16 compressed-tensors checkpoint.

Memory stays bounded by a few copies of the largest tensor, whatever the shard size: tensors
are read one at a time, converted, and streamed into the output shard. Each finished shard is
renamed into place and recorded with its sha256 in the manifest, so a restarted run skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors import safe_open
from tessera.kernels import w4a16_format
from tessera.runtime.quantize import fp8
from tessera.runtime.quantize.checkpoint import INDEX, SINGLE, Checkpoint, read_checkpoint
from tessera.runtime.quantize.options import REOPEN_BYTES, Options
from tessera.runtime.quantize.plan import Action, Plan, Step, make_plan, size_by_class
from tessera.runtime.quantize.qconfig import output_config
from tessera.runtime.quantize.shardio import ShardWriter, file_sha256

MANIFEST = "tessera-quantize.json"
MANIFEST_VERSION = 1
# weights in any format are not copied: the converted shards replace them
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class Progress:
    """A progress line on stderr: a live bar on a terminal, a line every few seconds in logs."""

    def __init__(self, total_bytes: int, stream: TextIO, every_s: float = 5.0):
        self.total, self.done, self.stream = total_bytes, 0, stream
        self.live = stream.isatty()
        self.every_s = 0.2 if self.live else every_s
        self.start = self.last = time.monotonic()

    def advance(self, nbytes: int, label: str) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        frac = self.done / self.total if self.total else 1.0
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0.0
        bar = "#" * int(frac * 30)
        line = (f"quantize [{bar:<30}] {frac:6.1%} {_human(self.done)} of {_human(self.total)} "
                f"{rate / 1e6:.0f} MB/s eta {eta:.0f}s {label}")
        self.stream.write(("\r" + line) if self.live else line + "\n")
        if self.live and self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def convert(src: Path, dst: Path, options: Options, device: str = "cpu",
            progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Converts `src` into `dst` (resuming a previous run there) and returns the manifest."""
    ckpt = read_checkpoint(src)
    plan = make_plan(ckpt, options)
    dst.mkdir(parents=True, exist_ok=True)
    manifest = _start_manifest(dst, ckpt, options)
    total = sum(step.source_bytes for steps in plan.shards.values() for step in steps)
    progress = Progress(total, progress_stream or sys.stderr)
    for file, steps in plan.shards.items():
        shard_bytes = sum(step.source_bytes for step in steps)
        done = manifest["shards"].get(file)
        if done and _present(dst / file, done["bytes"]):
            progress.advance(shard_bytes, f"{file} (done before)")
            continue
        sha = _convert_shard(ckpt, plan, file, dst, options, device, progress)
        manifest["shards"][file] = {"sha256": sha, "bytes": (dst / file).stat().st_size}
        _write_json(dst / MANIFEST, manifest)
    _finish(ckpt, plan, dst, options)
    sizes = size_by_class(plan)
    manifest["sizes"] = {cls: {"before": b, "after": a} for cls, (b, a) in sorted(sizes.items())}
    manifest["complete"] = True
    _write_json(dst / MANIFEST, manifest)
    return manifest


def _start_manifest(dst: Path, ckpt: Checkpoint, options: Options) -> dict[str, Any]:
    fingerprint = ckpt.fingerprint()
    fresh: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "source": {"path": str(ckpt.directory), "fingerprint": fingerprint},
        "options": asdict(options) | {"targets": list(options.targets)},
        "shards": {},
        "complete": False,
    }
    path = dst / MANIFEST
    if not path.is_file():
        if any(dst.glob("*.safetensors")):
            raise ValueError(f"{dst} already holds safetensors files but no {MANIFEST}: "
                             "convert into an empty folder")
        return fresh
    old = json.loads(path.read_text())
    for key in ("version", "options"):
        if old.get(key) != fresh[key]:
            raise ValueError(f"{dst} holds a conversion made with {key} {old.get(key)}, not "
                             f"{fresh[key]}: use another output folder or empty this one")
    if old["source"]["fingerprint"] != fingerprint:
        raise ValueError(f"{dst} holds a conversion of a different source checkpoint than "
                         f"{ckpt.directory}: use another output folder or empty this one")
    return {**old, "complete": False}


def _present(path: Path, nbytes: int) -> bool:
    return path.is_file() and path.stat().st_size == nbytes


def _convert_shard(ckpt: Checkpoint, plan: Plan, file: str, dst: Path, options: Options,
                   device: str, progress: Progress) -> str:
    with ShardWriter(dst / file, plan.specs(file)) as writer:
        for chunk in read_chunks(plan.shards[file]):
            with _reader(ckpt, file) as read:
                for step in chunk:
                    for name, tensor in _outputs(read, step, options, device):
                        writer.add(name, tensor)
                    progress.advance(step.source_bytes, file)
        return writer.finish()


def read_chunks(steps: Sequence[Step], chunk_bytes: int = REOPEN_BYTES) -> list[list[Step]]:
    """Consecutive runs of steps reading at most `chunk_bytes` (or one larger step) each.

    safetensors maps a shard into memory and the pages it has read stay resident until the
    file is closed, so the shard is reopened per chunk (measured: bench/quantize_memory.py).
    """
    chunks: list[list[Step]] = [[]]
    size = 0
    for step in steps:
        if chunks[-1] and size + step.source_bytes > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(step)
        size += step.source_bytes
    return chunks


@contextmanager
def _reader(ckpt: Checkpoint, file: str) -> Iterator[Callable[[str], torch.Tensor]]:
    """Reads tensors of one source shard (and the odd scale stored in another shard)."""
    with safe_open(ckpt.directory / file, framework="pt") as handle:

        def get(name: str) -> torch.Tensor:
            if ckpt.location[name] == file:
                return handle.get_tensor(name)
            with safe_open(ckpt.directory / ckpt.location[name], framework="pt") as other:
                return other.get_tensor(name)

        yield get


def _outputs(read: Callable[[str], torch.Tensor], step: Step, options: Options, device: str
             ) -> Iterator[tuple[str, torch.Tensor]]:
    weight = read(step.source)
    if step.action is Action.COPY:
        yield step.source, weight
        return
    if step.scale is not None:
        weight = fp8.dequantize(weight.to(device), read(step.scale).to(device))
    if step.action is Action.DEQUANTIZE:
        yield step.source, weight.bfloat16()
        return
    packed = w4a16_format.quantize_rtn(weight.to(device), options.group_size)
    module = step.source.removesuffix(".weight")
    for suffix, tensor in w4a16_format.to_compressed_tensors(packed).items():
        yield f"{module}.{suffix}", tensor


def _finish(ckpt: Checkpoint, plan: Plan, dst: Path, options: Options) -> None:
    """The index, config.json and every other file of the source (tokenizer, code, ...)."""
    total = sum(o.nbytes for f in plan.shards for o in plan.specs(f))
    index = {"metadata": {"total_size": total}, "weight_map": plan.weight_map()}
    _write_json(dst / INDEX, index)
    _write_json(dst / "config.json", output_config(ckpt.config, plan.ignore, options.group_size))
    skip = {INDEX, SINGLE, "config.json", *plan.shards}
    for path in ckpt.directory.iterdir():
        if path.is_file() and path.name not in skip and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)


def _write_json(path: Path, value: Any) -> None:
    """Written beside and renamed: a crash leaves the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def verify(dst: Path) -> list[str]:
    """Problems found re-hashing `dst` against its manifest and index; empty when sound."""
    path = dst / MANIFEST
    if not path.is_file():
        return [f"{dst} has no {MANIFEST}: it was not written by tessera quantize"]
    manifest = json.loads(path.read_text())
    problems = [] if manifest.get("complete") else ["the conversion did not finish: run it again"]
    for file, entry in sorted(manifest["shards"].items()):
        if not (dst / file).is_file():
            problems.append(f"{file}: missing")
        elif file_sha256(dst / file) != entry["sha256"]:
            problems.append(f"{file}: sha256 differs from the manifest (corrupt or changed)")
    index_path = dst / INDEX
    if not index_path.is_file():
        return [*problems, f"{INDEX}: missing"]
    unlisted = set(json.loads(index_path.read_text())["weight_map"].values()) - set(
        manifest["shards"])
    problems += [f"{file}: in the index but not in the manifest" for file in sorted(unlisted)]
    return problems


def size_report(manifest: dict[str, Any]) -> str:
    """The before/after table by tensor class."""
    rows = [(cls, s["before"], s["after"]) for cls, s in manifest["sizes"].items()]
    rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    lines = [f"{'tensor class':<16} {'before':>12} {'after':>12} {'ratio':>7}"]
    for cls, before, after in rows:
        ratio = after / before if before else 1.0
        lines.append(f"{cls:<16} {_human(before):>12} {_human(after):>12} {ratio:>7.3f}")
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"
