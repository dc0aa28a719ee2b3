"""Refusals: what the cluster or the engine said no to, and the conditions that quote it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tessera.operator import constants as c
from tessera.operator.refusals import (
    CHILD_REJECTED,
    ENGINE_FAILED,
    POD_SECURITY_REJECTED,
    PODS_REJECTED,
    QUOTA_EXCEEDED,
    UNSCHEDULABLE,
    Refusal,
    Rejection,
    api_message,
    backoff_seconds,
    creation_refusal,
    is_refusal,
    observe_refusals,
    pod_refusals,
    pool_need,
)
from tessera.operator.status import Workload, rollout_conditions

QUOTA = ('pods "q-decode-5d8f-x2x9z" is forbidden: exceeded quota: gpus, requested: '
         'requests.nvidia.com/gpu=2, used: requests.nvidia.com/gpu=1, limited: '
         'requests.nvidia.com/gpu=1')
PSA = ('pods "p-decode-5d8f-abcde" is forbidden: violates PodSecurity "restricted:latest": '
       'allowPrivilegeEscalation != false (container "engine" must set '
       'securityContext.allowPrivilegeEscalation=false)')
SCHEDULER = ("0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector. "
             "preemption: 0/4 nodes are available: 4 Preemption is not helpful for scheduling.")


@pytest.mark.parametrize("code, refused", [
    (400, True), (403, True), (422, True), (404, False), (409, False), (429, False),
    (408, False), (500, False), (503, False),
])
def test_which_api_errors_are_refusals(code: int, refused: bool) -> None:
    assert is_refusal(code) is refused


def test_api_message_quotes_the_status_and_falls_back() -> None:
    body = json.dumps({"kind": "Status", "message": 'Service "a.b-router" is invalid: x'})
    assert api_message(body, "Unprocessable") == 'Service "a.b-router" is invalid: x'
    assert api_message("<html>oops</html>", "Unprocessable") == "Unprocessable"
    assert api_message(None, "Forbidden") == "Forbidden"


@pytest.mark.parametrize("status, gone", [
    ({"code": 403, "reason": "Forbidden", "details": {"causes": [
        {"reason": "NamespaceTerminating", "field": "metadata.namespace"}]}}, True),
    ({"code": 404, "reason": "NotFound", "details": {"name": "llm", "kind": "namespaces"}}, True),
    ({"code": 404, "reason": "NotFound", "details": {"name": "x", "kind": "configmaps"}}, False),
    ({"code": 403, "reason": "Forbidden", "message": "denied by policy"}, False),
])
def test_a_namespace_being_deleted_is_told_apart(status: dict[str, Any], gone: bool) -> None:
    from tessera.operator.refusals import namespace_gone
    assert namespace_gone(json.dumps({"kind": "Status", **status})) is gone
    assert not namespace_gone("not json") and not namespace_gone(None)


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_seconds(n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert backoff_seconds(30) == 300.0


@pytest.mark.parametrize("failure, reason", [
    (QUOTA, QUOTA_EXCEEDED), (PSA, POD_SECURITY_REJECTED),
    ('pods "x" is forbidden: error looking up service account llm/x-engine: not found',
     PODS_REJECTED),
])
def test_creation_refusal_names_what_refused_the_pods(failure: str, reason: str) -> None:
    refusal = creation_refusal("decode", failure)
    assert refusal == Refusal("decode", reason, f"pods not created: {failure}")
    assert creation_refusal("decode", "") is None


def pod(name: str, phase: str = "decode", scheduled: dict[str, Any] | None = None,
        containers: list[dict[str, Any]] | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {c.LABEL_PHASE: phase}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"kind": "Pod", "metadata": meta,
            "status": {"conditions": [scheduled] if scheduled else [],
                       "containerStatuses": containers or []}}


UNPLACED = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": SCHEDULER}
RUNNING = {"name": "engine", "ready": True, "state": {"running": {}}}
CRASHING = {"name": "engine", "ready": False, "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
            "lastState": {"terminated": {
                "exitCode": 3, "reason": "Error",
                "message": "preflight: 80 GiB of GPU memory, needs 141\n"}}}
EXITED = {"name": "engine", "ready": False,
          "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
RECOVERED = {"name": "engine", "ready": True, "restartCount": 1, "state": {"running": {}},
             "lastState": {"terminated": {"exitCode": 1, "message": "old crash"}}}
NO_IMAGE = {"name": "engine", "ready": False,
            "state": {"waiting": {"reason": "ImagePullBackOff",
                                  "message": 'Back-off pulling image "tessera/runtime:nope"'}}}


@pytest.mark.parametrize("pods, expected", [
    ([pod("d-1", containers=[RUNNING])], []),
    ([pod("d-1", scheduled=UNPLACED)],
     [Refusal("decode", UNSCHEDULABLE, f"pod d-1 unschedulable: {SCHEDULER} (needs 1 node)")]),
    # the same words for two pods: one refusal naming both
    ([pod("d-2", scheduled=UNPLACED), pod("d-1", scheduled=UNPLACED)],
     [Refusal("decode", UNSCHEDULABLE,
              f"pods d-1, d-2 unschedulable: {SCHEDULER} (needs 1 node)")]),
    ([pod("d-1", containers=[CRASHING])],
     [Refusal("decode", ENGINE_FAILED, "pod d-1: container engine exited with code 3: "
              "preflight: 80 GiB of GPU memory, needs 141; CrashLoopBackOff after 4 restart(s)")]),
    ([pod("d-1", containers=[EXITED])],
     [Refusal("decode", ENGINE_FAILED, "pod d-1: container engine exited with code 137: "
              "OOMKilled")]),
    ([pod("d-1", containers=[RECOVERED])], []),
    ([pod("d-1", containers=[NO_IMAGE])],
     [Refusal("decode", ENGINE_FAILED, 'pod d-1: container engine ImagePullBackOff: '
              'Back-off pulling image "tessera/runtime:nope"')]),
    # a pod on its way out says nothing
    ([pod("d-1", scheduled=UNPLACED, deleting=True)], []),
    # many alike: three named, the rest counted
    ([pod(f"d-{i}", scheduled=UNPLACED) for i in range(5)],
     [Refusal("decode", UNSCHEDULABLE,
              f"pods d-0, d-1, d-2 and 2 more unschedulable: {SCHEDULER} (needs 1 node)")]),
], ids=["running", "unschedulable", "two-alike", "crash-loop", "exited", "recovered",
        "image", "deleting", "many-alike"])
def test_pod_refusals(pods: list[dict[str, Any]], expected: list[Refusal]) -> None:
    assert pod_refusals("decode", pods, "needs 1 node") == expected


@pytest.mark.parametrize("replicas, gpus, per_node, nodes, free", [
    (2, 8, 8, 2, 8), (3, 1, 8, 1, 3), (5, 4, 8, 3, 8), (1, 2, 8, 1, 2),
    (2, 16, 8, 4, 8),  # a replica two nodes wide
])
def test_pool_need_counts_whole_nodes(replicas: int, gpus: int, per_node: int, nodes: int,
                                      free: int) -> None:
    text = pool_need(replicas, gpus, per_node, {"pool": "decode"})
    assert text == (f"{replicas} replica(s) x {gpus} GPU(s) need {nodes} node(s) with {free} "
                    "free GPU(s) each, matching pool=decode")


def spec() -> dict[str, Any]:
    phase = {"tensorParallel": 8, "replicas": 2, "weights": {"dtype": "int4", "uri": "hf://x"}}
    return {"nodePool": {"nodeSelector": {"pool": "h200"}}, "prefill": {**phase, "replicas": 1},
            "decode": phase}


def test_observe_refusals_in_order_with_the_pool_need() -> None:
    rejected = Rejection("Service", "a.b-router", 422, "metadata.name: Invalid value")
    got = observe_refusals(spec(), {"prefill": "", "decode": QUOTA, "router": ""},
                           [pod("d-1", scheduled=UNPLACED),
                            pod("r-1", phase=c.ROUTER, containers=[CRASHING])], [rejected])
    assert [(r.component, r.reason) for r in got] == [
        ("", CHILD_REJECTED), ("decode", QUOTA_EXCEEDED), ("decode", UNSCHEDULABLE),
        ("router", ENGINE_FAILED)]
    assert got[0].message == ("Service a.b-router was rejected by the API server (422): "
                              "metadata.name: Invalid value")
    assert got[2].message.endswith("(2 replica(s) x 8 GPU(s) need 2 node(s) with 8 free GPU(s) "
                                   "each, matching pool=h200)")


def w(desired: int, ready: int, **kw: Any) -> Workload:
    return Workload(desired, desired, ready, desired, True, "", **kw)


@pytest.mark.parametrize("workloads, refusals, ready, degraded", [
    # quota: the phase, its count and the quota's words in both conditions
    ({"prefill": w(1, 1), "decode": w(2, 0, replica_failure=QUOTA), "router": w(1, 1)},
     [Refusal("decode", QUOTA_EXCEEDED, f"pods not created: {QUOTA}")],
     ("False", QUOTA_EXCEEDED, f"decode 0/2 ready: pods not created: {QUOTA}"),
     ("True", QUOTA_EXCEEDED, f"decode 0/2 ready: pods not created: {QUOTA}")),
    # a rejected child: nothing of the phases yet, the rejection first
    ({"prefill": None, "decode": None, "router": None},
     [Refusal("", CHILD_REJECTED, "Service a.b was rejected by the API server (422): no")],
     ("False", CHILD_REJECTED, "Service a.b was rejected by the API server (422): no; "
      "prefill not created; decode not created; router not created"),
     ("True", CHILD_REJECTED, "Service a.b was rejected by the API server (422): no")),
    # two refusals: the more fundamental reason wins, both are listed
    ({"prefill": w(1, 0), "decode": w(2, 1, settled=True), "router": w(1, 1)},
     [Refusal("prefill", ENGINE_FAILED, "pod p-1: container engine exited with code 3: x"),
      Refusal("decode", UNSCHEDULABLE, "pod d-2 unschedulable: 0/4 nodes are available")],
     ("False", UNSCHEDULABLE, "prefill 0/1 ready: pod p-1: container engine exited with code "
      "3: x; decode 1/2 ready: pod d-2 unschedulable: 0/4 nodes are available"),
     ("True", UNSCHEDULABLE, "prefill 0/1 ready: pod p-1: container engine exited with code "
      "3: x; decode 1/2 ready: pod d-2 unschedulable: 0/4 nodes are available")),
    # a crashed pod of a component that is otherwise complete: Ready holds, Degraded says so
    ({"prefill": w(1, 1), "decode": w(2, 2), "router": w(1, 1)},
     [Refusal("decode", ENGINE_FAILED, "pod d-3: container engine exited with code 1: x")],
     ("True", "AllReady", "all phases and the router are ready"),
     ("True", ENGINE_FAILED, "decode 2/2 ready: pod d-3: container engine exited with code "
      "1: x")),
], ids=["quota", "child-rejected", "two", "complete"])
def test_refusals_reach_ready_and_degraded(workloads: dict[str, Workload | None],
                                           refusals: list[Refusal],
                                           ready: tuple[str, str, str],
                                           degraded: tuple[str, str, str]) -> None:
    conds = {x["type"]: x for x in rollout_conditions(workloads, True, 2, refusals=refusals)}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"],
            conds["Ready"]["message"]) == ready
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"],
            conds["Degraded"]["message"]) == degraded


class RejectingKube:
    """An API server that refuses one child with a 422 until told otherwise, and records
    every apply and status write."""

    def __init__(self, refuse: tuple[str, str] | None) -> None:
        self.refuse = refuse
        self.applied: list[tuple[str, str]] = []
        self.status: dict[str, Any] = {}
        # What a delete or a status write raises instead (one of kube._refused's answers).
        self.refuse_delete: Exception | None = None
        self.refuse_status: Exception | None = None
        self.deleted: list[tuple[str, str]] = []
        self.events: list[tuple[str, str]] = []  # (type, reason)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        from tessera.operator.refusals import RejectedError
        name = obj["metadata"]["name"]
        self.applied.append((obj["kind"], name))
        if (obj["kind"], name) == self.refuse:
            raise RejectedError(Rejection(obj["kind"], name, 422, "denied by policy x"))
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "5"}}

    def delete(self, obj: dict[str, Any]) -> None:
        if self.refuse_delete is not None:
            raise self.refuse_delete
        self.deleted.append((obj["kind"], obj["metadata"]["name"]))

    def patch_status(self, md: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        if self.refuse_status is not None:
            raise self.refuse_status
        self.status = {k: v for k, v in {**self.status, **patch}.items() if v is not None}
        return {**md, "status": self.status,
                "metadata": {**md["metadata"], "resourceVersion": str(len(self.applied) + 9)}}

    def post_event(self, md: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason))


def test_a_rejected_child_is_reported_retried_with_backoff_and_cleared() -> None:
    from pathlib import Path

    import yaml
    from tessera.operator.reconcile import Reconciler, Store
    from tessera.operator.render import render_configs

    example = Path(__file__).resolve().parents[2] / "examples/01-kimi-k2/modeldeployment.yaml"
    md = yaml.safe_load(example.read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1, resourceVersion="1")
    kube, store, now = RejectingKube(("Service", "kimi-k2-router")), Store(), [100.0]
    calls: list[float] = []
    store.put(md)
    reconciler = Reconciler(kube, store, render_configs,  # type: ignore[arg-type]
                            clock=lambda: now[0], schedule=lambda d, _: calls.append(d))

    reconciler.reconcile("llm", "kimi-k2")
    conds = {x["type"]: x for x in kube.status["conditions"]}
    said = "Service kimi-k2-router was rejected by the API server (422): denied by policy x"
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", CHILD_REJECTED)
    assert conds["Degraded"]["message"] == said
    assert conds["Ready"]["reason"] == CHILD_REJECTED and conds["Ready"]["message"].startswith(
        said)
    # The wave with the rejection finished; the Deployments (a later wave) waited.
    deployments = {("Deployment", "kimi-k2-prefill"), ("Deployment", "kimi-k2-decode")}
    assert ("ConfigMap", "kimi-k2-decode-config") in kube.applied
    assert not deployments & set(kube.applied)
    assert calls == [2.0]

    # Before the retry is due, events change nothing and apply nothing.
    tried = len(kube.applied)
    reconciler.reconcile("llm", "kimi-k2")
    assert len(kube.applied) == tried and calls == [2.0]
    # Due: tried again, refused again, the next wait doubles.
    now[0] += 2.0
    reconciler.reconcile("llm", "kimi-k2")
    assert kube.applied.count(("Service", "kimi-k2-router")) == 2 and calls == [2.0, 4.0]
    # The cluster relents: everything is applied and the condition clears.
    kube.refuse = None
    now[0] += 4.0
    reconciler.reconcile("llm", "kimi-k2")
    conds = {x["type"]: x for x in kube.status["conditions"]}
    assert conds["Degraded"]["reason"] != CHILD_REJECTED
    assert deployments <= set(kube.applied)


def _reconciler(kube: RejectingKube, now: list[float], calls: list[float]) -> Any:
    """The kimi-k2 example in namespace llm, reconciled against `kube` on a fake clock."""
    from pathlib import Path

    import yaml
    from tessera.operator.reconcile import Reconciler, Store
    from tessera.operator.render import render_configs

    example = Path(__file__).resolve().parents[2] / "examples/01-kimi-k2/modeldeployment.yaml"
    md = yaml.safe_load(example.read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1, resourceVersion="1")
    store = Store()
    store.put(md)
    return Reconciler(kube, store, render_configs,  # type: ignore[arg-type]
                      clock=lambda: now[0], schedule=lambda d, _: calls.append(d))


UNWANTED = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "kimi-k2-old", "namespace": "llm", "resourceVersion": "2",
                         "labels": {c.LABEL_DEPLOYMENT: "kimi-k2",
                                    c.LABEL_MANAGED_BY: c.MANAGED_BY}}}


def test_a_refused_prune_is_reported_retried_with_backoff_and_cleared(
        caplog: pytest.LogCaptureFixture) -> None:
    from tessera.operator.refusals import RejectedError
    kube, now, calls = RejectingKube(None), [100.0], []
    reconciler = _reconciler(kube, now, calls)
    reconciler.reconcile("llm", "kimi-k2")  # converged
    reconciler.store.put(UNWANTED)
    kube.refuse_delete = RejectedError(Rejection("ConfigMap", "kimi-k2-old", 403,
                                                 "cannot delete: held by policy y"))
    with caplog.at_level("INFO"):
        reconciler.reconcile("llm", "kimi-k2")
    degraded = {x["type"]: x for x in kube.status["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True", CHILD_REJECTED, "ConfigMap kimi-k2-old was rejected by the API server (403): "
                                "cannot delete: held by policy y")
    assert calls == [2.0] and not any(r.exc_info for r in caplog.records)
    assert [r.getMessage() for r in caplog.records if r.levelname != "INFO"] == [
        "llm/kimi-k2: ConfigMap kimi-k2-old was rejected by the API server (403): cannot "
        "delete: held by policy y; retry 1 in 2s"]
    # Not due: not tried again. Due and allowed: deleted, and the condition clears.
    reconciler.reconcile("llm", "kimi-k2")
    assert calls == [2.0] and kube.deleted == []
    kube.refuse_delete, now[0] = None, now[0] + 2.0
    reconciler.reconcile("llm", "kimi-k2")
    assert kube.deleted == [("ConfigMap", "kimi-k2-old")]
    degraded = {x["type"]: x for x in kube.status["conditions"]}["Degraded"]
    assert degraded["reason"] != CHILD_REJECTED


def test_a_refused_status_write_logs_one_line_posts_an_event_and_backs_off(
        caplog: pytest.LogCaptureFixture) -> None:
    from tessera.operator.reconcile import STATUS_REJECTED
    from tessera.operator.refusals import RejectedError
    kube, now, calls = RejectingKube(None), [100.0], []
    kube.refuse_status = RejectedError(Rejection(c.KIND, "kimi-k2", 422,
                                                 "status.conditions: Too many"))
    reconciler = _reconciler(kube, now, calls)
    with caplog.at_level("WARNING"):
        reconciler.reconcile("llm", "kimi-k2")
        reconciler.reconcile("llm", "kimi-k2")  # not due yet: not tried, not logged
    assert [r.getMessage() for r in caplog.records] == [
        "llm/kimi-k2: status not written (422): status.conditions: Too many; retry 1 in 2s"]
    assert not caplog.records[0].exc_info
    # Reported the one way left (an event); the condition changes wait for the status.
    assert kube.events == [("Warning", STATUS_REJECTED)] and calls == [2.0]
    now[0] += 2.0
    reconciler.reconcile("llm", "kimi-k2")
    assert calls == [2.0, 4.0]
    kube.refuse_status, now[0] = None, now[0] + 4.0
    reconciler.reconcile("llm", "kimi-k2")
    assert kube.status["conditions"]
    assert len(kube.events) > 3 and kube.events.count(("Warning", STATUS_REJECTED)) == 2


@pytest.mark.parametrize("where", ["apply", "delete", "status"])
def test_a_namespace_being_deleted_is_neither_reported_nor_retried(
        where: str, caplog: pytest.LogCaptureFixture) -> None:
    from tessera.operator.refusals import NamespaceGone
    kube, now, calls = RejectingKube(None), [100.0], []
    reconciler = _reconciler(kube, now, calls)
    reconciler.reconcile("llm", "kimi-k2")  # converged
    reconciler.store.put(UNWANTED)
    reconciler.store.drop({"kind": "Service", "metadata": {"namespace": "llm",
                                                            "name": "kimi-k2-router"}})
    gone = NamespaceGone("unable to create new content in namespace llm because it is being "
                         "terminated")
    if where == "apply":
        kube.refuse = ("Service", "kimi-k2-router")
        kube.apply = lambda obj: (_ for _ in ()).throw(gone)  # type: ignore[method-assign]
    else:
        setattr(kube, f"refuse_{where}", gone)
    before, posted = dict(kube.status), len(kube.events)
    with caplog.at_level("INFO"):
        reconciler.reconcile("llm", "kimi-k2")
    assert calls == [] and not [r for r in caplog.records if r.levelname != "INFO"]
    assert not any(x["reason"] == CHILD_REJECTED for x in kube.status["conditions"])
    if where == "status":  # tried, not written, and so nothing announced
        assert kube.status == before and len(kube.events) == posted


def _api_error(code: int, body: dict[str, Any] | None) -> Any:
    from kubernetes.client import ApiException
    error = ApiException(status=code, reason="Refused")
    error.body = json.dumps({"kind": "Status", "code": code, **body}) if body else None
    return error


TERMINATING = {"reason": "Forbidden", "message": "namespace llm is being terminated",
               "details": {"causes": [{"reason": "NamespaceTerminating"}]}}
DENIED = {"reason": "Forbidden", "message": "denied by policy z"}


@pytest.mark.parametrize("call", ["apply", "delete", "patch_status"])
@pytest.mark.parametrize("code, body, raised", [
    (403, TERMINATING, "NamespaceGone"),
    (404, {"reason": "NotFound", "details": {"kind": "namespaces", "name": "llm"}},
     "NamespaceGone"),
    (403, DENIED, "RejectedError"),
    (422, {"reason": "Invalid", "message": "spec.x: Invalid value"}, "RejectedError"),
    (500, {"reason": "InternalError"}, "ApiException"),
    (429, None, "ApiException"),
    (404, {"reason": "NotFound", "details": {"kind": "configmaps"}}, "ApiException"),
])
def test_the_adapter_turns_api_errors_into_what_the_reconciler_handles(
        call: str, code: int, body: dict[str, Any] | None, raised: str) -> None:
    from tessera.operator.kube import Kube
    kube = Kube.__new__(Kube)
    error = _api_error(code, body)

    def request(*args: Any, **kwargs: Any) -> Any:
        raise error
    kube.request = request  # type: ignore[method-assign]
    obj = {**UNWANTED, "metadata": {**UNWANTED["metadata"], "uid": "u"}}
    if code == 404 and call != "apply":  # what is deleted or written to is gone already
        assert getattr(kube, call)(*([obj, {}] if call == "patch_status" else [obj])) is None
        return
    with pytest.raises(Exception) as caught:
        getattr(kube, call)(*([obj, {}] if call == "patch_status" else [obj]))
    assert type(caught.value).__name__ == raised
    if raised == "RejectedError":
        rejection = caught.value.rejection  # type: ignore[attr-defined]
        assert rejection.code == code and rejection.message == body["message"]  # type: ignore[index]
        assert rejection.kind == (c.KIND if call == "patch_status" else "ConfigMap")
