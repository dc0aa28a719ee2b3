"""hf://org/repo[@revision] through huggingface_hub: resolve the revision to a commit, list
the files with their published checksums, snapshot-download, then hash every file.

huggingface_hub resumes its own partial downloads (under DEST/.cache/huggingface) and uses
its fast transfer backend (hf_xet) where installed. HF_TOKEN authenticates; HF_ENDPOINT
points at a mirror.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import disable_progress_bars
from tessera.runtime.fetch.download import (
    PROGRESS_EVERY_S,
    FetchError,
    Manifest,
    Progress,
    describe,
    safe_relative,
    verify_files,
)
from tessera.runtime.fetch.source import STATE_DIR, FetchFailure, Source
from tessera.runtime.fetch.verify import GIT_SHA1, SHA256, RemoteFile

T = TypeVar("T")
_TOKEN_HINT = "set HF_TOKEN in the Secret named in weights.credentialsSecret"


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def hub_error(source: Source, error: BaseException) -> FetchError:
    repo = f"hf://{source.location}"
    if isinstance(error, GatedRepoError):
        return FetchError(FetchFailure.CREDENTIALS, f"{repo}: the repository is gated and "
                          f"this token has not been granted access; {_TOKEN_HINT}")
    if isinstance(error, RevisionNotFoundError):
        return FetchError(FetchFailure.NOT_FOUND,
                          f"{repo}: no revision {source.revision!r}; fix weights.uri")
    if isinstance(error, RepositoryNotFoundError):
        return FetchError(FetchFailure.NOT_FOUND, f"{repo}: no such repository, or it is "
                          f"private and the token does not reach it; {_TOKEN_HINT}")
    status = _status(error)
    if status in (401, 403):
        return FetchError(FetchFailure.CREDENTIALS,
                          f"{repo}: the Hub refused the token (HTTP {status}); {_TOKEN_HINT}")
    if status == 404:
        return FetchError(FetchFailure.NOT_FOUND, f"{repo}: not found (HTTP 404)")
    return FetchError(FetchFailure.UNREACHABLE, f"{repo}: the Hub could not be reached or "
                      f"failed ({describe(error)[:300]})")


def _calling_hub(source: Source, call: Callable[[], T]) -> T:
    try:
        return call()
    except FetchError:
        raise
    except Exception as e:  # the Hub's HTTP errors and the HTTP client's connection errors
        raise hub_error(source, e) from None


def hub_files(api: HfApi, source: Source) -> tuple[str, list[RemoteFile]]:
    """The commit the revision names, and every file in it with its published checksum."""
    def listing() -> tuple[str, list[Any]]:
        commit = api.model_info(source.location, revision=source.revision).sha
        entries = api.list_repo_tree(source.location, revision=commit, recursive=True)
        return str(commit), [e for e in entries if hasattr(e, "blob_id")]

    commit, entries = _calling_hub(source, listing)
    files = []
    for entry in entries:
        path = safe_relative(entry.path)
        if entry.lfs is not None:
            files.append(RemoteFile(path, int(entry.lfs.size), SHA256, entry.lfs.sha256))
        else:
            files.append(RemoteFile(path, int(entry.size), GIT_SHA1, entry.blob_id))
    return commit, files


def _bytes_on_disk(dest: Path) -> int:
    """What the Hub's client has written so far, partial files included."""
    return sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()
               and STATE_DIR not in f.parts)


def _download_watched(source: Source, commit: str, dest: Path, workers: int,
                      progress: Progress) -> None:
    """snapshot_download, with the bytes on disk logged every PROGRESS_EVERY_S seconds
    (its own progress bars are off: they would flood a pod log)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(PROGRESS_EVERY_S):
            progress.set(_bytes_on_disk(dest))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _calling_hub(source, lambda: snapshot_download(
            source.location, revision=commit, local_dir=dest, max_workers=workers))
    finally:
        stop.set()
        watcher.join()


def fetch_hub(source: Source, dest: Path, workers: int) -> list[RemoteFile]:
    # Its progress bars and per-request lines would flood a pod log; Progress reports instead.
    disable_progress_bars()
    for name in ("httpx", "httpx2", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.WARNING)
    api = HfApi()
    commit, files = hub_files(api, source)
    if not files:
        raise FetchError(FetchFailure.NOT_FOUND, f"hf://{source.location}@{commit}: the "
                         "repository has no files")
    state = f"hf://{source.location}@{commit}"
    manifest = Manifest.load(dest, state)
    total = sum(f.size for f in files)
    progress = Progress(f"{source.uri} ({commit[:12]})", total)
    for _attempt in (1, 2):
        _download_watched(source, commit, dest, workers, progress)
        bad = verify_files(source, files, dest, manifest, workers)
        if not bad:
            manifest.complete = True
            manifest.save()
            return files
        # A deleted file is fetched again by the next snapshot: its local metadata says it
        # was complete, so that goes too.
        for remote in bad:
            meta = dest / ".cache" / "huggingface" / "download" / f"{remote.path}.metadata"
            meta.unlink(missing_ok=True)
    raise FetchError(FetchFailure.VERIFY, f"{state}: {', '.join(f.path for f in bad)} did not "
                     "match the Hub's checksum on two downloads in a row")
