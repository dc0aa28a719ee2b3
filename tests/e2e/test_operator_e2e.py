"""The operator against the real local control plane, driven through kubectl as a user would.

One operator process serves the whole module (cluster-wide, resync every RESYNC_S seconds);
each test works in its own namespace. Write counts come from the API server's audit log,
filtered to the operator's user agents (its client: tessera-operator; kopf's watches: kopf/).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tessera.operator import constants as c
from tessera.operator.kube import CHILD_KINDS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RESYNC_S = 2.0
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
ENGINE_PHASES = ("prefill", "decode")


def poll(what: str, check: Callable[[], Any], timeout: float = 60.0,
         seen: Callable[[], Any] | None = None) -> Any:
    """check()'s first truthy value; fails naming `what` after `timeout` seconds, and what
    `seen()` shows then (the state the wait was for)."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            last = f"; last seen: {seen()}" if seen else ""
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{last}")
        time.sleep(0.3)
    return value


class Operator:
    """`tessera operator run` as a child process, logging to a file."""

    command: tuple[str, ...] = (sys.executable, "-m", "tessera")

    def __init__(self, env: dict[str, str], log: Path, *extra: str) -> None:
        self.env, self.log, self.extra = env, log, extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_url = ""

    def metric(self, name: str) -> float:
        """The sum of a counter's samples on the metrics endpoint."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def start(self, ready_line: str = "operator started") -> None:
        """Launch, and wait until the log says `ready_line` (after this launch)."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*self.command, "operator", "run",
                 "--resync-seconds", str(RESYNC_S), *self.extra],
                env=self.env, stdout=out, stderr=subprocess.STDOUT)
        proc = self.proc
        poll(f"the operator log to say {ready_line!r}",
             lambda: ready_line in self.text(offset) or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, self.text(offset)[-3000:]

    def text(self, offset: int = 0) -> str:
        return self.log.read_bytes()[offset:].decode(errors="replace")

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def operator(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    cluster.kubectl("apply", "-f", str(ROOT / "crds" / "modeldeployment.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/modeldeployments.tessera.dev")
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with socket.socket() as probe:  # a free port for the metrics endpoint
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # A stranded LWS group restarts after 10 s instead of 2 minutes (test_multinode_e2e.py).
    op = Operator(cluster.env, log, "--metrics-port", str(port), "--stranded-group-seconds", "10")
    op.metrics_url = f"http://127.0.0.1:{port}/metrics"
    op.start()
    yield op
    op.stop()


def operator_writes(cluster: Any, since: int, namespace: str | None = None) -> list[dict[str, Any]]:
    """Write requests the operator made after byte offset `since` of the audit log."""
    out = []
    with open(cluster.audit_log, "rb") as f:
        f.seek(since)
        for line in f:
            entry = json.loads(line)
            agent = entry.get("userAgent", "")
            ref = entry.get("objectRef", {})
            if (entry.get("stage") == "ResponseComplete" and entry["verb"] in WRITE_VERBS
                    and (agent.startswith("tessera-operator") or agent.startswith("kopf/"))
                    and (namespace is None or ref.get("namespace") == namespace)):
                out.append(entry)
    return out


def summary(writes: list[dict[str, Any]]) -> list[str]:
    """One line per write, for assertion messages."""
    return [f"{w['verb']} {w['objectRef'].get('resource')} {w['objectRef'].get('namespace')}/"
            f"{w['objectRef'].get('name')} -> {w.get('responseStatus', {}).get('code')}"
            for w in writes]


def audit_offset(cluster: Any) -> int:
    return os.path.getsize(cluster.audit_log)


def tiny(name: str) -> dict[str, Any]:
    """A small DeepSeek V3-shaped model at tensor parallel 1: fits one GPU, plans in ms."""
    phase = {"tensorParallel": 1, "kvCache": {"dtype": "fp8_e4m3"}}
    return {
        "apiVersion": "tessera.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "contextLength": 8192, "architecture": {
                "preset": "deepseek-v3",
                "config": {"num_hidden_layers": 4, "n_routed_experts": 16}}},
            "engine": {"image": "tessera/runtime:test"},
            "nodePool": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
            "prefill": {**copy.deepcopy(phase), "weights": {"dtype": "fp8", "uri": "hf://t/fp8"}},
            "decode": {**copy.deepcopy(phase), "replicas": 2,
                       "weights": {"dtype": "int4", "uri": "hf://t/int4"}},
            "integrity": {"enabled": True},
        },
    }


