"""`tessera demo up|down`: the whole project on one machine, installed as a user would.

`up` (idempotent): a local control plane with simulated H200 pools, the Helm chart, the operator
running on this machine with the chart's ServiceAccount credentials, the examples applied and
followed to Ready; then the deployments, their capacity plans and their endpoints.
`down`: stops the operator (by its recorded pid) and the cluster, and removes their state.

No container image can run here (nothing is pulled, and the simulated nodes only pretend to
run pods), so the chart's operator Deployment is installed with 0 replicas and the same
operator code runs as a local process instead, authenticated as the chart's ServiceAccount.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tessera.devcluster.build import Binaries, cache_root
from tessera.devcluster.cli import default_state_dir
from tessera.devcluster.cluster import DevCluster

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "tessera-operator"
EXAMPLES = ROOT / "examples"

RELEASE = "tessera-operator"  # also the chart's object names and the leader-election Lease
OPERATOR_NAMESPACE = "tessera-system"
DEMO_NAMESPACE = "llm"
# Simulated H200 nodes (8 GPUs each) per pool: Kimi K2 takes 1 prefill + 2 decode nodes,
# GLM 5 1 prefill + 1 decode node (tensorParallel 8, one replica per node), Kimi K2 multi-node
# 2 prefill nodes (one TP-16 replica) + 1 decode node.
POOLS = {"prefill": 4, "decode": 4}
# The local operator's identity in the Lease (a pod's would be its name).
LOCAL_IDENTITY = "local-demo-operator"
TOKEN_DURATION = "24h"
RESYNC_SECONDS = 10
POLL_SECONDS = 2.0
HEARTBEAT_SECONDS = 15.0  # repeat the progress lines this often even when nothing changed
PVC_SCHEME = "pvc://"
SIMULATED_VOLUME_PREFIX = "tessera-demo-"
SIMULATED_VOLUME_SIZE = "2Ti"
CLAIM_BOUND_TIMEOUT_S = 60
OPERATOR_START_S = 60.0
STOP_GRACE_S = 10.0


class DemoError(RuntimeError):
    """A step failed; the message says which and how to fix it."""


@dataclass(frozen=True)
class Paths:
    cluster: Path  # the dev cluster's state (`tessera dev-cluster --state-dir`)
    demo: Path  # the operator's pid, log and kubeconfig

    @classmethod
    def of(cls, state_dir: Path | None) -> Paths:
        if state_dir is None:
            return cls(default_state_dir(), cache_root() / "state" / "demo")
        return cls(state_dir / "dev-cluster", state_dir / "demo")

    @property
    def pid(self) -> Path:
        return self.demo / "operator.pid"

    @property
    def log(self) -> Path:
        return self.demo / "operator.log"

    @property
    def metrics(self) -> Path:
        return self.demo / "operator-metrics-url"

    @property
    def kubeconfig(self) -> Path:
        return self.demo / "operator-kubeconfig.yaml"


def say(text: str) -> None:
    print(text, flush=True)


def step(text: str) -> None:
    say(f"\n== {text}")


def examples() -> list[Path]:
    found = sorted(EXAMPLES.glob("*/modeldeployment.yaml"))
    if not found or not CHART.is_dir():
        raise DemoError(f"examples/ or charts/ not found under {ROOT}: run the demo from a "
                        "checkout of tessera (pip install -e .)")
    return found


# -- the cluster --

def cluster_up(paths: Paths) -> DevCluster:
    argv = [sys.executable, "-m", "tessera", "dev-cluster", "--state-dir", str(paths.cluster),
            "up", *(f"--pool={name}={count}" for name, count in POOLS.items())]
    if subprocess.run(argv).returncode:
        raise DemoError("the dev cluster did not start (see above); `tessera demo down` "
                        "clears a broken one")
    cluster = DevCluster.attach(paths.cluster, Binaries.in_cache(cache_root()))
    if cluster is None or not cluster.running():
        raise DemoError(f"no running dev cluster in {paths.cluster} after `dev-cluster up`")
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    for pool, wanted in POOLS.items():
        have = sum(1 for n in nodes if n["metadata"]["labels"].get("tessera.dev/pool") == pool)
        if have < wanted:
            say(f"warning: the running dev cluster has {have} {pool} node(s), the examples "
                f"need {wanted}; `tessera demo down` and re-run for a cluster sized for them")
    return cluster


def run_tool(cluster: DevCluster, argv: list[str], what: str) -> str:
    result = subprocess.run(argv, env=cluster.env, capture_output=True, text=True, timeout=300)
    if result.returncode:
        raise DemoError(f"{what} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def install_chart(cluster: DevCluster) -> None:
    # Helm installs crds/ only on first install and never upgrades them; apply them first so a
    # re-run after a CRD change serves the new schema.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    out = run_tool(cluster, [
        str(cluster.binaries.helm), "upgrade", "--install", RELEASE, str(CHART),
        "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
        # No image can run here: the Deployment stays at 0 replicas (see the module docstring).
        "--set", "replicaCount=0", "--set", f"operator.resyncSeconds={RESYNC_SECONDS}",
        "--wait", "--timeout", "2m"], "helm upgrade --install")
    say(out.strip().splitlines()[0] if out.strip() else "helm: done")
    say(f"The chart's Deployment {OPERATOR_NAMESPACE}/{RELEASE} is installed with 0 replicas: "
        "no container image can be pulled or run on this machine (the simulated H200 nodes "
        "only pretend to run pods). The same operator runs below as a local process, with the "
        f"credentials of the chart's ServiceAccount {OPERATOR_NAMESPACE}/{RELEASE}.")


# -- the operator, as the chart's ServiceAccount --

def service_account_kubeconfig(cluster: DevCluster, token: str, namespace: str = OPERATOR_NAMESPACE,
                               name: str = RELEASE) -> dict[str, Any]:
    """The admin kubeconfig's cluster entry with ServiceAccount `namespace/name`'s token as the
    only user: a client using it can do exactly what that ServiceAccount may."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    context = next(ctx for ctx in admin["contexts"]
                   if ctx["name"] == admin["current-context"])["context"]
    entry = next(cl for cl in admin["clusters"] if cl["name"] == context["cluster"])
    user = f"system:serviceaccount:{namespace}:{name}"
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": name,
        "clusters": [entry],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": entry["name"], "user": user}}],
    }


