"""Fetch a checkpoint into a folder: resumable, every file verified, progress in the log.

The folder keeps, under STATE_DIR, a manifest of the files already verified and the partial
downloads of the others. A killed fetch started again skips what the manifest lists and
resumes each partial file from its last byte (re-hashing the bytes it has first), so a
600 GB fetch interrupted at 590 GB costs the last 10 GB, not 600.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from tessera.runtime.fetch.source import STATE_DIR, FetchFailure, Source
from tessera.runtime.fetch.verify import Digest, RemoteFile

log = logging.getLogger("tessera-runtime.fetch")

GiB = 1 << 30
MANIFEST = "manifest.json"
PARTIAL_DIR = "partial"
PROGRESS_EVERY_S = 10.0
PROGRESS_STEP = 0.05  # also log each time another 5% has arrived
CHUNK_BYTES = 8 << 20
DEFAULT_WORKERS = 8
# Environment variables that may hold credentials: their values never reach a log line.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN",
              "GOOGLE_SERVICE_ACCOUNT_KEY", "AWS_ACCESS_KEY_ID")


class FetchError(Exception):
    """A fetch that cannot finish: its exit code and one line naming the source and cause."""

    def __init__(self, failure: FetchFailure, message: str) -> None:
        super().__init__(redact(message))
        self.failure = failure


def redact(text: str, env: dict[str, str] | None = None) -> str:
    """`text` with the value of every credential variable replaced by ***."""
    env = dict(os.environ) if env is None else env
    for name in SECRET_ENV:
        value = env.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text


class Progress:
    """Bytes arrived out of a known total; one log line every PROGRESS_EVERY_S seconds or
    every PROGRESS_STEP of the total, whichever comes first. Thread-safe."""

    def __init__(self, what: str, total: int, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[str], None] = log.info) -> None:
        self.what, self.total, self._clock, self._emit = what, total, clock, emit
        self.done = 0
        self._resumed = 0  # bytes found on disk: done, but not fetched at this run's rate
        self._start = self._last_time = clock()
        self._last_step = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = self._clock()
            step = int(self.done / self.total / PROGRESS_STEP) if self.total else 0
            if now - self._last_time >= PROGRESS_EVERY_S or step > self._last_step:
                self._last_time, self._last_step = now, step
                self._emit(self.line(now))

    def resume(self, n: int) -> None:
        """`n` bytes of a partial file were already here."""
        with self._lock:
            self.done += n
            self._resumed += n

    def set(self, done: int) -> None:
        """For a fetch whose client does not report bytes (the Hub's): what is on disk."""
        with self._lock:
            delta = done - self.done
        if delta > 0:
            self.add(delta)

    def line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = (self.done - self._resumed) / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100 * self.done / self.total if self.total else 100.0
        eta = f", about {_duration(left)} left" if self.done < self.total and rate > 0 else ""
        return (f"{self.what}: {self.done / GiB:.2f} of {self.total / GiB:.2f} GiB "
                f"({pct:.0f}%), {rate / (1 << 20):.0f} MiB/s{eta}")


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s"


@dataclass
class Manifest:
    """The files of DEST verified so far (path -> version); `complete` once all are."""

    path: Path
    source: str
    files: dict[str, str]
    complete: bool = False

    @classmethod
    def load(cls, dest: Path, source: str) -> Manifest:
        path = dest / STATE_DIR / MANIFEST
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls(path, source, {})
        if data.get("source") != source:  # another checkpoint's folder: verify everything
            return cls(path, source, {})
        return cls(path, source, dict(data.get("files", {})), bool(data.get("complete")))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"source": self.source, "complete": self.complete,
                                   "files": self.files}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def has(self, dest: Path, remote: RemoteFile) -> bool:
        """Verified before, and still there at its size."""
        local = dest / remote.path
        return (self.files.get(remote.path) == remote.version and local.is_file()
                and local.stat().st_size == remote.size)


class Store(Protocol):
    """An object store's two operations the fetch needs (store.py adapts obstore)."""

    def list(self) -> list[RemoteFile]: ...

    def read(self, path: str, offset: int) -> Iterable[bytes]: ...


def safe_relative(path: str) -> str:
    """A store key as a path under DEST; refuses keys that would escape it."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or ".." in parts or parts[0] == STATE_DIR:
        raise FetchError(FetchFailure.NOT_FOUND, f"refusing the object name {path!r}: it "
                         "would be written outside the destination folder")
    return path


def fetch_store(source: Source, store: Store, dest: Path,
                workers: int = DEFAULT_WORKERS) -> list[RemoteFile]:
    """Every object under the source's prefix into DEST, verified; returns what was listed."""
    files = store.list()
    if not files:
        raise FetchError(FetchFailure.NOT_FOUND, f"{source.uri}: no objects under this "
                         "prefix; check the bucket and folder in weights.uri")
    for f in files:
        safe_relative(f.path)
    manifest = Manifest.load(dest, source.uri)
    todo = [f for f in files if not manifest.has(dest, f)]
    total = sum(f.size for f in todo)
    log.info("%s: %d files, %.2f GiB; %d already verified here, %.2f GiB to fetch",
             source.uri, len(files), sum(f.size for f in files) / GiB, len(files) - len(todo),
             total / GiB)
    progress = Progress(source.uri, total)
    lock = threading.Lock()

    def one(remote: RemoteFile) -> None:
        _fetch_object(store, remote, dest, progress)
        with lock:
            manifest.files[remote.path] = remote.version
            manifest.save()

    _run_all(one, todo, workers)
    manifest.complete = True
    manifest.save()
    _remove_partials(dest)
    return files