# A small dense GQA model: the handover converts MLA latents only, so its KV dtypes must match.
TINY_GQA = {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 512, "tie_word_embeddings": True}


def get_md(kubectl: Callable[..., Any], namespace: str, name: str) -> dict[str, Any]:
    return json.loads(kubectl("get", "md", name, "-n", namespace, "-o", "json").stdout)


def conditions(md: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {x["type"]: x for x in md.get("status", {}).get("conditions", [])}


def children(kubectl: Callable[..., Any], namespace: str, name: str) -> list[tuple[str, str]]:
    kinds = ",".join(CHILD_KINDS.values())
    items = json.loads(kubectl("get", kinds, "-n", namespace, "-l",
                               f"{c.LABEL_DEPLOYMENT}={name}", "-o", "json").stdout)["items"]
    return sorted((o["kind"], o["metadata"]["name"]) for o in items)


def pod_uids(kubectl: Callable[..., Any], namespace: str, phase: str) -> set[str]:
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-l", f"{c.LABEL_PHASE}={phase}",
                              "-o", "json").stdout)["items"]
    return {p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}


def wait_ready(kubectl: Callable[..., Any], namespace: str, name: str,
               timeout: int = 90) -> None:
    """Fails, on timeout, with what held Ready back: the deployment's conditions, and the
    namespace's Jobs and pods that are not done, with the scheduler's word on each pod."""
    waited = kubectl("wait", "--for=condition=Ready", f"modeldeployment/{name}", "-n",
                     namespace, f"--timeout={timeout}s", check=False, timeout=timeout + 10)
    if waited.returncode != 0:
        pytest.fail(f"{name} not Ready after {timeout} s: {waited.stderr.strip()}\n"
                    + "\n".join(not_ready(kubectl, namespace, name)))


def not_ready(kubectl: Callable[..., Any], namespace: str, name: str) -> list[str]:
    """One line per condition of `name` and per Job or pod of `namespace` not done."""
    lines = [f"{t}={x['status']} {x.get('reason', '')}: {x.get('message', '')}"
             for t, x in conditions(get_md(kubectl, namespace, name)).items()]
    items = json.loads(kubectl("get", "jobs,pods", "-n", namespace, "-o", "json").stdout)["items"]
    for o in items:
        st = o.get("status", {})
        done = {x["type"] for x in st.get("conditions", []) if x.get("status") == "True"}
        if done & {"Complete", "Ready"} or st.get("phase") == "Succeeded":
            continue
        said = "; ".join(f"{x['type']}={x['status']} {x.get('reason', '')} {x.get('message', '')}"
                         for x in st.get("conditions", []))
        lines.append(f"{o['kind']} {o['metadata']['name']} {st.get('phase', '')}: {said}")
    return lines


def apply(kubectl: Callable[..., Any], namespace: str, manifest: dict[str, Any]) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=manifest)


