"""When the cluster or the engine says no, the ModelDeployment says why.

Each case makes the real control plane refuse something: an admission policy rejects a child,
a ResourceQuota or Pod Security refuses the pods, the scheduler cannot place them, or (kwok's
`pod-engine-exit` stage, tessera/devcluster/stages.py) a running engine exits. Each asserts
the condition's type, reason and message, and that the operator's log holds no traceback.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from tessera.operator import constants as c
from test_operator_e2e import Operator, apply, children, conditions, get_md, poll, tiny
from test_operator_e2e import operator as operator  # noqa: F401  (the module's operator fixture)

from tessera.devcluster.stages import ANNOTATION_EXIT_CODE, ANNOTATION_EXIT_MESSAGE

pytestmark = pytest.mark.e2e


def wait_condition(kubectl: Any, namespace: str, name: str, type_: str, status: str,
                   reason: str, timeout: float = 60) -> dict[str, Any]:
    """The condition once it has this status and reason."""
    def check() -> dict[str, Any] | None:
        cond = conditions(get_md(kubectl, namespace, name)).get(type_, {})
        return cond if (cond.get("status"), cond.get("reason")) == (status, reason) else None
    return poll(f"{type_}={status} ({reason}) on {name}", check, timeout=timeout)  # type: ignore


def quiet_log(operator: Operator, offset: int) -> str:
    text = operator.text(offset)
    assert "Traceback" not in text, text[-4000:]
    return text


@pytest.fixture
def log_offset(operator: Operator) -> int:
    return len(operator.log.read_bytes())


@pytest.fixture
def deny_router_services(kubectl: Any, namespace: str) -> Iterator[str]:
    """A ValidatingAdmissionPolicy, bound to this namespace only, that refuses Services
    whose name ends in -router (as a platform team's policy might)."""
    policy = f"no-routers-{namespace}"
    kubectl("apply", "-f", "-", input={
        "apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "admissionregistration.k8s.io/v1",
             "kind": "ValidatingAdmissionPolicy", "metadata": {"name": policy},
             "spec": {"failurePolicy": "Fail",
                      "matchConstraints": {"resourceRules": [{
                          "apiGroups": [""], "apiVersions": ["v1"],
                          "operations": ["CREATE", "UPDATE"], "resources": ["services"]}]},
                      "validations": [{
                          "expression": "!object.metadata.name.endsWith('-router')",
                          "message": "router Services need the platform team's approval"}]}},
            {"apiVersion": "admissionregistration.k8s.io/v1",
             "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": policy},
             "spec": {"policyName": policy, "validationActions": ["Deny"],
                      "matchResources": {"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": namespace}}}}}]})
    probe = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "probe-router"},
             "spec": {"ports": [{"port": 80}]}}
    # The API server compiles the policy asynchronously: wait until it refuses.
    poll("the admission policy to refuse", lambda: kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=probe,
        check=False).returncode != 0, timeout=30)
    yield policy
    kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy,
            "--ignore-not-found", check=False)


def test_a_child_refused_by_admission_is_reported_and_retried_with_backoff(
        operator: Operator, kubectl: Any, namespace: str, deny_router_services: str,
        log_offset: int) -> None:
    apply(kubectl, namespace, tiny("rej"))
    degraded = wait_condition(kubectl, namespace, "rej", "Degraded", "True", "ChildRejected")
    message = degraded["message"]
    assert message.startswith("Service rej-router was rejected by the API server (")
    assert "router Services need the platform team's approval" in message
    assert f"ValidatingAdmissionPolicy '{deny_router_services}'" in message
    ready = conditions(get_md(kubectl, namespace, "rej"))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ChildRejected")
    assert ready["message"].startswith(message)
    # What was applied is there, and reported: the Deployments wait for the wave that failed.
    kinds = {kind for kind, _ in children(kubectl, namespace, "rej")}
    assert "ConfigMap" in kinds and "Deployment" not in kinds

    # Retries back off (2, 4, 8 s ...) and each logs exactly one line, with no traceback.
    poll("a third attempt", lambda: "retry 3 in 8s" in operator.text(log_offset), timeout=30)
    lines = [line for line in quiet_log(operator, log_offset).splitlines()
             if "rej-router was rejected" in line]
    assert [re.search(r"retry (\d+) in (\d+)s", line).groups()  # type: ignore[union-attr]
            for line in lines] == [("1", "2"), ("2", "4"), ("3", "8")]

    # The policy lifted: the next retry applies the rest and the deployment comes up.
    kubectl("delete", "validatingadmissionpolicybinding", deny_router_services)
    wait_condition(kubectl, namespace, "rej", "Ready", "True", "AllReady", timeout=60)
    md = get_md(kubectl, namespace, "rej")
    assert conditions(md)["Degraded"]["reason"] == "AsExpected"
    quiet_log(operator, log_offset)