def _alive_operator(pid_file: Path) -> int | None:
    """The pid in `pid_file` if that process is still our operator, else None."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if b"operator" in cmdline and b"run" in cmdline else None


def lease_holder(cluster: DevCluster) -> str:
    result = cluster.kubectl("get", "lease", RELEASE, "-n", OPERATOR_NAMESPACE, "-o",
                             "jsonpath={.spec.holderIdentity}", check=False)
    return result.stdout.strip() if result.returncode == 0 else ""


def start_operator(cluster: DevCluster, paths: Paths) -> None:
    if (pid := _alive_operator(paths.pid)) is not None:
        say(f"operator already running (pid {pid}, log {paths.log})")
        return
    paths.demo.mkdir(parents=True, exist_ok=True)
    token = cluster.kubectl("create", "token", RELEASE, "-n", OPERATOR_NAMESPACE,
                            f"--duration={TOKEN_DURATION}").stdout.strip()
    paths.kubeconfig.touch(mode=0o600)
    paths.kubeconfig.write_text(yaml.safe_dump(service_account_kubeconfig(cluster, token)))
    env = {**os.environ, "KUBECONFIG": str(paths.kubeconfig), "POD_NAME": LOCAL_IDENTITY}
    offset = paths.log.stat().st_size if paths.log.exists() else 0
    # The chart's own command line, with a free port for metrics (8080 may be taken here).
    port = free_port()
    argv = [f"--metrics-port={port}" if arg.startswith("--metrics-port=") else arg
            for arg in chart_operator_argv(cluster)]
    with paths.log.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True)  # outlives this command; `tessera demo down` stops it
    paths.pid.write_text(f"{proc.pid}\n")
    paths.metrics.write_text(f"http://127.0.0.1:{port}/metrics\n")
    deadline = time.monotonic() + OPERATOR_START_S
    while "operator started" not in paths.log.read_bytes()[offset:].decode(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = paths.log.read_bytes()[offset:].decode(errors="replace")[-3000:]
            raise DemoError(f"the operator did not start (log {paths.log}):\n{tail}")
        time.sleep(0.5)
    say(f"operator running as pid {proc.pid}, user system:serviceaccount:{OPERATOR_NAMESPACE}:"
        f"{RELEASE}, Lease holder {lease_holder(cluster)!r}; log {paths.log}")
    say(f"command line (the chart's): tessera {' '.join(argv[1:])}")


def chart_operator_argv(cluster: DevCluster) -> list[str]:
    """`tessera operator run ...` exactly as the installed chart's Deployment runs it."""
    deployment = json.loads(cluster.kubectl("get", "deployment", RELEASE, "-n",
                                            OPERATOR_NAMESPACE, "-o", "json").stdout)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return [*container["command"], *container["args"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the examples --

def weight_claims(manifest: dict[str, Any]) -> list[str]:
    """The PersistentVolumeClaims a ModelDeployment reads weights from (`pvc://CLAIM/path`)."""
    spec = manifest.get("spec", {})
    uris = [spec.get(phase, {}).get("weights", {}).get("uri", "")
            for phase in ("prefill", "decode", "single")]
    return sorted({uri.removeprefix(PVC_SCHEME).split("/", 1)[0]
                   for uri in uris if uri.startswith(PVC_SCHEME)})


def simulated_volume(claim: str, namespace: str) -> list[dict[str, Any]]:
    """A claim and a PersistentVolume bound to it. The volume points at an empty host path:
    kwok mounts nothing, so this only lets the scheduler place the pods that read the claim."""
    name = f"{SIMULATED_VOLUME_PREFIX}{namespace}-{claim}"
    common = {"accessModes": ["ReadOnlyMany"], "storageClassName": ""}
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "tessera-demo"}},
         "spec": {**common, "capacity": {"storage": SIMULATED_VOLUME_SIZE},
                  "persistentVolumeReclaimPolicy": "Retain",
                  "hostPath": {"path": f"/var/lib/tessera-demo/{claim}"},
                  "claimRef": {"namespace": namespace, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": claim, "namespace": namespace},
         "spec": {**common, "volumeName": name,
                  "resources": {"requests": {"storage": SIMULATED_VOLUME_SIZE}}}},
    ]