def test_example_applies_converges_and_reports(operator: Operator, kubectl: Any,
                                               namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples/01-kimi-k2/modeldeployment.yaml"))
    poll("all 18 children", lambda: len(children(kubectl, namespace, "kimi-k2")) == 18)
    wait_ready(kubectl, namespace, "kimi-k2")

    row = kubectl("get", "md", "kimi-k2", "-n", namespace).stdout
    assert "prefill 1/1, decode 2/2" in row
    assert "prefill=bf16 decode=fp8_e4m3" in row  # each phase its own KV dtype
    wide = kubectl("get", "md", "kimi-k2", "-n", namespace, "-o", "wide").stdout
    assert "prefill=fp8 decode=int4" in wide and f"kimi-k2-router.{namespace}.svc:8000" in wide

    md = get_md(kubectl, namespace, "kimi-k2")
    assert md["status"]["observedGeneration"] == md["metadata"]["generation"]
    got = {t: cond["status"] for t, cond in conditions(md).items()}
    assert got == {"Ready": "True", "Progressing": "False", "Degraded": "False",
                   "PrecisionValid": "True", "CapacityPlanned": "True", "KVIntegrity": "True"}
    assert md["status"]["decode"]["precision"] == {"weights": "int4", "kvCache": "fp8_e4m3"}
    assert md["status"]["plan"]["decode"]["capacity"]["kvTokensPerReplica"] > 0

    described = kubectl("describe", "md", "kimi-k2", "-n", namespace).stdout
    assert "Conditions:" in described and "AllReady" in described
    events = json.loads(kubectl("get", "events", "-n", namespace, "--field-selector",
                                "involvedObject.kind=ModelDeployment", "-o", "json").stdout)
    reasons = [e["reason"] for e in events["items"]]
    assert "AllReady" in reasons  # posted when Ready turned True
    # One event per condition change, not one per reconcile: in creation order (etcd's
    # resourceVersion), no condition repeats its status and reason in two events running. (A
    # busy shared cluster can leave the pods Unschedulable for a moment, even twice, and
    # Ready and Degraded then share that reason.) test_resync_with_nothing_changed_writes_nothing
    # checks that a converged deployment posts none at all.
    by_condition: dict[str, list[str]] = {}
    for e in sorted(events["items"], key=lambda e: int(e["metadata"]["resourceVersion"])):
        condition, _, rest = e["message"].partition(" is ")
        by_condition.setdefault(condition, []).append(f"{rest.partition(':')[0]} {e['reason']}")
    for condition, changes in by_condition.items():
        assert all(a != b for a, b in zip(changes, changes[1:], strict=False)), (condition,
                                                                                 changes)

    # Every pod is labelled with its deployment and phase, and gets a whole H200 node.
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    engine = [p for p in pods if p["metadata"]["labels"][c.LABEL_PHASE] in ENGINE_PHASES]
    assert len(engine) == 3
    for pod in engine:
        assert pod["metadata"]["labels"][c.LABEL_DEPLOYMENT] == "kimi-k2"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    kubectl("delete", "md", "kimi-k2", "-n", namespace, "--wait=false")


def test_decode_change_rolls_only_decode_pods(operator: Operator, kubectl: Any,
                                              namespace: str) -> None:
    apply(kubectl, namespace, tiny("roll"))
    wait_ready(kubectl, namespace, "roll")
    prefill, decode = (pod_uids(kubectl, namespace, p) for p in ENGINE_PHASES)
    assert len(prefill) == 1 and len(decode) == 2

    # New decode weights and a new decode KV dtype (FP8 -> BF16): the FP8 prefill converts
    # for the new decode pods, so nothing about the prefill changes.
    changed = tiny("roll")
    changed["spec"]["decode"]["weights"]["groupSize"] = 32
    changed["spec"]["decode"]["kvCache"]["dtype"] = "bf16"
    apply(kubectl, namespace, changed)
    serving: list[tuple[int, int]] = []  # ready (prefill, decode) pods at each look

    def ready_pods(phase: str) -> int:
        deployment = json.loads(kubectl("get", "deployment", f"roll-{phase}", "-n", namespace,
                                        "-o", "json").stdout)
        return int(deployment.get("status", {}).get("readyReplicas", 0))

    def rolled() -> bool:
        md = get_md(kubectl, namespace, "roll")
        serving.append((ready_pods("prefill"), ready_pods("decode")))
        new = pod_uids(kubectl, namespace, "decode")
        return (md["status"]["observedGeneration"] == 2 and len(new) == 2
                and not new & decode and conditions(md)["Ready"]["status"] == "True")

    poll("decode pods replaced and Ready", rolled, timeout=90)
    md = get_md(kubectl, namespace, "roll")
    assert pod_uids(kubectl, namespace, "prefill") == prefill
    # Both pools kept serving while the decode pool rolled: the decode Deployment replaces one
    # pod at a time (maxUnavailable 1, maxSurge 0: no spare GPU node is assumed), so at least
    # one of its two pods was ready at every look. Ready itself is False while any replica is
    # not yet updated: that is the operator's definition of Ready.
    assert all(p >= 1 and d >= 1 for p, d in serving), serving
    assert md["status"]["decode"]["precision"]["kvCache"] == "bf16"
    assert md["status"]["prefill"]["precision"]["kvCache"] == "fp8_e4m3"


def test_kv_dtype_pair_the_transfer_cannot_carry_is_refused_in_place(
        operator: Operator, kubectl: Any, namespace: str) -> None:
    gqa = tiny("pair")
    gqa["spec"]["model"]["architecture"] = {"config": TINY_GQA}
    apply(kubectl, namespace, gqa)
    wait_ready(kubectl, namespace, "pair")
    before = {p: pod_uids(kubectl, namespace, p) for p in ENGINE_PHASES}
    bad = copy.deepcopy(gqa)
    bad["spec"]["decode"]["kvCache"]["dtype"] = "bf16"
    apply(kubectl, namespace, bad)
    md = poll("PrecisionValid False", lambda: (m := get_md(kubectl, namespace, "pair"))
              and conditions(m)["PrecisionValid"]["status"] == "False" and m)
    assert conditions(md)["PrecisionValid"]["reason"] == "KVCacheDtypeMismatch"
    # A bad edit does not take the running model down, and rolls nothing.
    time.sleep(2 * RESYNC_S)
    assert {p: pod_uids(kubectl, namespace, p) for p in ENGINE_PHASES} == before


@pytest.mark.parametrize("edit, condition, reason", [
    (lambda s: (s["model"].update(architecture={"config": TINY_GQA}),
                s["prefill"]["kvCache"].update(dtype="bf16")), "PrecisionValid",
     "KVCacheDtypeMismatch"),
    (lambda s: s["model"]["architecture"].update(preset="kimi-k2", config={}), "CapacityPlanned",
     "InsufficientGPUMemory"),
    (lambda s: (s["model"].update(architecture={"config": TINY_GQA}),
                s["decode"].update(kernels={"decodeAttention": "flashmla"})), "PrecisionValid",
     "DecodeAttentionUnsupported"),
], ids=["kv-pair", "does-not-fit", "flashmla-on-gqa"])
def test_specs_only_the_operator_can_judge(operator: Operator, kubectl: Any, namespace: str,
                                           cluster: Any, edit: Any, condition: str,
                                           reason: str) -> None:
    manifest = tiny("judged")
    edit(manifest["spec"])
    apply(kubectl, namespace, manifest)
    md = poll(f"{condition} False", lambda: (m := get_md(kubectl, namespace, "judged"))
              and conditions(m).get(condition, {}).get("status") == "False" and m)
    assert conditions(md)[condition]["reason"] == reason
    assert conditions(md)["Ready"]["reason"] == "NotAdmitted"
    # No children, and no retry storm: once the reconcile that wrote status has posted its
    # events, three resyncs later there is not one more write.
    time.sleep(1.0)
    since = audit_offset(cluster)
    time.sleep(3 * RESYNC_S + 0.5)
    assert children(kubectl, namespace, "judged") == []
    assert summary(operator_writes(cluster, since, namespace)) == []
    assert operator.proc is not None and operator.proc.poll() is None


def test_resync_with_nothing_changed_writes_nothing(operator: Operator, kubectl: Any,
                                                    namespace: str, cluster: Any) -> None:
    # Earlier modules' namespaces may still be terminating, their deployments' finalizers left
    # for this operator to remove: those are writes too. Let them finish first, so that "no
    # writes in any namespace" below speaks of converged deployments only.
    poll("no namespace left terminating", lambda: "Terminating" not in kubectl(
        "get", "namespaces", "--no-headers").stdout, timeout=120,
         seen=lambda: kubectl("get", "namespaces,pods", "-A", "--no-headers", "-o",
                              "wide").stdout)
    since = audit_offset(cluster)
    apply(kubectl, namespace, tiny("quiet"))
    wait_ready(kubectl, namespace, "quiet")
    # The counter sees the operator's writes (18 children, status, events) ...
    converging = operator_writes(cluster, since, namespace)
    assert len([w for w in converging if w["verb"] == "patch"]) >= 18
    # ... and, once converged, several resyncs later there are none at all (any namespace).
    time.sleep(1.0)
    log_at, since = len(operator.text()), audit_offset(cluster)
    counted = operator.metric("tessera_operator_writes_total")
    reconciles = operator.metric("tessera_operator_reconciles_total")
    time.sleep(3 * RESYNC_S + 0.5)
    assert operator.text()[log_at:].count("resync:") >= 2  # resyncs did run
    assert summary(operator_writes(cluster, since)) == []
    # The operator's own counters agree: it reconciled, and wrote nothing.
    assert operator.metric("tessera_operator_reconciles_total") > reconciles
    assert operator.metric("tessera_operator_writes_total") == counted


def test_drift_is_restored_and_foreign_fields_are_kept(operator: Operator, kubectl: Any,
                                                       namespace: str) -> None:
    apply(kubectl, namespace, tiny("drift"))
    wait_ready(kubectl, namespace, "drift")
    kubectl("scale", "deployment/drift-decode", "--replicas=5", "-n", namespace)
    kubectl("delete", "service", "drift-router", "-n", namespace)
    kubectl("annotate", "deployment/drift-prefill", "team.example.com/owner=infra",
            "-n", namespace)

    def replicas() -> int:
        return json.loads(kubectl("get", "deployment", "drift-decode", "-n", namespace, "-o",
                                  "json").stdout)["spec"]["replicas"]

    poll("decode replicas restored to 2", lambda: replicas() == 2)
    poll("router service recreated", lambda: kubectl("get", "service", "drift-router", "-n",
                                                     namespace, check=False).returncode == 0)
    prefill = json.loads(kubectl("get", "deployment", "drift-prefill", "-n", namespace,
                                 "-o", "json").stdout)
    assert prefill["metadata"]["annotations"]["team.example.com/owner"] == "infra"


def test_runtime_mismatch_events_set_kv_integrity(operator: Operator, kubectl: Any,
                                                  namespace: str) -> None:
    apply(kubectl, namespace, tiny("tags"))
    wait_ready(kubectl, namespace, "tags")
    pod = json.loads(kubectl("get", "pods", "-n", namespace, "-l", f"{c.LABEL_PHASE}=decode",
                             "-o", "json").stdout)["items"][0]["metadata"]
    # What the runtime posts (the contract with the integrity check).
    kubectl("create", "-f", "-", input={
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": "tags-kv-", "namespace": namespace,
                     "labels": {c.LABEL_DEPLOYMENT: "tags"}},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod["name"],
                           "namespace": namespace, "uid": pod["uid"]},
        "type": "Warning", "reason": c.EVENT_REASON_KV_MISMATCH, "count": 3,
        "message": "3 requests aborted: KV pages reallocated under them",
        "source": {"component": "tessera-runtime"}})
    md = poll("KVIntegrity False", lambda: (m := get_md(kubectl, namespace, "tags"))
              and conditions(m)["KVIntegrity"]["status"] == "False" and m)
    message = conditions(md)["KVIntegrity"]["message"]
    assert "3 mismatch report(s)" in message and pod["name"] in message


