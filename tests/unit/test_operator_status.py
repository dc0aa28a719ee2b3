"""Conditions from observed workloads, plan findings and the runtime's mismatch events."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.operator import constants as c
from tessera.operator.conditions import event_type, make_condition, merge_conditions
from tessera.operator.drift import contains, needs_apply
from tessera.operator.status import (
    Workload,
    kv_integrity_condition,
    observe_workload,
    rollout_conditions,
)


def by_type(conditions: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {cond["type"]: (cond["status"], cond["reason"]) for cond in conditions}


def w(desired: int, current: int, ready: int, updated: int, synced: bool = True,
      failure: str = "", settled: bool = True) -> Workload:
    return Workload(desired, current, ready, updated, synced, failure, settled)


DONE = w(2, 2, 2, 2)


@pytest.mark.parametrize("workloads, ready, progressing, degraded, names", [
    ({"prefill": DONE, "decode": DONE, "router": w(1, 1, 1, 1)},
     ("True", "AllReady"), ("False", "RolloutComplete"), ("False", "AsExpected"), []),
    ({"prefill": DONE, "decode": None, "router": w(1, 1, 1, 1)},
     ("False", "ComponentsNotReady"), ("True", "RollingOut"), ("False", "AsExpected"),
     ["decode not created"]),
    # decode rolling: one new pod not ready yet, one old pod still serving
    ({"prefill": DONE, "decode": w(2, 2, 1, 1), "router": w(1, 1, 1, 1)},
     ("False", "ComponentsNotReady"), ("True", "RollingOut"), ("False", "AsExpected"),
     ["decode 1/2 ready"]),
    # the Deployment controller has not seen the new spec yet
    ({"prefill": DONE, "decode": w(2, 2, 2, 2, synced=False), "router": w(1, 1, 1, 1)},
     ("False", "ComponentsNotReady"), ("True", "RollingOut"), ("False", "AsExpected"),
     ["decode 2/2 ready"]),
    # new pods created but not ready yet: still rolling out, not degraded
    ({"prefill": DONE, "decode": w(2, 2, 0, 2, settled=False), "router": w(1, 1, 1, 1)},
     ("False", "ComponentsNotReady"), ("True", "RollingOut"), ("False", "AsExpected"),
     ["decode 0/2 ready"]),
    # a pod lost outside any rollout
    ({"prefill": DONE, "decode": DONE, "router": w(1, 1, 0, 1)},
     ("False", "ComponentsNotReady"), ("False", "RolloutComplete"),
     ("True", "ReplicasUnavailable"), ["router 0/1 ready"]),
    ({"prefill": w(1, 1, 0, 1, failure="exceeded quota"), "decode": DONE,
      "router": w(1, 1, 1, 1)},
     ("False", "ComponentsNotReady"), ("False", "RolloutComplete"),
     ("True", "ReplicasUnavailable"), ["prefill 0/1 ready"]),
], ids=["all-ready", "missing", "rolling", "unsynced", "starting", "lost-pod", "failing"])
def test_rollout_conditions(workloads: dict[str, Workload | None], ready: tuple[str, str],
                            progressing: tuple[str, str], degraded: tuple[str, str],
                            names: list[str]) -> None:
    conds = rollout_conditions(workloads, planned=True, generation=3)
    got = by_type(conds)
    assert (got["Ready"], got["Progressing"], got["Degraded"]) == (ready, progressing, degraded)
    ready_message = conds[0]["message"]
    for name in names:
        assert name in ready_message  # Ready says which component is not ready
    assert all(cond["observedGeneration"] == 3 for cond in conds)


def test_a_spec_not_admitted_is_not_ready_and_not_progressing() -> None:
    got = by_type(rollout_conditions({"single": None, "router": None}, planned=False,
                                     generation=1))
    assert got == {"Ready": ("False", "NotAdmitted"), "Progressing": ("False", "NotAdmitted"),
                   "Degraded": ("False", "NotAdmitted")}


def event(pod: str, count: int, when: str, message: str = "3 requests aborted") -> dict[str, Any]:
    return {"kind": "Event", "reason": c.EVENT_REASON_KV_MISMATCH, "type": "Warning",
            "involvedObject": {"kind": "Pod", "name": pod}, "count": count,
            "lastTimestamp": when, "message": message}


def test_kv_integrity_disabled_is_unknown() -> None:
    cond = kv_integrity_condition(False, [event("p", 1, "t")], 1)
    assert (cond["status"], cond["reason"]) == ("Unknown", "Disabled")


def test_kv_integrity_without_mismatches_is_true() -> None:
    cond = kv_integrity_condition(True, [], 1)
    assert (cond["status"], cond["reason"]) == ("True", "NoMismatches")


def test_kv_integrity_mismatches_name_counts_and_pods() -> None:
    events = [event("decode-a", 2, "2026-01-01T00:00:01Z", "2 requests aborted"),
              event("decode-b", 1, "2026-01-01T00:00:09Z", "5 requests aborted")]
    cond = kv_integrity_condition(True, events, 4)
    assert (cond["status"], cond["reason"]) == ("False", "MismatchesDetected")
    assert cond["message"].startswith("3 mismatch report(s) from pod(s) decode-a, decode-b")
    assert cond["message"].endswith("latest from decode-b: 5 requests aborted")


def test_merge_keeps_transition_time_while_status_holds() -> None:
    old = [{**make_condition("Ready", "False", "ComponentsNotReady", "decode 0/1", 1),
            "lastTransitionTime": "T0"}]
    same = [make_condition("Ready", "False", "ComponentsNotReady", "decode 1/2", 2)]
    merged, changed = merge_conditions(old, same, "T1")
    assert merged[0]["lastTransitionTime"] == "T0" and changed == []
    flipped = [make_condition("Ready", "True", "AllReady", "ok", 2)]
    merged, changed = merge_conditions(old, flipped, "T2")
    assert merged[0]["lastTransitionTime"] == "T2" and [x["type"] for x in changed] == ["Ready"]


@pytest.mark.parametrize("type_, status, expected", [
    ("Ready", "False", "Warning"), ("Ready", "True", "Normal"), ("Degraded", "True", "Warning"),
    ("PrecisionValid", "False", "Warning"), ("KVIntegrity", "False", "Warning"),
    ("KVIntegrity", "Unknown", "Normal"), ("Progressing", "True", "Normal"),
])
def test_event_type(type_: str, status: str, expected: str) -> None:
    assert event_type(make_condition(type_, status, "R", "m", 1)) == expected


def test_observe_workload_reads_deployment_status() -> None:
    deployment = {"metadata": {"generation": 4}, "spec": {"replicas": 2},
                  "status": {"observedGeneration": 4, "replicas": 3, "readyReplicas": 2,
                             "updatedReplicas": 1,
                             "conditions": [{"type": "Progressing", "status": "False",
                                             "reason": "ProgressDeadlineExceeded",
                                             "message": "took too long"}]}}
    assert observe_workload(deployment) == Workload(2, 3, 2, 1, True, "took too long", False)
    assert observe_workload(None) is None


@pytest.mark.parametrize("observed, desired, expected", [
    ({"a": 1, "b": 2}, {"a": 1}, True),  # extra fields (defaults, other managers) are fine
    ({"a": 1}, {"a": 2}, False),
    ({}, {"a": 1}, False),
    ({"l": [{"x": 1, "y": 0}]}, {"l": [{"x": 1}]}, True),
    ({"l": [{"x": 1}, {"x": 2}]}, {"l": [{"x": 1}]}, False),  # lists we set are ours whole
    ({"l": [{"x": 2}]}, {"l": [{"x": 1}]}, False),
    ({"m": {"k": "v", "z": "w"}}, {"m": {"k": "v"}}, True),
    ({"n": "1"}, {"n": 1}, False),
    ({}, {"readOnly": False, "items": [], "n": 0}, True),  # the server omits zero values
    ({}, {"readOnly": True}, False),
])
def test_contains(observed: Any, desired: Any, expected: bool) -> None:
    assert contains(observed, desired) is expected


def test_needs_apply_when_absent_or_terminating() -> None:
    desired = {"metadata": {"name": "x"}}
    assert needs_apply(desired, None)
    assert needs_apply(desired, {"metadata": {"name": "x", "deletionTimestamp": "t"}})
    assert not needs_apply(desired, {"metadata": {"name": "x", "uid": "u"}})