def apply_examples(cluster: DevCluster, files: list[Path]) -> None:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEMO_NAMESPACE}}
    cluster.kubectl("apply", "-f", "-", input=namespace)
    for f in files:
        for claim in weight_claims(yaml.safe_load(f.read_text())):
            objects = {"apiVersion": "v1", "kind": "List",
                       "items": simulated_volume(claim, DEMO_NAMESPACE)}
            cluster.kubectl("apply", "-f", "-", input=objects)
            # Bound before any pod asks for it: a pod the scheduler finds with an unbound claim
            # may wait for its periodic retry (minutes) instead of the binding event.
            cluster.kubectl("wait", "-n", DEMO_NAMESPACE, f"pvc/{claim}",
                            "--for=jsonpath={.status.phase}=Bound",
                            f"--timeout={CLAIM_BOUND_TIMEOUT_S}s")
            say(f"{f.relative_to(ROOT)} reads weights from the claim {claim!r}: applied it, "
                "bound to a simulated volume (nothing is downloaded or mounted here)")
    args = [arg for f in files for arg in ("-f", str(f))]
    say(cluster.kubectl("apply", "-n", DEMO_NAMESPACE, *args).stdout.rstrip())


def _ready(md: dict[str, Any]) -> dict[str, Any]:
    return next((cond for cond in md.get("status", {}).get("conditions", [])
                 if cond["type"] == "Ready"), {})


def progress_line(md: dict[str, Any]) -> str:
    status, ready = md.get("status", {}), _ready(md)
    state = ready.get("status", "Unknown")
    phases = status.get("summary", {}).get("replicas", "no status yet")
    router = status.get("router", {})
    if router:
        phases += f", router {router.get('readyReplicas', 0)}/{router.get('replicas', 0)}"
    line = f"{md['metadata']['name']:10} Ready={state:7} {phases}"
    if state != "True" and ready.get("message"):
        line += f"  ({ready.get('reason')}: {ready['message']})"
    return line


def wait_ready(cluster: DevCluster, names: list[str], timeout: float) -> bool:
    start, last, shown = time.monotonic(), "", 0.0
    while True:
        items = json.loads(cluster.kubectl("get", "modeldeployments", "-n", DEMO_NAMESPACE,
                                           "-o", "json").stdout)["items"]
        found = {md["metadata"]["name"]: md for md in items}
        lines = [progress_line(found[n]) if n in found else f"{n:10} not found" for n in names]
        text = "\n".join(lines)
        elapsed = time.monotonic() - start
        if text != last or elapsed - shown >= HEARTBEAT_SECONDS:
            say("\n".join(f"[{elapsed:5.1f} s] {line}" for line in lines))
            last, shown = text, elapsed
        if all(n in found and _ready(found[n]).get("status") == "True" for n in names):
            return True
        if elapsed > timeout:
            return False
        time.sleep(POLL_SECONDS)