def test_deletion_garbage_collects_every_child(operator: Operator, kubectl: Any,
                                               namespace: str) -> None:
    apply(kubectl, namespace, tiny("gone"))
    poll("children", lambda: len(children(kubectl, namespace, "gone")) == 18)
    kubectl("delete", "md", "gone", "-n", namespace)
    poll("children garbage-collected", lambda: children(kubectl, namespace, "gone") == [],
         timeout=60)


def test_killed_mid_reconcile_converges_without_duplicates(operator: Operator, kubectl: Any,
                                                           namespace: str) -> None:
    operator.stop()
    operator.start()
    apply(kubectl, namespace, tiny("crash"))
    # Kill it as soon as the first child lands, while the rest are still being applied.
    poll("a first child", lambda: children(kubectl, namespace, "crash"), timeout=30)
    operator.kill()
    partial = children(kubectl, namespace, "crash")
    operator.start()
    wait_ready(kubectl, namespace, "crash")
    final = children(kubectl, namespace, "crash")
    assert len(final) == 18 and len(set(final)) == 18 and set(partial) <= set(final)
    for phase, want in (("prefill", 1), ("decode", 2), ("router", 1)):
        assert len(pod_uids(kubectl, namespace, phase)) == want, phase
    replicasets = json.loads(kubectl("get", "replicasets", "-n", namespace, "-o",
                                     "json").stdout)["items"]
    assert len(replicasets) == 3  # one per Deployment: nothing was re-created with a new template



