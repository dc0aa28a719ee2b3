"""Real storage servers on loopback for the weight-fetch tests; nothing reaches the internet.

- S3: tests/s3server, gofakes3's in-memory S3 (MIT) with Signature V4 checked against one
  key, built from the Go module proxy once and cached by the hash of its sources.
- GCS: fake-gcs-server (BSD-2-Clause), built from the Go module proxy once and cached. It
  checks no credentials; its listing's ETags are base64, so a gs:// fetch from it is checked
  by size (real GCS gives the hex MD5 of a non-composite object, checked as such).
- Hugging Face: olah (MIT) serving local git repositories (LFS objects included) in its
  offline mirror mode: the Hub's API as huggingface_hub calls it. olah's dependencies
  (fastapi-utils pins psutil<6) do not belong in the project's environment, so it lives in
  a virtual environment of its own, made once and cached.

`python3 tests/stores.py` prepares all three (scripts/setup.sh runs it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from tessera.devcluster.build import cache_root

ROOT = Path(__file__).resolve().parents[1]
S3SERVER_SOURCE = ROOT / "tests" / "s3server"
OLAH = "olah==0.5.4"
FAKE_GCS = "github.com/fsouza/fake-gcs-server@v1.56.1"
ACCESS_KEY = "TESSERATESTKEY"
SECRET_KEY = "tessera-test-secret-key"


def s3server_binary() -> Path:
    """The S3 server, built on first use (about a minute cold)."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((S3SERVER_SOURCE / name).read_bytes())
    binary = cache_root() / "s3server" / digest.hexdigest()[:16] / "s3server"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-trimpath", "-o", str(binary) + ".tmp", "."],
                       cwd=S3SERVER_SOURCE, check=True, env={**os.environ, "CGO_ENABLED": "0"})
        os.replace(str(binary) + ".tmp", binary)
    return binary


def fake_gcs_binary() -> Path:
    """fake-gcs-server, built on first use (about five minutes cold on two cores)."""
    module, version = FAKE_GCS.split("@")
    binary = cache_root() / "fake-gcs-server" / version / "fake-gcs-server"
    if not binary.exists():
        build = binary.parent / "build"
        subprocess.run(["go", "install", "-trimpath", FAKE_GCS], check=True, cwd=cache_root(),
                       env={**os.environ, "CGO_ENABLED": "0", "GOBIN": str(build)})
        os.replace(build / module.rsplit("/", 1)[1], binary)
    return binary


def olah_python() -> Path:
    """The python of olah's own virtual environment, made on first use."""
    venv = cache_root() / ("venv-" + OLAH.replace("==", "-"))
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        # Run from the venv: from the checkout, its operator/ would shadow the standard one.
        subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", OLAH], check=True, cwd=venv)
        (venv / "ready").touch()
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Process:
    def __init__(self, argv: list[str], log: Path, cwd: Path | None = None) -> None:
        self.log = log
        self._out: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, cwd=cwd)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log.read_text(errors="replace"))
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.log} never said {pattern!r}:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


class S3Server(_Process):
    """One server seeded with {bucket: folder}; `env()` is what a fetch pod's Secret holds."""

    def __init__(self, seeds: dict[str, Path], workdir: Path) -> None:
        argv = [str(s3server_binary()), "-access-key", ACCESS_KEY, "-secret-key", SECRET_KEY]
        for bucket, folder in seeds.items():
            argv += ["-seed", f"{bucket}={folder}"]
        super().__init__(argv, workdir / "s3server.log")
        self.endpoint = "http://" + self.wait_for(r"listening on (\S+)").group(1)

    def env(self, secret: str = SECRET_KEY) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true",
                "AWS_REGION": "us-east-1"}