def show_results(cluster: DevCluster, files: list[Path], names: list[str]) -> None:
    step(f"kubectl get modeldeployments -n {DEMO_NAMESPACE} -o wide")
    say(cluster.kubectl("get", "modeldeployments", "-n", DEMO_NAMESPACE, "-o", "wide")
        .stdout.rstrip())
    step(f"kubectl get deployments,pods -n {DEMO_NAMESPACE} -o wide")
    say(cluster.kubectl("get", "deployments,pods", "-n", DEMO_NAMESPACE, "-o", "wide")
        .stdout.rstrip())
    for f in files:
        step(f"tessera plan {f.relative_to(ROOT)}")
        plan = subprocess.run([sys.executable, "-m", "tessera", "plan", str(f)],
                              capture_output=True, text=True, timeout=120)
        say((plan.stdout + plan.stderr).rstrip())
    step("endpoints (OpenAI-compatible, served by each deployment's router)")
    for name in names:
        endpoint = cluster.kubectl("get", "modeldeployment", name, "-n", DEMO_NAMESPACE, "-o",
                                   "jsonpath={.status.endpoint}").stdout.strip()
        say(f"{name:10} {endpoint or '(none: not admitted)'}")


def _names(files: list[Path]) -> list[str]:
    return [yaml.safe_load(f.read_text())["metadata"]["name"] for f in files]


def up(args: argparse.Namespace) -> int:
    start = time.monotonic()
    paths, files = Paths.of(args.state_dir), examples()
    step("local control plane with simulated H200 pools")
    cluster = cluster_up(paths)
    say(cluster.kubectl("get", "nodes", "-L", "tessera.dev/pool,nvidia.com/gpu.product")
        .stdout.rstrip())
    step(f"helm upgrade --install {RELEASE} {CHART.relative_to(ROOT)} -n {OPERATOR_NAMESPACE}")
    install_chart(cluster)
    step("the operator, as the chart's ServiceAccount")
    start_operator(cluster, paths)
    step(f"kubectl apply -n {DEMO_NAMESPACE} " + " ".join(
        f"-f {f.relative_to(ROOT)}" for f in files))
    apply_examples(cluster, files)
    step("waiting for Ready (simulated nodes run pods without containers)")
    names = _names(files)
    ok = wait_ready(cluster, names, args.timeout)
    show_results(cluster, files, names)
    elapsed = time.monotonic() - start
    step(f"{'done' if ok else 'NOT READY'} in {elapsed:.0f} s")
    where = f" --state-dir {paths.cluster}" if args.state_dir else ""
    say(f'Use the cluster:  eval "$(tessera dev-cluster{where} env)"; '
        f"kubectl get md -n {DEMO_NAMESPACE}")
    say(f"Operator log:     {paths.log}")
    if paths.metrics.exists():
        say(f"Its metrics:      curl {paths.metrics.read_text().strip()}")
    say("Clean up:         tessera demo down" + (
        f" --state-dir {args.state_dir}" if args.state_dir else ""))
    if not ok:
        warnings = cluster.kubectl("get", "events", "-n", DEMO_NAMESPACE, "--field-selector",
                                   "type=Warning", check=False).stdout.rstrip()
        say(f"\nWarning events in {DEMO_NAMESPACE}:\n{warnings or '(none)'}")
        say(f"error: not every deployment was Ready after {args.timeout:.0f} s; "
            f"`kubectl describe md -n {DEMO_NAMESPACE}` and the operator log say why")
    return 0 if ok else 1


def stop_operator(paths: Paths) -> None:
    pid = _alive_operator(paths.pid)
    if pid is None:
        say("operator: not running")
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while _alive_operator(paths.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive_operator(paths.pid) is not None:
        os.kill(pid, signal.SIGKILL)
    say(f"operator: stopped (pid {pid})")


def down(args: argparse.Namespace) -> int:
    paths = Paths.of(args.state_dir)
    stop_operator(paths)
    result = subprocess.run([sys.executable, "-m", "tessera", "dev-cluster", "--state-dir",
                             str(paths.cluster), "down"])
    shutil.rmtree(paths.demo, ignore_errors=True)
    say(f"removed {paths.demo}")
    return result.returncode


def run(args: argparse.Namespace) -> int:
    try:
        return int(args.action(args))
    except DemoError as err:
        print(f"tessera demo: {err}", file=sys.stderr)
        return 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo", help="the whole project on one machine: cluster, chart, operator, examples")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="keep the demo's cluster and operator state here "
                             "(default: the dev cluster's default state and "
                             "$TESSERA_CACHE/state/demo)")
    actions = parser.add_subparsers(dest="demo_action", required=True, metavar="ACTION")
    up_parser = actions.add_parser("up", help="bring everything up and wait for Ready "
                                              "(idempotent)")
    up_parser.add_argument("--timeout", type=float, default=300.0,
                           help="seconds to wait for every example to be Ready (default 300)")
    up_parser.set_defaults(action=up)
    actions.add_parser("down", help="stop the operator and the cluster; remove their state") \
        .set_defaults(action=down)
    parser.set_defaults(func=run)
