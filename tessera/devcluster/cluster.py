"""A real local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok on 127.0.0.1, with simulated H200 nodes, and LeaderWorkerSet's
controller (its CRDs, and its webhooks called by the API server on loopback).

Two ways to hold one:
- attached (tests): `with DevCluster.create(state_dir) as c:`; the processes die with this one
  (PR_SET_PDEATHSIG), and leaving the block stops them and removes the state directory;
- detached (`tessera dev-cluster up`): the processes outlive the command; their pids go into
  `<state_dir>/cluster.json`, from which `DevCluster.attach` finds them again for `down`.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tessera.devcluster import certs
from tessera.devcluster.build import Binaries
from tessera.devcluster.nodes import DEFAULT_POOLS, NodePool, node_manifests
from tessera.devcluster.stages import kwok_config

STATE_FILE = "cluster.json"
SERVICE_CIDR = "10.0.0.0/24"
PORT_ATTEMPTS = 3
STOP_GRACE_S = 10.0
NODE_LEASE_S = 40
# Node leases are heartbeats (kwok renews one per node every 10 s): noise when counting writes.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "namespaces": ["kube-node-lease"],
         "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}]},
        {"level": "None", "nonResourceURLs": ["/healthz*", "/readyz*", "/livez*", "/version"]},
        {"level": "Metadata"},
    ],
}


class ClusterError(RuntimeError):
    """The control plane could not start or be reached; the message says which part and why."""


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {(self.stderr or '').strip()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the process that started it dies."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _alive(pid: int, exe: str) -> bool:
    """Is `pid` still the process we started (and not a recycled pid or a zombie)?"""
    cmd = _cmdline(pid)
    return bool(cmd) and cmd[0] == exe


@dataclass
class Process:
    name: str
    pid: int
    exe: str
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _alive(self.pid, self.exe)

    def stop(self) -> None:
        """SIGTERM its process group, then SIGKILL after a grace period."""
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            if not self.running():
                return
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.running():
            raise ClusterError(f"{self.name} (pid {self.pid}) survived SIGKILL")


@dataclass(frozen=True)
class Layout:
    """Every path inside one cluster's state directory."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.root / "audit.log"

    @property
    def audit_policy(self) -> Path:
        return self.root / "audit-policy.yaml"

    @property
    def state_file(self) -> Path:
        return self.root / STATE_FILE

    @property
    def lws_config(self) -> Path:
        return self.root / "lws-config.yaml"


# ---- pure builders ----------------------------------------------------------------------------


def kubeconfig(server: str, pki: certs.Pki) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "tessera-dev", "cluster": {
            "server": server, "certificate-authority": str(pki.ca_cert)}}],
        "users": [{"name": "tessera-admin", "user": {
            "client-certificate": str(pki.admin_cert), "client-key": str(pki.admin_key)}}],
        "contexts": [{"name": "tessera-dev", "context": {
            "cluster": "tessera-dev", "user": "tessera-admin"}}],
        "current-context": "tessera-dev",
    }


def etcd_argv(etcd: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(etcd), "--name=tessera", f"--data-dir={data_dir}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tessera={peer}", "--unsafe-no-fsync", "--log-level=warn",
    ]


def apiserver_argv(apiserver: Path, layout: Layout, pki: certs.Pki, etcd_port: int,
                   port: int) -> list[str]:
    return [
        str(apiserver), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
        # The `kubernetes` service's endpoints may not be a loopback address: publish none.
        "--endpoint-reconciler-type=none",
        f"--cert-dir={layout.pki}",
        f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}", "--authorization-mode=Node,RBAC",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        "--allow-privileged=true", "--enable-priority-and-fairness=false", "--profiling=false",
        f"--audit-policy-file={layout.audit_policy}", f"--audit-log-path={layout.audit_log}",
    ]


def controller_manager_argv(binary: Path, layout: Layout, pki: certs.Pki) -> list[str]:
    return [
        str(binary), f"--kubeconfig={layout.kubeconfig}", "--secure-port=0",
        "--leader-elect=false", f"--root-ca-file={pki.ca_cert}",
        f"--service-account-private-key-file={pki.sa_key}",
        "--use-service-account-credentials=true", "--profiling=false",
    ]