def test_a_gpu_quota_below_a_phase_reaches_ready_and_degraded(
        operator: Operator, kubectl: Any, namespace: str, log_offset: int) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input={
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
        "spec": {"hard": {f"requests.{c.GPU_RESOURCE}": "1"}}})
    # The quota admits nothing until its controller has counted what the namespace uses.
    poll("the quota counted", lambda: json.loads(kubectl(
        "get", "resourcequota", "gpus", "-n", namespace, "-o", "json").stdout).get(
        "status", {}).get("hard"))
    md = tiny("quota")
    md["spec"]["decode"]["tensorParallel"] = 2  # 2 GPUs a pod, above the quota's 1
    apply(kubectl, namespace, md)

    degraded = wait_condition(kubectl, namespace, "quota", "Degraded", "True", "QuotaExceeded")
    assert degraded["message"].startswith(
        'decode 0/2 ready: pods not created: pods "quota-decode-')
    assert ("is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=2"
            in degraded["message"])
    assert "limited: requests.nvidia.com/gpu=1" in degraded["message"]
    ready = conditions(get_md(kubectl, namespace, "quota"))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "QuotaExceeded")
    assert "decode 0/2 ready: pods not created:" in ready["message"]
    assert "exceeded quota: gpus" in ready["message"]
    # `kubectl get md` answers "why not up?" on its own line.
    header, row = kubectl("get", "md", "quota", "-n", namespace).stdout.splitlines()
    assert header.split()[:3] == ["NAME", "READY", "REASON"]
    assert row.split()[:4] == ["quota", "False", "QuotaExceeded", "prefill"]
    print(kubectl("describe", "md", "quota", "-n", namespace).stdout)
    quiet_log(operator, log_offset)