def claim(name: str, namespace: str, path: str) -> list[dict[str, Any]]:
    """A claim and a hostPath PersistentVolume bound to it in advance."""
    return [{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": namespace},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                      "storageClassName": "", "hostPath": {"path": path},
                      "claimRef": {"namespace": namespace, "name": name}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
             "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "",
                      "volumeName": namespace, "resources": {"requests": {"storage": "1Gi"}}}}]


def test_weights_are_converted_by_a_job_before_decode_rolls_out(
        operator: Operator, kubectl: Any, namespace: str, tmp_path: Path) -> None:
    """What is simulated: the Job's pod. It cannot be scheduled until its claim exists; once it
    does, kwok v0.7.0's default stages mark it Running and, being owned by a Job, Succeeded
    (no container runs), and the real Job controller marks the Job Complete. The conversion
    the pod stands for is run here, with the Job's own commands, on a synthetic checkpoint."""
    from tessera.runtime.quantize.synthetic import TINY_CONFIGS, write_checkpoint

    md = tiny("conv")
    md["spec"]["decode"]["weights"] = {"dtype": "int4", "uri": "pvc://ckpt/int4",
                                       "convertFrom": {"uri": "pvc://ckpt/fp8"}}
    apply(kubectl, namespace, md)

    def jobs() -> list[dict[str, Any]]:
        return json.loads(kubectl("get", "jobs", "-n", namespace, "-l",
                                  f"{c.LABEL_DEPLOYMENT}=conv", "-o", "json").stdout)["items"]

    (job,) = poll("the conversion Job", jobs)
    weights = poll("WeightsReady", lambda: conditions(get_md(kubectl, namespace, "conv")).get(
        c.WEIGHTS_READY))
    assert (weights["status"], weights["reason"]) == ("False", "Converting")
    poll("router and prefill rolled out", lambda: {"conv-router", "conv-prefill"} <= {
        n for k, n in children(kubectl, namespace, "conv") if k == "Deployment"})
    time.sleep(2 * RESYNC_S)  # resyncs change nothing while the Job waits
    assert ("Deployment", "conv-decode") not in children(kubectl, namespace, "conv")
    ready = conditions(get_md(kubectl, namespace, "conv"))[c.READY]
    assert ready["status"] == "False" and "decode waits for its weights" in ready["message"]

    # The pod's work, with the Job's own commands and mounts pointed at local folders.
    source = write_checkpoint(tmp_path / "fp8", TINY_CONFIGS["deepseek-v3"], dtype="fp8")
    pod = job["spec"]["template"]["spec"]
    (convert,), (verify,) = pod["initContainers"], pod["containers"]
    folders = {"/models/source": str(source), "/models/int4": str(tmp_path / "int4")}
    for container in (convert, verify):
        argv = [folders.get(a, a) for a in container["command"]]
        assert argv[:2] == ["tessera", "quantize"]
        subprocess.run([sys.executable, "-m", "tessera", *argv[1:]], check=True, timeout=120,
                       capture_output=True)
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]

    for obj in claim("ckpt", namespace, str(tmp_path)):
        apply(kubectl, namespace, obj)
    wait_ready(kubectl, namespace, "conv", timeout=60)
    md_now = get_md(kubectl, namespace, "conv")
    weights = conditions(md_now)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("True", "Converted")
    (job,) = jobs()
    assert any(x["type"] == "Complete" and x["status"] == "True"
               for x in job["status"]["conditions"])
    assert md_now["status"]["decode"]["readyReplicas"] == 2


def test_two_replicas_one_leads_the_other_takes_over(operator: Operator, kubectl: Any,
                                                     namespace: str, cluster: Any) -> None:
    operator.stop()  # the module's replica runs without election; these two replace it
    lease = f"{namespace}/tessera-operator"
    first, second = (Operator(cluster.env, operator.log.with_name(f"replica-{i}.log"),
                              "--leader-election", lease) for i in (1, 2))
    first.start()
    second.start(ready_line="waiting for leadership")
    try:
        apply(kubectl, namespace, tiny("ha"))
        wait_ready(kubectl, namespace, "ha")
        assert "leading as" not in second.text()
        first.kill()
        poll("the second replica to lead", lambda: "leading as" in second.text(), timeout=40)
        poll("the new leader to start", lambda: "operator started" in second.text())
        changed = tiny("ha")
        changed["spec"]["decode"]["replicas"] = 1
        apply(kubectl, namespace, changed)
        poll("decode scaled to 1 by the new leader",
             lambda: len(pod_uids(kubectl, namespace, "decode")) == 1, timeout=60)
    finally:
        first.stop()
        second.stop()
