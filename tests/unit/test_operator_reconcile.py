"""decide(): one reconcile's whole decision, from a parent and what the cluster holds."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from tessera.operator import constants as c
from tessera.operator.reconcile import (
    Decision,
    Key,
    Reconciler,
    Store,
    intend,
    key_of,
    status_patch,
)
from tessera.operator.reconcile import decide as decide_with
from tessera.operator.render import render_configs
from tessera.runtime.planner import plan as plan_module

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "01-kimi-k2" / "modeldeployment.yaml"
NOW = "2026-01-01T00:00:00Z"


def decide(md: dict[str, Any], owned: dict[Key, Any], now: str) -> Decision:
    return decide_with(md, owned, intend(md, render_configs), now)


def kimi() -> dict[str, Any]:
    md = yaml.safe_load(EXAMPLE.read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    return md


def as_stored(obj: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    """What the API server hands back: our fields plus defaults and server-owned ones."""
    out = copy.deepcopy(obj)
    out["metadata"].update(uid="child-uid", resourceVersion="7", generation=1)
    if obj["kind"] == "Deployment":
        out["spec"]["revisionHistoryLimit"] = 10
        out["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
        n = obj["spec"]["replicas"]
        out["status"] = {"observedGeneration": 1, "replicas": n,
                         "readyReplicas": n if ready else 0, "updatedReplicas": n,
                         "conditions": [{"type": "Progressing", "status": "True",
                                         "reason": "NewReplicaSetAvailable" if ready
                                         else "ReplicaSetUpdated"}]}
    if obj["kind"] == "Service" and obj["spec"].get("clusterIP") != "None":
        out["spec"]["clusterIP"] = "10.0.0.12"
    return out


def converge(md: dict[str, Any], ready: bool) -> tuple[dict[str, Any], dict[Key, Any]]:
    """Apply a first decision as the cluster would; return the parent and its children."""
    first = decide(md, {}, NOW)
    owned = {key_of(o): as_stored(o, ready) for o in first.apply}
    after = decide(md, owned, NOW)
    assert after.status_patch is not None
    md = {**md, "status": {k: v for k, v in after.status_patch.items() if v is not None}}
    return md, owned


def conditions(decision: Decision) -> dict[str, tuple[str, str]]:
    assert decision.status_patch is not None
    return {x["type"]: (x["status"], x["reason"]) for x in decision.status_patch["conditions"]}


def test_a_new_deployment_gets_every_child_and_a_status() -> None:
    decision = decide(kimi(), {}, NOW)
    assert len(decision.apply) == 18 and decision.prune == []
    got = conditions(decision)
    assert got["Ready"] == ("False", "ComponentsNotReady")
    assert got["PrecisionValid"] == ("True", "PrecisionSupported")
    assert got["KVIntegrity"] == ("True", "NoMismatches")
    assert decision.status_patch is not None
    assert decision.status_patch["observedGeneration"] == 1
    assert {x["type"] for x in decision.events} == set(c.CONDITION_TYPES)


def test_ready_once_every_deployment_is_ready() -> None:
    md, owned = converge(kimi(), ready=True)
    assert md["status"]["summary"] == {"replicas": "prefill 1/1, decode 2/2",
                                       "kvCache": "prefill=bf16 decode=fp8_e4m3",
                                       "weights": "prefill=fp8 decode=int4"}
    assert md["status"]["endpoint"] == "http://kimi-k2-router.llm.svc:8000/v1"
    got = {x["type"]: x["status"] for x in md["status"]["conditions"]}
    assert got["Ready"] == "True" and got["Progressing"] == "False"


def test_nothing_changed_means_nothing_to_do() -> None:
    md, owned = converge(kimi(), ready=True)
    again = decide(md, owned, "2026-01-01T01:00:00Z")
    assert again == Decision(apply=[], prune=[], status_patch=None, events=[])


def test_a_child_edited_by_hand_is_reapplied_alone() -> None:
    md, owned = converge(kimi(), ready=True)
    key = ("Deployment", "llm", "kimi-k2-decode")
    owned[key]["spec"]["replicas"] = 5
    owned[("Service", "llm", "kimi-k2-router")]["metadata"]["labels"]["team"] = "x"  # not ours
    decision = decide(md, owned, NOW)
    assert [key_of(o) for o in decision.apply] == [key]


def test_a_deleted_child_is_recreated() -> None:
    md, owned = converge(kimi(), ready=True)
    del owned[("ConfigMap", "llm", "kimi-k2-prefill-config")]
    decision = decide(md, owned, NOW)
    assert [key_of(o) for o in decision.apply] == [("ConfigMap", "llm", "kimi-k2-prefill-config")]


def test_a_child_no_longer_wanted_is_pruned() -> None:
    md, owned = converge(kimi(), ready=True)
    stray = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "kimi-k2-old", "namespace": "llm",
                          "labels": {c.LABEL_DEPLOYMENT: "kimi-k2"}}}
    owned[key_of(stray)] = stray
    assert decide(md, owned, NOW).prune == [stray]


def test_a_kv_dtype_pair_the_transfer_cannot_carry_gets_no_children(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_module, "KV_HANDOFF_CONVERSIONS", frozenset())  # no conversion
    md = kimi()
    decision = decide(md, {}, NOW)
    assert decision.apply == [] and decision.prune == []
    got = conditions(decision)
    assert got["PrecisionValid"] == ("False", "KVCacheDtypeMismatch")
    assert got["Ready"] == ("False", "NotAdmitted")
    assert decision.status_patch is not None and "endpoint" not in decision.status_patch


def test_weights_that_do_not_fit_get_capacity_planned_false() -> None:
    md = kimi()
    md["spec"]["decode"]["weights"] = {"dtype": "bf16", "uri": "hf://moonshotai/Kimi-K2"}
    md["spec"]["decode"]["kvCache"]["dtype"] = "fp8_e4m3"
    decision = decide(md, {}, NOW)
    assert decision.apply == []
    assert conditions(decision)["CapacityPlanned"] == ("False", "InsufficientGPUMemory")


def test_a_decode_kv_dtype_change_rolls_only_the_decode_pool() -> None:
    md, owned = converge(kimi(), ready=True)
    md["spec"]["decode"]["kvCache"]["dtype"] = "bf16"
    md["metadata"]["generation"] = 2
    decision = decide(md, owned, NOW)
    assert {key_of(o) for o in decision.apply} == {
        ("ConfigMap", "llm", "kimi-k2-decode-config"), ("Deployment", "llm", "kimi-k2-decode")}
    assert conditions(decision)["PrecisionValid"][0] == "True"


def test_a_spec_turned_bad_keeps_the_running_children(monkeypatch: pytest.MonkeyPatch) -> None:
    md, owned = converge(kimi(), ready=True)
    monkeypatch.setattr(plan_module, "KV_HANDOFF_CONVERSIONS", frozenset())
    md["spec"]["decode"]["kvCache"]["dtype"] = "bf16"
    md["spec"]["prefill"]["kvCache"]["dtype"] = "fp8_e4m3"
    md["metadata"]["generation"] = 2
    decision = decide(md, owned, NOW)
    assert decision.apply == [] and decision.prune == []
    got = conditions(decision)
    assert got["PrecisionValid"] == ("False", "KVCacheDtypeMismatch")
    assert {x["type"] for x in decision.events} == {"Ready", "Progressing", "Degraded",
                                                    "PrecisionValid"}


def test_mismatch_events_turn_kv_integrity_false() -> None:
    md, owned = converge(kimi(), ready=True)
    ev = {"kind": "Event", "reason": c.EVENT_REASON_KV_MISMATCH, "type": "Warning", "count": 1,
          "message": "1 request aborted", "involvedObject": {"kind": "Pod", "name": "dec-0"},
          "metadata": {"name": "e1", "namespace": "llm", "labels": {c.LABEL_DEPLOYMENT: "kimi-k2"}}}
    owned[key_of(ev)] = ev
    decision = decide(md, owned, NOW)
    assert decision.apply == []
    assert conditions(decision)["KVIntegrity"] == ("False", "MismatchesDetected")
    assert [x["type"] for x in decision.events] == ["KVIntegrity"]


def test_status_patch_nulls_dropped_keys() -> None:
    assert status_patch({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None
    assert status_patch({"a": 1, "endpoint": "x"}, {"a": 2}) == {"a": 2, "endpoint": None}


class RecordingKube:
    """The API server as far as one reconcile needs it: echoes what is written, and can hold
    the first apply until released (to overlap two reconciles)."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.release = threading.Event()

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.release.wait(5)
        self.applied.append(obj["metadata"]["name"])
        return as_stored(obj, ready=True)

    def patch_status(self, md: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        status = {k: v for k, v in patch.items() if v is not None}
        return {**md, "status": status, "metadata": {**md["metadata"], "resourceVersion": "9"}}

    def post_event(self, *args: Any) -> None:
        pass


def test_events_during_a_reconcile_coalesce_into_one_more_round() -> None:
    kube, store = RecordingKube(), Store()
    md = kimi()
    md["metadata"]["resourceVersion"] = "1"
    store.put(md)
    reconciler = Reconciler(kube, store, render_configs)  # type: ignore[arg-type]
    first = threading.Thread(target=reconciler.reconcile, args=("llm", "kimi-k2"))
    first.start()
    time.sleep(0.2)  # the first run is now inside its first apply
    # Three more events arrive: none blocks, none runs a reconcile of its own.
    assert [reconciler.reconcile("llm", "kimi-k2") for _ in range(3)] == [None, None, None]
    kube.release.set()
    first.join(5)
    # One run applied all 18 children; the coalesced second round found nothing to apply.
    assert len(kube.applied) == 18
    assert reconciler.reconcile("llm", "kimi-k2") == Decision([], [], None, [])


def test_roles_are_applied_before_their_bindings_and_deployments_last() -> None:
    from tessera.operator.reconcile import _apply_waves
    objs = [{"kind": k} for k in ("Deployment", "RoleBinding", "Role", "ConfigMap", "RoleBinding")]
    waves = _apply_waves(objs)
    assert [[o["kind"] for o in w] for w in waves] == [
        ["Role", "ConfigMap"], ["RoleBinding", "RoleBinding"], ["Deployment"]]
    assert _apply_waves([{"kind": "ConfigMap"}]) == [[{"kind": "ConfigMap"}]]


def test_a_listing_replaces_what_is_stored_of_its_kind_only() -> None:
    def obj(kind: str, name: str, version: str) -> dict[str, Any]:
        return {"kind": kind, "metadata": {"namespace": "llm", "name": name,
                                           "resourceVersion": version,
                                           "managedFields": [{"manager": "x"}]}}

    store = Store()
    for o in (obj("LeaderWorkerSet", "gone", "3"), obj("LeaderWorkerSet", "kept", "4"),
              obj("Deployment", "other", "5")):
        store.put(o)
    store.replace("LeaderWorkerSet", [obj("LeaderWorkerSet", "kept", "7"),
                                      obj("LeaderWorkerSet", "new", "8")])
    assert sorted(k for k in store.objects) == [
        ("Deployment", "llm", "other"), ("LeaderWorkerSet", "llm", "kept"),
        ("LeaderWorkerSet", "llm", "new")]
    kept = store.get("LeaderWorkerSet", "llm", "kept")
    assert kept is not None and kept["metadata"]["resourceVersion"] == "7"
    assert "managedFields" not in kept["metadata"]


def test_a_listing_keeps_what_a_watch_stored_after_it_was_taken() -> None:
    def pod(name: str, version: str) -> dict[str, Any]:
        return {"kind": "Pod", "metadata": {"namespace": "llm", "name": name,
                                            "resourceVersion": version}}

    store = Store()
    for p in (pod("deleted-unseen", "5"), pod("listed", "6"), pod("created-since", "12")):
        store.put(p)
    store.put(pod("deleted-since", "7"))
    store.drop(pod("deleted-since", "11"))  # its deletion, handled before the listing's reply
    store.replace("Pod", [pod("listed", "9"), pod("deleted-since", "7")], as_of="10")
    assert {k[2]: o["metadata"]["resourceVersion"] for k, o in store.objects.items()} == {
        "listed": "9", "created-since": "12"}
    # Deletions older than a listing are forgotten at the next listing of any kind (an older
    # Pod listing then stands in to show the tombstone is gone).
    store.drop(pod("created-since", "13"))
    store.replace("Service", [], as_of="14")
    store.replace("Pod", [pod("created-since", "12")], as_of="12")
    assert store.get("Pod", "llm", "created-since") is not None


def test_a_pod_recreated_under_its_name_outlives_the_old_pods_late_deletion() -> None:
    """LWS recreates a group's pods under their old names; kopf handles each uid on its own,
    so the old pod's DELETED event may come after the new pod's ADDED one."""
    def pod(uid: str, version: str) -> dict[str, Any]:
        return {"kind": "Pod", "metadata": {"namespace": "llm", "name": "k2-prefill-0-1",
                                            "uid": uid, "resourceVersion": version}}

    store = Store()
    store.put(pod("old", "10"))
    store.put(pod("new", "12"))
    store.drop(pod("old", "11"))
    held = store.get("Pod", "llm", "k2-prefill-0-1")
    assert held is not None and held["metadata"]["uid"] == "new"
    store.drop(pod("new", "13"))
    assert store.get("Pod", "llm", "k2-prefill-0-1") is None