@pytest.mark.parametrize("edit, pods, expected", [
    # No node carries the phase's pool label.
    (lambda s: s["decode"].update(nodeSelector={"tessera.dev/pool": "decode-xl"}), 2,
     ["didn't match Pod's node affinity/selector",
      "2 replica(s) x 1 GPU(s) need 1 node(s) with 2 free GPU(s) each, matching "
      "nvidia.com/gpu.product=NVIDIA-H200, tessera.dev/pool=decode-xl"]),
    # The pool's two nodes hold two 8-GPU replicas; the third finds no free GPUs.
    (lambda s: (s["decode"].update(nodeSelector={"tessera.dev/pool": "decode"},
                                   tensorParallel=8, replicas=3),
                s["prefill"].update(nodeSelector={"tessera.dev/pool": "prefill"})), 1,
     ["Insufficient nvidia.com/gpu",
      "3 replica(s) x 8 GPU(s) need 3 node(s) with 8 free GPU(s) each, matching "
      "nvidia.com/gpu.product=NVIDIA-H200, tessera.dev/pool=decode"]),
], ids=["no-matching-node", "not-enough-gpus"])
def test_pods_the_scheduler_cannot_place_name_the_phase_and_quote_it(
        operator: Operator, kubectl: Any, namespace: str, log_offset: int, edit: Any,
        pods: int, expected: list[str]) -> None:
    md = tiny("unplaced")
    edit(md["spec"])
    apply(kubectl, namespace, md)
    wait_condition(kubectl, namespace, "unplaced", "Ready", "False", "Unschedulable")

    seen: list[Any] = []

    def settled() -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Ready and Degraded once they name every pending decode pod (pods of tests before
        this one may still be leaving the decode nodes)."""
        items = json.loads(kubectl("get", "pods", "-n", namespace, "-l",
                                   f"{c.LABEL_PHASE}=decode", "-o", "json").stdout)["items"]
        pending = sorted(p["metadata"]["name"] for p in items if not p["spec"].get("nodeName"))
        conds = conditions(get_md(kubectl, namespace, "unplaced"))
        named = re.search(r"pods? (\S+(?:, \S+)*) unschedulable", conds["Ready"]["message"])
        seen[:] = [pending, conds["Ready"]["message"]]
        if len(pending) != pods or not named or named.group(1).split(", ") != pending:
            return None
        return conds["Ready"], conds["Degraded"]

    try:
        ready, degraded = poll(f"{pods} decode pod(s) pending and named", settled, timeout=60)
    except BaseException:
        print("last seen:", seen, kubectl("get", "pods", "-A", "-o", "wide").stdout)
        raise
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable")
    assert (degraded["status"], degraded["reason"]) == ("True", "Unschedulable")
    for cond in (ready, degraded):
        assert re.search(r"decode \d/\d ready: pods? unplaced-decode-\S+( unplaced-decode-\S+)? "
                         r"unschedulable: 0/\d+ nodes are available: ", cond["message"]), cond
        for text in expected:
            assert text in cond["message"]
    print(kubectl("describe", "md", "unplaced", "-n", namespace).stdout)
    quiet_log(operator, log_offset)


def test_pod_security_restricted_refuses_the_pods_and_says_so(
        operator: Operator, kubectl: Any, namespace: str, log_offset: int) -> None:
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    apply(kubectl, namespace, tiny("psa"))
    components = ("prefill 0/1", "decode 0/2", "router 0/1")
    # Each component's ReplicaSet reports on its own: wait until all three have.
    degraded = poll("Degraded to quote Pod Security for every component", lambda: (
        cond := conditions(get_md(kubectl, namespace, "psa")).get("Degraded", {}))
        and all(f'{x} ready: pods not created: pods "psa-' in cond["message"]
                for x in components) and cond)
    assert (degraded["status"], degraded["reason"]) == ("True", "PodSecurityRejected")
    assert 'violates PodSecurity "restricted:latest"' in degraded["message"]
    ready = conditions(get_md(kubectl, namespace, "psa"))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PodSecurityRejected")
    quiet_log(operator, log_offset)


def test_a_priority_class_that_does_not_exist_refuses_the_pods_and_says_so(
        operator: Operator, kubectl: Any, namespace: str, log_offset: int) -> None:
    md = tiny("prio")
    md["spec"].setdefault("nodePool", {})["priorityClassName"] = f"absent-{namespace}"
    apply(kubectl, namespace, md)
    degraded = poll("Degraded to quote the missing PriorityClass", lambda: (
        cond := conditions(get_md(kubectl, namespace, "prio")).get("Degraded", {}))
        and "no PriorityClass with name" in cond.get("message", "") and cond)
    assert (degraded["status"], degraded["reason"]) == ("True", "PodsRejected")
    assert f"absent-{namespace}" in degraded["message"]
    quiet_log(operator, log_offset)


def test_engine_pods_pass_pod_security_baseline(operator: Operator, kubectl: Any,
                                                namespace: str) -> None:
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline")
    apply(kubectl, namespace, tiny("baseline"))
    wait_condition(kubectl, namespace, "baseline", "Ready", "True", "AllReady")


def test_an_engine_that_exits_is_named_with_its_termination_message(
        operator: Operator, kubectl: Any, namespace: str, log_offset: int) -> None:
    apply(kubectl, namespace, tiny("crash"))
    wait_condition(kubectl, namespace, "crash", "Ready", "True", "AllReady")
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-l", f"{c.LABEL_PHASE}=decode",
                              "-o", "json").stdout)["items"]
    pod = sorted(p["metadata"]["name"] for p in pods)[0]
    said = "preflight: GPU 0 has 80 GiB, the plan needs 141 GiB; lower contextLength"
    kubectl("annotate", "pod", pod, "-n", namespace, f"{ANNOTATION_EXIT_CODE}=3",
            f"{ANNOTATION_EXIT_MESSAGE}={said}")

    expected = (f"decode 1/2 ready: pod {pod}: container engine exited with code 3: {said}; "
                "CrashLoopBackOff after 3 restart(s)")
    # The pod's status arrives before its Deployment counts it unready: wait for both.
    degraded = poll("Degraded to name the pod, with decode 1/2 ready", lambda: (
        cond := conditions(get_md(kubectl, namespace, "crash"))["Degraded"])
        and cond["message"] == expected and cond)
    assert (degraded["status"], degraded["reason"]) == ("True", "EngineFailed")
    ready = conditions(get_md(kubectl, namespace, "crash"))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "EngineFailed")
    assert ready["message"] == degraded["message"]
    print(kubectl("describe", "md", "crash", "-n", namespace).stdout)
    quiet_log(operator, log_offset)


def test_a_namespace_deleted_mid_reconcile_logs_no_traceback(
        operator: Operator, kubectl: Any, namespace: str, log_offset: int) -> None:
    """Its children's deletions, creates refused as the namespace terminates, status writes
    and events for deployments being deleted: none of it is an error."""
    apply(kubectl, namespace, tiny("settled"))
    wait_condition(kubectl, namespace, "settled", "Ready", "True", "AllReady", timeout=90)
    apply(kubectl, namespace, tiny("fresh"))  # still being applied when the namespace goes
    kubectl("delete", "namespace", namespace, "--wait=false")
    poll("the namespace gone", lambda: kubectl("get", "namespace", namespace,
                                               check=False).returncode != 0, timeout=120)
    # And a resync after it is gone.
    gone_at = len(operator.log.read_bytes())
    poll("a resync", lambda: "resync:" in operator.text(gone_at), timeout=30)
    text = quiet_log(operator, log_offset)
    assert f"{namespace}/" in text  # the operator did see and act on this namespace
