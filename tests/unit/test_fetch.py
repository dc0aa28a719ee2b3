"""`tessera-runtime fetch` against real servers on loopback (tests/stores.py): an S3 server
with signature checks, and olah serving a Hub repository offline. Byte-identical trees,
resume after a kill, corruption detected, clear credential errors, preflight on the result."""

from __future__ import annotations

import filecmp
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stores import SECRET_KEY, GcsServer, HubMirror, Proxy, S3Server, free_port, lfs_repo
from tessera.runtime.fetch.download import Progress, redact
from tessera.runtime.fetch.source import STATE_DIR, FetchFailure, Source, SourceError, cache_dir
from tessera.runtime.fetch.verify import (
    GIT_SHA1,
    MD5,
    MULTIPART,
    SHA256,
    Digest,
    RemoteFile,
    from_etag,
)

MiB = 1 << 20


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("uri, source, folder", [
    ("hf://moonshotai/Kimi-K2-Instruct", Source("hf", "moonshotai/Kimi-K2-Instruct", "", "main"),
     "hf/moonshotai/Kimi-K2-Instruct@main"),
    ("hf://org/m@0123abc", Source("hf", "org/m", "", "0123abc"), "hf/org/m@0123abc"),
    ("s3://weights/kimi/fp8/", Source("s3", "weights", "kimi/fp8", ""), "s3/weights/kimi/fp8"),
    ("gs://bucket-1", Source("gs", "bucket-1", "", ""), "gs/bucket-1"),
])
def test_uris_parse_and_cache_folders_differ_per_source(uri: str, source: Source,
                                                        folder: str) -> None:
    assert Source.parse(uri) == source
    assert cache_dir(uri) == folder


@pytest.mark.parametrize("uri", ["pvc://claim/x", "hf://just-a-name", "s3://Bad_Bucket/x",
                                 "hf://org/repo/extra", "gs://"])
def test_unfetchable_uris_say_how_to_write_one(uri: str) -> None:
    with pytest.raises(SourceError, match="write|starts with"):
        Source.parse(uri)


def digest_of(remote: RemoteFile, data: bytes, chunk: int = 3 * MiB) -> str | None:
    d = Digest(remote)
    for i in range(0, len(data), chunk):
        d.update(data[i:i + chunk])
    return d.problem()


def test_each_published_checksum_is_checked_and_a_flipped_byte_is_caught() -> None:
    data = os.urandom(11 * MiB + 5)
    parts = [data[i:i + 8 * MiB] for i in range(0, len(data), 8 * MiB)]
    multipart = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    blob = subprocess.run(["git", "hash-object", "--stdin"], input=data, capture_output=True,
                          check=True).stdout.decode().strip()  # git's own blob id
    cases = [from_etag("a", len(data), f'"{hashlib.md5(data).hexdigest()}"'),
             from_etag("a", len(data), f'"{multipart}-2"'),
             RemoteFile("a", len(data), SHA256, hashlib.sha256(data).hexdigest()),
             RemoteFile("a", len(data), GIT_SHA1, blob)]
    assert [c.checksum for c in cases] == [MD5, MULTIPART, SHA256, GIT_SHA1]
    flipped = bytearray(data)
    flipped[7 * MiB] ^= 1
    for remote in cases:
        assert digest_of(remote, data) is None, remote
        assert digest_of(remote, bytes(flipped)) is not None, remote
        assert "bytes, expected" in (digest_of(remote, data[:-1]) or "")


def test_progress_logs_every_5_percent_or_10_seconds_not_every_chunk() -> None:
    now = [0.0]
    lines: list[str] = []
    progress = Progress("s3://b", 1000 * MiB, clock=lambda: now[0], emit=lines.append)
    for _ in range(100):  # 100 chunks of 1% each, 0.1 s apart
        now[0] += 0.1
        progress.add(10 * MiB)
    assert len(lines) == 20
    assert lines[0].startswith("s3://b: 0.05 of 0.98 GiB (5%)")
    now[0] = 0.0
    slow = Progress("s3://b", 10_000 * MiB, clock=lambda: now[0], emit=lines.append)
    lines.clear()
    for _ in range(30):  # 0.1% per 2 s: only the 10 s rule fires
        now[0] += 2
        slow.add(10 * MiB)
    assert len(lines) == 6 and "left" in lines[-1]


