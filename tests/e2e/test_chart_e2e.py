"""The Helm chart against the real local API server.

- `helm template` output is accepted by a server-side dry run (and a broken value is not);
- the operator's pod template passes the `restricted` Pod Security Standard, enforced by the
  API server's own admission (and a pod without the chart's security context does not);
- the operator, running locally with nothing but the chart's ServiceAccount token, reconciles
  an example to Ready; the audit log shows it was never refused and used every resource the
  chart grants.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tessera.operator import constants as c
from tessera.operator.leader import LEASE_SECONDS, RENEW_SECONDS

from tessera.demo import service_account_kubeconfig

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tessera-operator"
EXAMPLE = ROOT / "examples" / "01-kimi-k2" / "modeldeployment.yaml"
RELEASE = "tessera-operator-e2e"  # contains the chart name, so every object is named this
IDENTITY = "e2e-local-operator"
READY_TIMEOUT_S = 120.0
RESYNC_S = 2.0


def poll(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.3)
    return value


def helm(cluster: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(cluster.binaries.helm), *args], env=cluster.env,
                            capture_output=True, text=True, timeout=180)
    if check and result.returncode:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def template(cluster: Any, namespace: str, *sets: str) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace, "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return helm(cluster, *args).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_dry_run(cluster: Any, manifests: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server",
                           "--field-manager=chart-e2e", "-f", "-", input=manifests, check=False)


def test_helm_template_passes_server_side_dry_run(cluster: Any, namespace: str) -> None:
    manifests = template(cluster, namespace, "metrics.enabled=true")
    kinds = [d["kind"] for d in yaml.safe_load_all(manifests) if d]
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
            "Role", "RoleBinding", "Deployment", "Service"} <= set(kinds)
    result = server_dry_run(cluster, manifests)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == len(kinds), result.stdout


def test_server_dry_run_refuses_a_broken_value(cluster: Any, namespace: str) -> None:
    # The check above means something: the API server judges what the chart renders.
    result = server_dry_run(cluster, template(cluster, namespace, "resources.limits.memory=lots"))
    assert result.returncode != 0 and "quantities must match" in result.stderr


def _operator_pod(cluster: Any, namespace: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(template(cluster, namespace)) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "operator-pod-security", "namespace": namespace},
            "spec": {**deployment["spec"]["template"]["spec"], "serviceAccountName": "default"}}


def test_operator_pod_passes_restricted_pod_security(cluster: Any, namespace: str) -> None:
    cluster.kubectl("label", "namespace", namespace,
                    "pod-security.kubernetes.io/enforce=restricted")
    pod = _operator_pod(cluster, namespace)
    accepted = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=pod, check=False)
    assert accepted.returncode == 0, accepted.stderr
    # The same pod without the chart's security settings is refused by the same admission.
    del pod["spec"]["securityContext"]
    del pod["spec"]["containers"][0]["securityContext"]
    refused = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=pod, check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr


# -- the operator with the chart's ServiceAccount --

class LocalOperator:
    """`tessera operator run` as a local process holding nothing but a token of the chart's
    ServiceAccount, like one replica of the chart's Deployment."""

    def __init__(self, installed: Installed, identity: str, *extra: str) -> None:
        self.installed, self.identity, self.extra = installed, identity, extra
        self.log = installed.work / f"{identity}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> None:
        inst = self.installed
        token = inst.cluster.kubectl("create", "token", RELEASE, "-n", inst.namespace,
                                     "--duration=1h").stdout.strip()
        kubeconfig = inst.work / f"{self.identity}.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(
            service_account_kubeconfig(inst.cluster, token, inst.namespace, RELEASE)))
        # Only this kubeconfig: no admin credentials reach the operator.
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": self.identity}
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        # The installed Deployment's own command line; each local replica gets a free metrics
        # port, as each pod has its own address.
        self.metrics_port = free_port()
        args = [f"--metrics-port={self.metrics_port}" if a.startswith("--metrics-port=") else a
                for a in inst.operator_argv()]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", *args, *self.extra],
                                         env=env, stdout=out, stderr=subprocess.STDOUT)
        if wait:
            self.wait_started()

    def started(self) -> bool:
        return "operator started" in self.text()

    def wait_started(self, timeout: float = 60.0) -> None:
        proc = self.proc
        assert proc is not None
        poll(f"operator {self.identity} to start",
             lambda: self.started() or proc.poll() is not None, timeout)
        assert proc.poll() is None, self.text()[-3000:]

    def text(self) -> str:
        return self.log.read_bytes()[self.offset:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Installed:
    """The chart installed in its own namespace, and its first local operator."""

    def __init__(self, cluster: Any, namespace: str, work: Path) -> None:
        self.cluster, self.namespace, self.work = cluster, namespace, work
        self.user = f"system:serviceaccount:{namespace}:{RELEASE}"
        self.audit_from = os.path.getsize(cluster.audit_log)
        self.operators: list[LocalOperator] = []

    def operator(self, identity: str, *extra: str, wait: bool = True) -> LocalOperator:
        op = LocalOperator(self, identity, *extra)
        self.operators.append(op)
        op.start(wait)
        return op

    def operator_argv(self) -> list[str]:
        """`tessera operator run ...` exactly as the chart's Deployment runs it."""
        deployment = json.loads(self.cluster.kubectl(
            "get", "deployment", RELEASE, "-n", self.namespace, "-o", "json").stdout)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return [*container["command"], *container["args"]]

    def lease_holder(self) -> str:
        return str(self.cluster.kubectl("get", "lease", RELEASE, "-n", self.namespace, "-o",
                                        "jsonpath={.spec.holderIdentity}").stdout)

    def stop(self) -> None:
        for op in self.operators:
            op.stop()


@pytest.fixture(scope="module")
def installed(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    release_ns = f"tessera-chart-e2e-{os.getpid()}"
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", release_ns,
         "--create-namespace", "--set", "replicaCount=0",
         "--set", f"operator.resyncSeconds={RESYNC_S:g}", "--wait", "--timeout", "2m")
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/modeldeployments.tessera.dev")
    installed = Installed(cluster, release_ns, tmp_path_factory.mktemp("chart"))
    try:
        installed.operator(IDENTITY)
        yield installed
    finally:
        installed.stop()
        helm(cluster, "uninstall", RELEASE, "--namespace", release_ns, check=False)
        cluster.kubectl("delete", "namespace", release_ns, "--wait=false", check=False)


def _audit(installed: Installed) -> list[dict[str, Any]]:
    with open(installed.cluster.audit_log, "rb") as f:
        f.seek(installed.audit_from)
        entries = [json.loads(line) for line in f]
    return [e for e in entries if e.get("stage") == "ResponseComplete"
            and e.get("user", {}).get("username") == installed.user]


def test_operator_as_the_charts_service_account_reconciles_an_example(
        installed: Installed, namespace: str) -> None:
    cluster = installed.cluster
    # Leases: get and create/update in the release namespace were enough to lead.
    assert installed.lease_holder() == IDENTITY
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    result = cluster.kubectl("wait", f"md/{name}", "-n", namespace, "--for=condition=Ready",
                             f"--timeout={READY_TIMEOUT_S:.0f}s", check=False)
    assert result.returncode == 0, (
        cluster.kubectl("get", "md", name, "-n", namespace, "-o", "yaml").stdout
        + installed.operators[0].text()[-4000:])
    status = json.loads(cluster.kubectl("get", "md", name, "-n", namespace, "-o",
                                        "json").stdout)["status"]
    assert status["endpoint"] == f"http://{name}-router.{namespace}.svc:8000/v1"

    requests = _audit(installed)
    assert requests, "no request of the operator's ServiceAccount in the audit log"
    # A namespace being deleted (an earlier test's) refuses new objects with 403 too; that is
    # not RBAC, and the operator cluster-wide may still be reconciling what was in it.
    refused = [(e["verb"], e.get("objectRef"), e["responseStatus"].get("code"))
               for e in requests if e["responseStatus"].get("code") == 403
               and "being terminated" not in e["responseStatus"].get("message", "")]
    assert not refused, f"the chart's RBAC refused the operator: {refused}"
    # The metrics the chart's Service scrapes, from the replica that did the work.
    leader = installed.operators[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{leader.metrics_port}/metrics",
                                timeout=10) as response:
        metrics = response.read().decode()
    applies = [line for line in metrics.splitlines()
               if line.startswith('tessera_operator_writes_total{action="apply"}')]
    assert applies and float(applies[0].split()[-1]) > 0, metrics[:2000]
    # The per-deployment gauges the chart's dashboard and alerts read, from what it reconciled.
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line.startswith("tessera_modeldeployment_")}
    labels = f'deployment="{name}",namespace="{namespace}",phase="decode"'
    desired = samples[f"tessera_modeldeployment_replicas{{{labels}}}"]
    assert desired > 0 and samples[f"tessera_modeldeployment_ready_replicas{{{labels}}}"] == desired
    assert samples[f'tessera_modeldeployment_condition{{deployment="{name}",namespace="{namespace}"'
                   ',reason="AllReady",status="True",type="Ready"}'] == 1

    # The ServiceAccount cannot do what the operator never needs.
    for verb, resource in (("get", "secrets"), ("create", "pods"), ("delete", "nodes"),
                           ("patch", "modeldeployments.tessera.dev")):
        can = cluster.kubectl("auth", "can-i", verb, resource, "-A",
                              f"--as={installed.user}", check=False)
        assert can.stdout.strip() == "no", f"{installed.user} may {verb} {resource}"

    # Minimality at the resource level: every (group, resource) the chart grants shows up in
    # the operator's own requests, except two whose use shows elsewhere.
    used = set()
    for e in requests:
        ref = e.get("objectRef", {})
        resource = ref.get("resource", "") + (f"/{ref['subresource']}"
                                              if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource))
    granted = {(group, resource) for group, resource, _ in c.RBAC_RULES}
    # Leases are not audited (kwok's node heartbeats); the Lease holder above shows their use.
    # Pods are only granted onward: the API server let the operator create the router's Role
    # with pods get/list/watch only because the operator holds them itself.
    router_role = json.loads(cluster.kubectl("get", "role", f"{name}-router", "-n", namespace,
                                             "-o", "json").stdout)
    assert any("pods" in rule["resources"] for rule in router_role["rules"])
    # kopf lists and watches namespaces only when told which to serve (`--namespace`, e.g.
    # through the chart's operator.extraArgs); run it that way once, with a glob.
    installed.stop()
    installed.operator(IDENTITY, f"--namespace={namespace[:2]}*")
    poll("the operator to list namespaces", lambda: any(
        e.get("objectRef", {}).get("resource") == "namespaces" for e in _audit(installed)),
        timeout=30)
    used.add(("", "namespaces"))
    unused = granted - used - {("coordination.k8s.io", "leases"), ("", "pods")}
    assert not unused, f"granted but never requested by the operator: {sorted(unused)}"


def test_two_replicas_one_acts_and_the_other_takes_over(installed: Installed) -> None:
    """The chart's two-replica Deployment, as two local processes with its ServiceAccount:
    the second waits while the first holds the Lease, and takes over when the first stops."""
    first = next(op for op in reversed(installed.operators) if op.proc and op.proc.poll() is None)
    second = installed.operator("e2e-second-replica", wait=False)
    poll("the second replica to wait for the Lease", lambda: "waiting for leadership"
         in second.text(), timeout=30)
    time.sleep(RENEW_SECONDS * 2)  # several of its attempts to take the Lease fail
    assert not second.started() and installed.lease_holder() == first.identity
    first.stop()
    second.wait_started(timeout=LEASE_SECONDS + 3 * RENEW_SECONDS + 15)
    assert installed.lease_holder() == "e2e-second-replica"
