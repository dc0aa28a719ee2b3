"""Checksums of fetched files, computed while the bytes arrive (pure; hashlib only).

What each store publishes, and what is checked against it:
- Hugging Face: the sha256 of every LFS file, the git blob id (sha1 of "blob SIZE\\0" + bytes)
  of every other file;
- S3 and GCS: the ETag. A 32-digit one is the object's MD5. A multipart S3 upload's is the
  MD5 of its parts' MD5s with "-N" appended: checked under the part sizes common clients use
  that give N parts; if none does, only the size is checked (and the log says so).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
# Part sizes of the common multipart uploaders (aws cli and boto3 8 MiB, s3fs 50 MiB, ...).
COMMON_PART_SIZES = tuple(n * MiB for n in (5, 8, 10, 15, 16, 25, 32, 50, 64, 100, 128, 256,
                                             512, 1024))
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART = re.compile(r"^([0-9a-f]{32})-([1-9][0-9]*)$")

SIZE_ONLY, MD5, MULTIPART, SHA256, GIT_SHA1 = "size", "md5", "s3-multipart", "sha256", "git-sha1"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a checkpoint as its store describes it."""

    path: str  # relative to the checkpoint, "/"-separated
    size: int
    checksum: str  # SIZE_ONLY | MD5 | MULTIPART | SHA256 | GIT_SHA1
    expected: str  # the published digest ("" for SIZE_ONLY)

    @property
    def version(self) -> str:
        """What identifies this content: a changed object is a different version."""
        return f"{self.checksum}:{self.expected}:{self.size}"


def from_etag(path: str, size: int, etag: str | None) -> RemoteFile:
    """An object-store file, checked by what its ETag allows."""
    tag = (etag or "").strip('"').lower()
    if _MD5.match(tag):
        return RemoteFile(path, size, MD5, tag)
    if _MULTIPART.match(tag):
        return RemoteFile(path, size, MULTIPART, tag)
    return RemoteFile(path, size, SIZE_ONLY, "")


class _MultipartMD5:
    """The MD5-of-part-MD5s under one part size."""

    def __init__(self, part_size: int) -> None:
        self.part_size, self.current, self.filled = part_size, hashlib.md5(), 0
        self.parts: list[bytes] = []

    def update(self, data: memoryview) -> None:
        while data:
            take = min(len(data), self.part_size - self.filled)
            self.current.update(data[:take])
            self.filled += take
            data = data[take:]
            if self.filled == self.part_size:
                self.parts.append(self.current.digest())
                self.current, self.filled = hashlib.md5(), 0

    def etag(self) -> str:
        parts = self.parts + ([self.current.digest()] if self.filled else [])
        return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"


class Digest:
    """Hashes one file's bytes in order; `problem()` says whether they match."""

    def __init__(self, remote: RemoteFile) -> None:
        self.remote, self.size = remote, 0
        self._hashers: list[Any] = []
        if remote.checksum == MD5:
            self._hashers = [hashlib.md5()]
        elif remote.checksum == SHA256:
            self._hashers = [hashlib.sha256()]
        elif remote.checksum == GIT_SHA1:
            self._hashers = [hashlib.sha1(f"blob {remote.size}\0".encode())]
        elif remote.checksum == MULTIPART:
            parts = int(remote.expected.rsplit("-", 1)[1])
            self._hashers = [_MultipartMD5(p) for p in _part_sizes(remote.size, parts)]

    @property
    def checked(self) -> str:
        """What the check covers, for the log."""
        if self.remote.checksum == MULTIPART and not self._hashers:
            return "size only (multipart ETag with an unusual part size)"
        return self.remote.checksum if self.remote.checksum != SIZE_ONLY else "size only"

    def update(self, data: bytes) -> None:
        self.size += len(data)
        view = memoryview(data)
        for hasher in self._hashers:
            hasher.update(view)

    def problem(self) -> str | None:
        """None when the bytes match; else what differs."""
        if self.size != self.remote.size:
            return f"{self.size} bytes, expected {self.remote.size}"
        if not self._hashers:
            return None
        if self.remote.checksum == MULTIPART:
            got = [h.etag() for h in self._hashers]
            if self.remote.expected in got:
                return None
            return f"multipart ETag {self.remote.expected} matches no common part size"
        got_one = self._hashers[0].hexdigest()
        if got_one == self.remote.expected:
            return None
        return f"{self.remote.checksum} {got_one}, expected {self.remote.expected}"


def _part_sizes(size: int, parts: int) -> list[int]:
    """Part sizes that split `size` bytes into `parts` parts: the common ones, and the
    MiB-rounded even split."""
    even = -(-size // parts)
    even_mib = -(-even // MiB) * MiB
    candidates = sorted({*COMMON_PART_SIZES, even_mib})
    return [p for p in candidates if p > 0 and -(-size // p) == parts]