class Proxy:
    """A loopback TCP proxy in front of an HTTP server. `corrupt_over`: flip the first body
    byte of every response larger than that (data corrupted in transit, under valid headers);
    `bytes_per_s`: pace response bodies (a slow link, so a test can kill a fetch midway)."""

    def __init__(self, target: str, corrupt_over: int | None = None,
                 bytes_per_s: int | None = None) -> None:
        self.target = target.removeprefix("http://")
        self.corrupt_over, self.bytes_per_s = corrupt_over, bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.corrupted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client),
                             daemon=True).start()

    @staticmethod
    def _relay(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _responses(self, upstream: socket.socket, client: socket.socket) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buf:
                    data = upstream.recv(1 << 16)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                client.sendall(head + b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if length is None:  # no framing to follow: pass the rest through as it is
                    client.sendall(buf)
                    self._relay(upstream, client)
                    return
                left = int(length.group(1))
                flip = self.corrupt_over is not None and left > self.corrupt_over
                while left:
                    if not buf:
                        buf = upstream.recv(1 << 16)
                        if not buf:
                            return
                    part, buf = buf[:left], buf[left:]
                    if self.bytes_per_s:
                        time.sleep(len(part) / self.bytes_per_s)
                    if flip:
                        part = bytes([part[0] ^ 0xFF]) + part[1:]
                        flip = False
                        self.corrupted += 1
                    client.sendall(part)
                    left -= len(part)

    def stop(self) -> None:
        self._listener.close()


class GcsServer(_Process):
    """fake-gcs-server over `data` (each folder a bucket, each file under it an object);
    `env()` is a service-account key pointing obstore's GCS client at it."""

    def __init__(self, data: Path, workdir: Path) -> None:
        port = free_port()
        netloc = f"127.0.0.1:{port}"
        super().__init__([str(fake_gcs_binary()), "-scheme", "http", "-host", "127.0.0.1",
                          "-port", str(port), "-backend", "memory", "-data", str(data),
                          "-public-host", netloc], workdir / "fake-gcs-server.log")
        self.wait_for("server started")
        self.endpoint = f"http://{netloc}"

    def env(self) -> dict[str, str]:
        key = {"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "",
               "private_key": "", "private_key_id": ""}
        return {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(key)}


def lfs_repo(root: Path, org: str, name: str, files: dict[str, bytes],
             lfs: set[str]) -> tuple[Path, str]:
    """A git repository as the Hub stores one: `lfs` files as LFS pointers with their
    objects under .git/lfs/objects, the rest as plain blobs. Returns (path, commit)."""
    repo = root / "models" / org / name
    repo.mkdir(parents=True)
    git = ["git", "-c", "user.name=tessera", "-c", "user.email=tests@tessera.dev"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=repo, check=True)
    for path, data in files.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if path in lfs:
            oid = hashlib.sha256(data).hexdigest()
            obj = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
            obj.parent.mkdir(parents=True, exist_ok=True)
            obj.write_bytes(data)
            target.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\n"
                              f"size {len(data)}\n")
        else:
            target.write_bytes(data)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "weights"], cwd=repo, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True,
                            capture_output=True, text=True).stdout.strip()
    return repo, commit


class HubMirror(_Process):
    """olah in offline mirror mode over the repositories under `mirrors` (made with
    lfs_repo); `env()` points huggingface_hub at it."""

    def __init__(self, mirrors: Path, workdir: Path) -> None:
        port = free_port()
        netloc = f"127.0.0.1:{port}"
        config = workdir / "olah.toml"
        config.write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {port}\nmirror-netloc = "{netloc}"\n'
            f'mirror-lfs-netloc = "{netloc}"\nrepos-path = "{workdir / "olah-cache"}"\n'
            f'mirrors-path = ["{mirrors}"]\n\n[accessibility]\noffline = true\n')
        olah = olah_python().parent / "olah-cli"
        super().__init__([str(olah), "-c", str(config)], workdir / "olah.log", cwd=workdir)
        self.wait_for(r"Uvicorn running on")
        self.endpoint = f"http://{netloc}"

    def env(self) -> dict[str, str]:
        return {"HF_ENDPOINT": self.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}


if __name__ == "__main__":
    print(s3server_binary())
    print(fake_gcs_binary())
    print(olah_python())