def scheduler_argv(binary: Path, layout: Layout) -> list[str]:
    return [str(binary), f"--kubeconfig={layout.kubeconfig}", "--secure-port=0",
            "--leader-elect=false", "--profiling=false"]


def kwok_argv(binary: Path, layout: Layout) -> list[str]:
    return [
        str(binary), f"--kubeconfig={layout.kubeconfig}", "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        # Heartbeat through node Leases; without them the node lifecycle controller marks the
        # nodes NotReady between kwok's (slower) status updates and evicts Ready from their pods.
        f"--node-lease-duration-seconds={NODE_LEASE_S}",
        f"--config={layout.root / 'kwok.yaml'}",
    ]


LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
LWS_POD_SELECTOR = {"matchExpressions": [
    {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}


def lws_config(pki: certs.Pki, webhook_port: int) -> dict[str, Any]:
    """LWS's own configuration file: one replica (no leader election), no metrics or probe
    listeners, and its webhooks on loopback with our certificate instead of the certificates
    it would otherwise generate into a Secret for an in-cluster Service."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port,
                    "certDir": str(pki.webhook_cert.parent)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": "0"},
    }


def lws_argv(binary: Path, layout: Layout) -> list[str]:
    return [str(binary), f"--config={layout.lws_config}", f"--kubeconfig={layout.kubeconfig}"]


def lws_webhook_configurations(webhook_port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """LWS's admission webhooks (as its release installs them: LeaderWorkerSets, and pods that
    carry its name label), addressed by URL so the API server reaches them on loopback."""
    ca_bundle = base64.b64encode(ca_pem).decode()

    def hook(name: str, path: str, group: str, resource: str, operations: list[str],
             object_selector: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "name": name,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "clientConfig": {"url": f"https://127.0.0.1:{webhook_port}{path}",
                             "caBundle": ca_bundle},
            "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": operations,
                       "resources": [resource]}],
            **({"objectSelector": object_selector} if object_selector else {}),
        }

    lws_group, both = "leaderworkerset.x-k8s.io", ["CREATE", "UPDATE"]
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1",
         "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": "lws-mutating-webhook-configuration"},
         "webhooks": [
             hook("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                  lws_group, "leaderworkersets", both),
             hook("mpod.kb.io", "/mutate--v1-pod", "", "pods", both, LWS_POD_SELECTOR)]},
        {"apiVersion": "admissionregistration.k8s.io/v1",
         "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": "lws-validating-webhook-configuration"},
         "webhooks": [
             hook("vleaderworkerset.kb.io",
                  "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                  lws_group, "leaderworkersets", both),
             hook("vpod.kb.io", "/validate--v1-pod", "", "pods", both, LWS_POD_SELECTOR)]},
    ]


# ---- the cluster ------------------------------------------------------------------------------


class DevCluster:
    """One running control plane. Build with `create` (start new) or `attach` (find running)."""

    def __init__(self, layout: Layout, binaries: Binaries, pools: tuple[NodePool, ...],
                 processes: list[Process], api_port: int, detached: bool) -> None:
        self.layout = layout
        self.binaries = binaries
        self.pools = pools
        self.processes = processes
        self.api_port = api_port
        self.detached = detached

    # -- what callers use --

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    @property
    def audit_log(self) -> Path:
        """JSON lines, one per API request at Metadata level (node leases and health checks
        left out)."""
        return self.layout.audit_log

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses: KUBECONFIG set, kubectl and helm first on PATH."""
        tools = str(self.binaries.kubectl.parent)
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": os.pathsep.join([tools, os.environ.get("PATH", "")])}

    def kubectl(self, *args: str, check: bool = True, input: str | Mapping[str, Any] | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster. A mapping `input` is sent as JSON (for `-f -`)."""
        text = input if input is None or isinstance(input, str) else json.dumps(input)
        argv = [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(argv, input=text, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def running(self) -> bool:
        return all(p.running() for p in self.processes) and self._api_ready()

    def stop(self) -> None:
        """Stop every process in reverse start order, by pid, and remove the state directory."""
        self._stop_processes()
        shutil.rmtree(self.layout.root, ignore_errors=True)

    def _stop_processes(self) -> None:
        errors = []
        for proc in reversed(self.processes):
            try:
                proc.stop()
            except ClusterError as err:
                errors.append(str(err))
        if errors:
            raise ClusterError("; ".join(errors))

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- starting --

    @classmethod
    def create(cls, state_dir: Path, binaries: Binaries,
               pools: tuple[NodePool, ...] = DEFAULT_POOLS, *, detached: bool = False,
               timeout: float = 90.0) -> DevCluster:
        """Start a fresh cluster in `state_dir` (which must not hold one) and wait until its
        nodes are Ready. On failure everything started so far is stopped again; the logs stay
        in `state_dir` for the error message to point at."""
        layout = Layout(state_dir)
        if layout.state_file.exists():
            raise ClusterError(f"{state_dir} already holds a cluster; stop it first")
        if missing := binaries.missing():
            raise ClusterError(f"binaries missing: {missing}; run `tessera dev-cluster build`")
        layout.logs.mkdir(parents=True, exist_ok=True)
        cluster = cls(layout, binaries, pools, [], 0, detached)
        try:
            cluster._start(timeout)
        except BaseException:
            cluster._stop_processes()
            layout.state_file.unlink(missing_ok=True)
            raise
        return cluster

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        layout, binaries = self.layout, self.binaries
        nodes = node_manifests(self.pools)  # validates the pools before anything starts
        pki = certs.generate(layout.pki)
        layout.audit_policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        # kwok reads ~/.kwok/kwok.yaml unless told otherwise: our own config keeps it
        # isolated, and holds the pod stages (stages.py).
        (layout.root / "kwok.yaml").write_text(kwok_config())

        etcd_port = 0

        def etcd() -> tuple[list[str], Callable[[], bool]]:
            nonlocal etcd_port
            etcd_port = free_port()
            argv = etcd_argv(binaries.etcd, layout.etcd_data, etcd_port, free_port())
            return argv, lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health")

        def apiserver() -> tuple[list[str], Callable[[], bool]]:
            self.api_port = free_port()
            layout.kubeconfig.write_text(yaml.safe_dump(kubeconfig(self.server, pki)))
            argv = apiserver_argv(binaries.kube_apiserver, layout, pki, etcd_port, self.api_port)
            return argv, self._api_ready

        self._launch("etcd", etcd, deadline)
        self._launch("kube-apiserver", apiserver, deadline)
        for name, argv in (
            ("kube-controller-manager",
             controller_manager_argv(binaries.kube_controller_manager, layout, pki)),
            ("kube-scheduler", scheduler_argv(binaries.kube_scheduler, layout)),
            ("kwok", kwok_argv(binaries.kwok, layout)),
        ):
            self._spawn(name, argv)
        self._write_state()
        self.kubectl("apply", "-f", "-", input={"apiVersion": "v1", "kind": "List",
                                                "items": nodes})
        self._start_lws(pki, deadline)
        wait_s = max(1, int(deadline - time.monotonic()))
        result = self.kubectl("wait", "--for=condition=Ready", "node", "--all",
                              f"--timeout={wait_s}s", check=False, timeout=wait_s + 10)
        if result.returncode != 0:
            raise ClusterError(f"nodes did not become Ready within {timeout:.0f} s: "
                               f"{result.stderr.strip()}; see {self._log('kwok')}")
        self._check_alive()

    def apply_lws_crds(self, timeout: float = 60.0) -> None:
        """Apply LeaderWorkerSet's CRDs and wait until the API server serves them."""
        deadline = time.monotonic() + timeout
        # Server-side: the CRD is too large for the last-applied annotation.
        self.kubectl("apply", "--server-side", "-f", str(self.binaries.lws_crds))
        # (`kubectl wait` fails at once on a CRD that has no conditions yet.)
        while not _established(json.loads(self.kubectl("get", f"crd/{LWS_CRD}", "-o",
                                                       "json").stdout)):
            if time.monotonic() > deadline:
                raise ClusterError(f"LeaderWorkerSet's CRD {LWS_CRD} was not established in "
                                   f"{timeout:.0f} s; see the kube-apiserver log")
            time.sleep(0.1)

    def _start_lws(self, pki: certs.Pki, deadline: float) -> None:
        """LeaderWorkerSet: its CRDs, then its controller (which needs them served), then its
        webhook configurations once its webhook server answers."""
        self.apply_lws_crds(deadline - time.monotonic())
        port = free_port()
        self.layout.lws_config.write_text(yaml.safe_dump(lws_config(pki, port)))
        proc = self._spawn("lws-controller", lws_argv(self.binaries.lws_controller, self.layout))
        self._write_state()
        while not _tls_ok(port, pki.ca_cert):
            if not proc.running() or time.monotonic() > deadline:
                raise ClusterError(f"lws-controller's webhook server did not come up on port "
                                   f"{port}; log: {self._log('lws-controller')}\n"
                                   f"{_tail(self._log('lws-controller'))}")
            time.sleep(0.1)
        self.kubectl("apply", "-f", "-", input={
            "apiVersion": "v1", "kind": "List",
            "items": lws_webhook_configurations(port, pki.ca_cert.read_bytes())})

    def _log(self, name: str) -> Path:
        return self.layout.logs / f"{name}.log"

    def _spawn(self, name: str, argv: list[str]) -> Process:
        with self._log(name).open("ab") as log:
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: Ctrl-C reaches only us
                preexec_fn=None if self.detached else _die_with_parent,
            )
        proc = Process(name, popen.pid, argv[0], popen)
        self.processes.append(proc)
        return proc

    def _launch(self, name: str, prepare: Callable[[], tuple[list[str], Callable[[], bool]]],
                deadline: float) -> None:
        """Start `name` and wait until `ready`; if its port was taken meanwhile, try new ports."""
        for _attempt in range(PORT_ATTEMPTS):
            argv, ready = prepare()
            proc = self._spawn(name, argv)
            while proc.running() and time.monotonic() < deadline:
                if ready():
                    return
                time.sleep(0.2)
            tail = _tail(self._log(name))
            if proc.running():
                raise ClusterError(f"{name} not ready in time; log: {self._log(name)}\n{tail}")
            self.processes.remove(proc)
            if "address already in use" not in tail.lower():
                raise ClusterError(
                    f"{name} exited with code {proc.popen.returncode if proc.popen else '?'} "
                    f"before it was ready; log: {self._log(name)}\n{tail}")
        raise ClusterError(f"{name}: ports kept being taken ({PORT_ATTEMPTS} attempts); "
                           f"log: {self._log(name)}")

    def _check_alive(self) -> None:
        for proc in self.processes:
            if not proc.running():
                raise ClusterError(f"{proc.name} exited; log: {self._log(proc.name)}\n"
                                   f"{_tail(self._log(proc.name))}")

    def _api_ready(self) -> bool:
        pki = self.layout.pki
        try:
            ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
            ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        except OSError:  # a stale state directory whose certificates are gone
            return False
        return _http_ok(f"{self.server}/readyz", ctx)

    # -- detached state --

    def _write_state(self) -> None:
        state = {
            "api_port": self.api_port,
            "pools": [vars(p) for p in self.pools],
            "processes": [{"name": p.name, "pid": p.pid, "exe": p.exe} for p in self.processes],
        }
        self.layout.state_file.write_text(json.dumps(state, indent=2))

    @classmethod
    def attach(cls, state_dir: Path, binaries: Binaries) -> DevCluster | None:
        """The cluster recorded in `state_dir`, or None if there is none."""
        layout = Layout(state_dir)
        try:
            state = json.loads(layout.state_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise ClusterError(f"{layout.state_file} is unreadable ({err}); delete "
                               f"{state_dir} after stopping its processes by hand") from err
        processes = [Process(p["name"], p["pid"], p["exe"]) for p in state["processes"]]
        pools = tuple(NodePool(**p) for p in state["pools"])
        return cls(layout, binaries, pools, processes, state["api_port"], detached=True)


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _established(crd: dict[str, Any]) -> bool:
    return any(c.get("type") == "Established" and c.get("status") == "True"
               for c in crd.get("status", {}).get("conditions") or [])


def _tls_ok(port: int, ca_cert: Path) -> bool:
    """Does a TLS server on 127.0.0.1:`port` answer with a certificate `ca_cert` signed?"""
    ctx = ssl.create_default_context(cafile=str(ca_cert))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1"):
            return True
    except (OSError, ssl.SSLError):
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except FileNotFoundError:
        return ""