def test_progress_counts_resumed_bytes_as_done_but_not_in_the_rate() -> None:
    now = [0.0]
    lines: list[str] = []
    progress = Progress("s3://b", 1000 * MiB, clock=lambda: now[0], emit=lines.append)
    progress.resume(600 * MiB)  # a partial file from a killed run
    now[0] = 10.0
    progress.add(400 * MiB)  # the rest, in 10 s: 40 MiB/s
    assert lines[-1] == "s3://b: 0.98 of 0.98 GiB (100%), 40 MiB/s"


def test_credentials_never_reach_a_message() -> None:
    env = {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "HF_TOKEN": "hf_abcdef"}
    assert redact("signed with s3cr3t-value and hf_abcdef", env) == "signed with *** and ***"


# ---------------------------------------------------------------- against the servers


def fetch(uri: str, dest: Path, env: dict[str, str], *extra: str,
          wait: bool = True) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tessera.runtime.main", "fetch", uri, str(dest),
            "--termination-log", str(dest.parent / f"{dest.name}.termination"), *extra]
    full_env = {**os.environ, "PYTHONSAFEPATH": "1", **env}
    if not wait:
        return subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=180)


def same_tree(a: Path, b: Path) -> bool:
    """Every file of `a` in `b`, byte for byte, and nothing else outside the fetch state."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()
                     and STATE_DIR not in p.parts and ".cache" not in p.parts)
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False)
                                      for f in files_a)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A checkpoint-like folder: a large shard, small JSON, a nested file, an empty file."""
    root = tmp_path / "source"
    (root / "nested").mkdir(parents=True)
    with (root / "model-00001-of-00001.safetensors").open("wb") as f:
        for _ in range(48):
            f.write(os.urandom(MiB))
    (root / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    (root / "nested" / "tokenizer.json").write_bytes(os.urandom(4096))
    (root / "empty.txt").write_bytes(b"")
    return root


@pytest.fixture
def s3(tree: Path, tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server({"weights": tree.parent}, tmp_path)
    yield server
    server.stop()


def test_s3_tree_arrives_byte_identical_and_a_rerun_fetches_nothing(
        s3: S3Server, tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    first = fetch("s3://weights/source", dest, s3.env())
    assert first.returncode == 0, first.stdout + first.stderr
    assert same_tree(tree, dest)
    assert "4 files" in (tmp_path / "dest.termination").read_text()
    again = fetch("s3://weights/source", dest, s3.env())
    assert again.returncode == 0
    assert "4 already verified here, 0.00 GiB to fetch" in again.stderr


def _sizes(folder: Path) -> list[int]:
    """Sizes of the files in `folder` now; a small file finished (moved away) between the
    listing and its stat is simply gone."""
    sizes = []
    for path in folder.glob("*") if folder.exists() else []:
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:
            pass
    return sizes


def test_s3_fetch_killed_midway_resumes_where_it_stopped(s3: S3Server, tree: Path,
                                                        tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    partial_dir = dest / STATE_DIR / "partial"
    slow = Proxy(s3.endpoint, bytes_per_s=16 * MiB)  # the 48 MiB shard takes 3 s
    proc = fetch("s3://weights/source", dest, {**s3.env(), "AWS_ENDPOINT_URL": slow.endpoint},
                 wait=False)
    assert isinstance(proc, subprocess.Popen)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill once some of the large shard is on disk
        if any(s > 4 * MiB for s in _sizes(partial_dir)):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    slow.stop()
    (partial,) = partial_dir.glob("*")
    kept = partial.stat().st_size
    assert MiB < kept < 48 * MiB
    resumed = fetch("s3://weights/source", dest, s3.env())
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at {kept / (1 << 30):.2f} of 0.05 GiB" in resumed.stderr
    assert same_tree(tree, dest)
    assert not partial_dir.exists()


def test_s3_corrupted_partial_is_detected_and_fetched_again(s3: S3Server, tree: Path,
                                                           tmp_path: Path) -> None:
    """A torn write before a kill: the resumed bytes hash to the wrong MD5, the file is
    thrown away and fetched once more from its first byte."""
    dest = tmp_path / "dest"
    shard = (tree / "model-00001-of-00001.safetensors").read_bytes()
    # As the server lists it: its ETag is the MD5 of the bytes.
    meta = from_etag("model-00001-of-00001.safetensors", len(shard),
                     hashlib.md5(shard).hexdigest())
    from tessera.runtime.fetch import download

    partial = download._partial_path(dest, meta)
    partial.parent.mkdir(parents=True)
    garbage = bytearray(shard[:5 * MiB])
    garbage[MiB] ^= 0xFF
    partial.write_bytes(bytes(garbage))
    result = fetch("s3://weights/source", dest, s3.env())
    assert result.returncode == 0, result.stderr
    assert "md5" in result.stderr and "fetching again from the start" in result.stderr
    assert same_tree(tree, dest)


def test_s3_object_corrupted_in_transit_fails_the_fetch_after_one_retry(
        s3: S3Server, tmp_path: Path) -> None:
    proxy = Proxy(s3.endpoint, corrupt_over=MiB)
    try:
        result = fetch("s3://weights/source", tmp_path / "dest",
                       {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint})
    finally:
        proxy.stop()
    assert proxy.corrupted == 2  # the large shard, twice: the first mismatch is retried
    assert result.returncode == FetchFailure.VERIFY, result.stderr
    message = (tmp_path / "dest.termination").read_text()
    assert message.startswith("model-00001-of-00001.safetensors: md5 ")
    assert "on two downloads in a row" in message
    assert not (tmp_path / "dest" / "model-00001-of-00001.safetensors").exists()


def test_s3_wrong_secret_is_one_clear_line_without_the_secret(s3: S3Server,
                                                              tmp_path: Path) -> None:
    result = fetch("s3://weights/source", tmp_path / "dest", s3.env(secret="wrong-secret-x"))
    assert result.returncode == FetchFailure.CREDENTIALS
    message = (tmp_path / "dest.termination").read_text()
    assert message.startswith("s3://weights: the store refused the credentials (HTTP 403 "
                              "SignatureDoesNotMatch)")
    assert "wrong-secret-x" not in result.stdout + result.stderr
    assert SECRET_KEY not in result.stdout + result.stderr
    missing = fetch("s3://nothing-here/x", tmp_path / "dest", s3.env())
    assert missing.returncode == FetchFailure.NOT_FOUND
    assert "s3://nothing-here: not found (HTTP 404 NoSuchBucket)" in missing.stderr


def test_gs_tree_arrives_byte_identical(tree: Path, tmp_path: Path) -> None:
    data = tmp_path / "gcs"
    shutil.copytree(tree, data / "gbucket" / "ckpt")
    server = GcsServer(data, tmp_path)
    try:
        result = fetch("gs://gbucket/ckpt", tmp_path / "dest", server.env())
        again = fetch("gs://gbucket/ckpt", tmp_path / "dest", server.env())
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert same_tree(tree, tmp_path / "dest")
    # This server's ETags are base64, not the hex MD5 real GCS gives: the log says so.
    assert "model-00001-of-00001.safetensors verified: size only" in result.stderr
    assert "4 already verified here, 0.00 GiB to fetch" in again.stderr


def test_a_fetched_synthetic_checkpoint_passes_preflight(tmp_path: Path) -> None:
    from tessera.runtime.config import ModelConfig, RuntimeConfig, WeightsConfig
    from tessera.runtime.preflight import check_checkpoint, read_checkpoint
    from tessera.runtime.quantize.synthetic import TINY_CONFIGS, write_checkpoint

    source = write_checkpoint(tmp_path / "bucket" / "kimi", TINY_CONFIGS["kimi-k2"], dtype="fp8",
                              max_shard_bytes=1 << 20)
    server = S3Server({"ckpt": tmp_path / "bucket"}, tmp_path)
    try:
        result = fetch("s3://ckpt/kimi", tmp_path / "models", server.env())
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert same_tree(source, tmp_path / "models")
    config = RuntimeConfig(deployment="k", namespace="n", phase="decode",
                           model=ModelConfig(name="k", path=str(tmp_path / "models")),
                           weights=WeightsConfig(dtype="fp8", format="safetensors"))
    facts = read_checkpoint(str(tmp_path / "models"))
    assert len(facts.weight_files) > 1
    assert check_checkpoint(config, facts) is None


# ---------------------------------------------------------------- Hugging Face (olah)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[HubMirror, dict[str, bytes], str, Path]]:
    files = {"model-00001-of-00002.safetensors": os.urandom(3 * MiB),
             "model-00002-of-00002.safetensors": os.urandom(2 * MiB + 7),
             "config.json": b'{"model_type": "kimi_k2"}',
             "tokenizer/vocab.txt": b"a\nb\n"}
    repo, commit = lfs_repo(tmp_path / "mirrors", "org", "tiny", files,
                            lfs={n for n in files if n.endswith(".safetensors")})
    server = HubMirror(tmp_path / "mirrors", tmp_path)
    yield server, files, commit, repo
    server.stop()


def test_hub_repo_arrives_verified_by_lfs_sha256_and_git_blob_ids(hub, tmp_path: Path) -> None:
    server, files, commit, _ = hub
    dest = tmp_path / "dest"
    result = fetch(f"hf://org/tiny@{commit}", dest, server.env())
    assert result.returncode == 0, result.stderr
    for path, data in files.items():
        assert (dest / path).read_bytes() == data
    assert "4 files" in (tmp_path / "dest.termination").read_text()
    missing = fetch("hf://org/tiny@no-such-branch", tmp_path / "d2", server.env())
    assert missing.returncode == FetchFailure.NOT_FOUND, missing.stderr


def test_hub_object_that_does_not_match_its_sha256_fails_the_fetch(hub, tmp_path: Path) -> None:
    server, files, commit, repo = hub
    name = "model-00002-of-00002.safetensors"
    oid = hashlib.sha256(files[name]).hexdigest()
    obj = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
    corrupted = bytearray(obj.read_bytes())
    corrupted[100] ^= 1
    obj.write_bytes(bytes(corrupted))  # the server now serves bytes its pointer does not hash to
    result = fetch("hf://org/tiny", tmp_path / "dest", server.env())
    assert result.returncode == FetchFailure.VERIFY, result.stderr
    assert f"{name} did not match the Hub's checksum" in result.stderr


def test_hub_refusals_and_an_unreachable_hub_are_named(tmp_path: Path) -> None:
    import httpx2 as httpx  # the HTTP client huggingface_hub uses
    from huggingface_hub.errors import HfHubHTTPError
    from tessera.runtime.fetch.hub import hub_error

    source = Source.parse("hf://org/private")
    response = httpx.Response(401, request=httpx.Request("GET", "http://hub/api/models/x"))
    refused = hub_error(source, HfHubHTTPError("401 Client Error", response=response))
    assert refused.failure == FetchFailure.CREDENTIALS
    assert str(refused).startswith("hf://org/private: the Hub refused the token (HTTP 401)")
    closed = free_port()
    result = fetch("hf://org/tiny", tmp_path / "dest",
                   {"HF_ENDPOINT": f"http://127.0.0.1:{closed}", "HF_TOKEN": "hf_secretvalue"})
    assert result.returncode == FetchFailure.UNREACHABLE, result.stderr
    assert "hf://org/tiny: the Hub could not be reached" in result.stderr
    assert "hf_secretvalue" not in result.stderr


def size_or_0(path: Path) -> int:
    """A file's size, or 0 where it went between listing and looking (a finished download's
    .incomplete file is renamed into place)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_hub_fetch_killed_midway_resumes_and_verifies(tmp_path: Path) -> None:
    big = b"".join(os.urandom(MiB) for _ in range(96))
    files = {"model.safetensors": big, "config.json": b"{}"}
    lfs_repo(tmp_path / "mirrors", "org", "big", files, lfs={"model.safetensors"})
    server = HubMirror(tmp_path / "mirrors", tmp_path)
    try:
        dest = tmp_path / "dest"
        slow = Proxy(server.endpoint, bytes_per_s=16 * MiB)  # the 96 MiB file takes 6 s
        proc = fetch("hf://org/big", dest, {**server.env(), "HF_ENDPOINT": slow.endpoint},
                     wait=False)
        assert isinstance(proc, subprocess.Popen)
        partial: list[Path] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not partial:
            partial = [p for p in dest.rglob("*.incomplete") if size_or_0(p) > 4 * MiB]
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        slow.stop()
        assert partial, "the download finished before it could be killed"
        kept = partial[0].stat().st_size
        assert kept < len(big) and not (dest / "model.safetensors").exists()
        resumed = fetch("hf://org/big", dest, server.env())
        assert resumed.returncode == 0, resumed.stderr
        assert (dest / "model.safetensors").read_bytes() == big
        assert "0.09 of 0.09 GiB" in resumed.stderr  # verified: every byte hashed
    finally:
        server.stop()