def _run_all(work: Callable[[RemoteFile], None], files: Sequence[RemoteFile],
             workers: int) -> None:
    """`work` on every file, `workers` at a time; the first error stops the rest."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(work, f) for f in files]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _partial_path(dest: Path, remote: RemoteFile) -> Path:
    # Named by path and version: bytes of an older version of the object are never resumed.
    key = sha256(f"{remote.path}\0{remote.version}".encode()).hexdigest()[:32]
    return dest / STATE_DIR / PARTIAL_DIR / key


def _fetch_object(store: Store, remote: RemoteFile, dest: Path, progress: Progress) -> None:
    """One object into DEST/path: resume the partial file, hash every byte, check, then move
    into place. A mismatch discards the partial file and fetches once more from byte 0."""
    for attempt in (1, 2):
        problem, checked = _download(store, remote, dest, progress)
        if problem is None:
            # Worth a line when the store published nothing better than the size.
            (log.info if checked.startswith("size") else log.debug)(
                "%s verified: %s", remote.path, checked)
            return
        log.warning("%s: %s after attempt %d: discarded%s", remote.path, problem, attempt,
                    ", fetching again from the start" if attempt == 1 else "")
    raise FetchError(FetchFailure.VERIFY, f"{remote.path}: {problem} on two downloads in a "
                     "row: the object changed during the fetch or the data is corrupted in "
                     "transit")


def _download(store: Store, remote: RemoteFile, dest: Path,
              progress: Progress) -> tuple[str | None, str]:
    partial = _partial_path(dest, remote)
    partial.parent.mkdir(parents=True, exist_ok=True)
    digest = Digest(remote)
    offset = partial.stat().st_size if partial.exists() else 0
    if offset > remote.size:
        partial.unlink()
        offset = 0
    if offset:
        with partial.open("rb") as f:  # the bytes already here count towards the checksum
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
        log.info("%s: resuming at %.2f of %.2f GiB", remote.path, offset / GiB,
                 remote.size / GiB)
        progress.resume(offset)
    with partial.open("ab") as f:
        if offset < remote.size:
            for chunk in store.read(remote.path, offset):
                f.write(chunk)
                digest.update(chunk)
                progress.add(len(chunk))
        f.flush()
        os.fsync(f.fileno())
    problem = digest.problem()
    if problem is not None:
        partial.unlink()
        return problem, digest.checked
    target = dest / remote.path
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, target)
    return None, digest.checked


def _remove_partials(dest: Path) -> None:
    folder = dest / STATE_DIR / PARTIAL_DIR
    if folder.is_dir():
        for leftover in folder.iterdir():
            leftover.unlink()
        folder.rmdir()


def verify_files(source: Source, files: Sequence[RemoteFile], dest: Path,
                 manifest: Manifest, workers: int = DEFAULT_WORKERS) -> list[RemoteFile]:
    """Hash files already in DEST (the Hub's client wrote them) against what the Hub
    published; returns those that do not match (each is deleted). The manifest keeps the
    ones that do, so a second run hashes only the rest."""
    todo = [f for f in files if not manifest.has(dest, f)]
    progress = Progress(f"{source.uri}: verifying", sum(f.size for f in todo))
    bad: list[RemoteFile] = []
    lock = threading.Lock()

    def one(remote: RemoteFile) -> None:
        local = dest / remote.path
        digest = Digest(remote)
        if local.is_file():
            with local.open("rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    digest.update(chunk)
                    progress.add(len(chunk))
        problem = digest.problem() if local.is_file() else "missing"
        with lock:
            if problem is None:
                manifest.files[remote.path] = remote.version
                manifest.save()
            else:
                log.warning("%s: %s: discarded", remote.path, problem)
                local.unlink(missing_ok=True)
                bad.append(remote)

    _run_all(one, todo, workers)
    return bad


def fetch(uri: str, dest: Path, workers: int = DEFAULT_WORKERS) -> str:
    """Fetch `uri` into `dest`; returns a one-line summary. Raises FetchError."""
    source = Source.parse(uri)
    started = time.monotonic()
    dest.mkdir(parents=True, exist_ok=True)
    if source.scheme == "hf":
        from tessera.runtime.fetch.hub import fetch_hub
        files = fetch_hub(source, dest, workers)
    else:
        from tessera.runtime.fetch.store import ObjectStore
        files = fetch_store(source, ObjectStore(source), dest, workers)
    size = sum(f.size for f in files)
    elapsed = time.monotonic() - started
    return (f"fetched {source.uri} into {dest}: {len(files)} files, {size / GiB:.2f} GiB, "
            f"every file verified, in {_duration(elapsed)}")


def describe(obj: Any) -> str:
    """An exception's text on one line."""
    return " ".join(str(obj).split())
