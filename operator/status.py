"""Status from the plan and the observed children (pure).

Ready is True only when every phase and the router have all their replicas updated and ready;
otherwise its message names each component that is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.operator import constants as c
from tessera.operator.children import phases_of, router_endpoint
from tessera.operator.conditions import (
    FALSE,
    TRUE,
    UNKNOWN,
    Condition,
    make_condition,
    merge_conditions,
)
from tessera.operator.refusals import Refusal, first_reason
from tessera.operator.weights import WeightsJob, weights_condition
from tessera.runtime.planner import DeploymentPlan, PlanError

Obj = dict[str, Any]


@dataclass(frozen=True)
class Workload:
    """One observed Deployment, reduced to what status needs."""

    desired: int
    current: int  # pods of any template
    ready: int
    updated: int
    synced: bool  # the Deployment controller has seen the latest spec
    failure: str  # the Deployment's ProgressDeadlineExceeded message, else ""
    # The Deployment says its newest ReplicaSet has become available (rollout done); after
    # that, a replica short of ready is a loss, not a pod still starting.
    settled: bool = True
    # The Deployment's ReplicaFailure message: the API server would not create its pods
    # (quota, Pod Security); refusals.creation_refusal reads it.
    replica_failure: str = ""

    @property
    def complete(self) -> bool:
        return (self.synced and self.updated >= self.desired and self.ready >= self.desired
                and self.current == self.desired)

    @property
    def rolling(self) -> bool:
        return (not self.synced or not self.settled or self.updated < self.desired
                or self.current > self.desired)


def observe_workload(deployment: Mapping[str, Any] | None) -> Workload | None:
    if deployment is None:
        return None
    spec, st = deployment.get("spec", {}), deployment.get("status", {})
    conditions = st.get("conditions", [])
    stalled = [cond.get("message", "") for cond in conditions
               if cond.get("reason") == "ProgressDeadlineExceeded"]
    refused = [cond.get("message", "") for cond in conditions
               if cond.get("type") == "ReplicaFailure" and cond.get("status") == TRUE]
    return Workload(
        desired=int(spec.get("replicas", 1)),
        current=int(st.get("replicas", 0)),
        ready=int(st.get("readyReplicas", 0)),
        updated=int(st.get("updatedReplicas", 0)),
        synced=st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0),
        failure="; ".join(stalled),
        settled=any(cond.get("type") == "Progressing" and cond.get("reason") ==
                    "NewReplicaSetAvailable" for cond in conditions),
        replica_failure="; ".join(refused),
    )


def observe_group_set(lws: Mapping[str, Any] | None,
                      pods: Iterable[Mapping[str, Any]] = ()) -> Workload | None:
    """One observed LeaderWorkerSet and its pods. Its counts are of groups (replicas): LWS
    counts a group ready only when its leader and every worker are, so a lost pod makes its
    whole replica unready. Its count can lag the pods (seen: a worker Pending on a cordoned
    node, and a restarted group whose new leader ran before its worker existed, while
    readyReplicas stayed 2 of 2), so once any pod of the set is seen, a group counts only
    with all its pods seen, Ready and not being deleted, whatever LWS says; a group of which
    no pod is seen then is one being recreated (its old pods gone, its new ones not yet
    reported). LWS publishes no observedGeneration: a spec change shows up once its
    controller marks UpdateInProgress, one reconcile of it after the apply."""
    if lws is None:
        return None
    spec, st = lws.get("spec", {}), lws.get("status", {})
    desired = int(spec.get("replicas", 1))
    size = int(spec.get("leaderWorkerTemplate", {}).get("size", 1))
    seen_pods: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        seen_pods.setdefault(pod["metadata"].get("labels", {}).get(c.LWS_LABEL_GROUP_INDEX, ""),
                             []).append(pod)

    def whole(members: list[Mapping[str, Any]]) -> bool:
        return len(members) == size and all(
            _pod_ready(p) and not p["metadata"].get("deletionTimestamp") for p in members)

    whole_groups = sum(whole(seen_pods.get(str(i), [])) for i in range(desired))
    true = {cond.get("type") for cond in st.get("conditions", [])
            if cond.get("status") == TRUE}
    seen = {cond.get("type") for cond in st.get("conditions", [])}
    return Workload(
        desired=desired,
        current=int(st.get("replicas", 0)),
        ready=min(int(st.get("readyReplicas", 0)), whole_groups if seen_pods else desired),
        updated=int(st.get("updatedReplicas", 0)),
        synced="UpdateInProgress" not in true,
        failure="",
        # Available was reached once and no template rollout runs: a group short of ready
        # now is a loss (its pod died, its node went), not a group still starting.
        settled="Available" in seen and "UpdateInProgress" not in true,
    )


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(cond.get("type") == "Ready" and cond.get("status") == TRUE
               for cond in pod.get("status", {}).get("conditions", []) or [])


def plan_conditions(plan: DeploymentPlan | None, error: PlanError | None,
                    generation: int) -> list[Condition]:
    """PrecisionValid and CapacityPlanned as the planner decides them; a spec it cannot read
    at all fails CapacityPlanned with its reason and leaves PrecisionValid unknown."""
    if plan is None:
        assert error is not None
        return [make_condition(c.PRECISION_VALID, UNKNOWN, "NotPlanned", str(error), generation),
                make_condition(c.CAPACITY_PLANNED, FALSE, error.reason, str(error), generation)]
    out = []
    for type_ in (c.PRECISION_VALID, c.CAPACITY_PLANNED):
        cond = plan.condition(type_)
        out.append(make_condition(type_, TRUE if cond.status else FALSE, cond.reason,
                                  cond.message, generation))
    return out


def rollout_conditions(workloads: Mapping[str, Workload | None], planned: bool,
                       generation: int, waiting: Mapping[str, str] | None = None,
                       refusals: Sequence[Refusal] = ()) -> list[Condition]:
    """Ready, Progressing and Degraded from each component's workload (None: not there yet);
    `waiting` says why a component not there yet is held back (its weights); `refusals` say
    what the cluster or the engine refused: Degraded lists them all, Ready quotes each
    not-ready component's own, and both take the reason of the most fundamental one."""
    if not planned:
        why = "the spec was not admitted (see PrecisionValid and CapacityPlanned)"
        return [make_condition(c.READY, FALSE, "NotAdmitted", why, generation),
                make_condition(c.PROGRESSING, FALSE, "NotAdmitted", why, generation),
                make_condition(c.DEGRADED, FALSE, "NotAdmitted", why, generation)]
    missing = [name for name, w in workloads.items() if w is None]
    present = {name: w for name, w in workloads.items() if w is not None}
    unready = [(name, f"{name} {w.ready}/{w.desired} ready") for name, w in present.items()
               if not w.complete]
    rolling = [name for name, w in present.items() if w.rolling]
    failing = [f"{name}: {w.failure}" for name, w in present.items() if w.failure]
    # Replicas lost outside a rollout (a crashed or evicted pod, a node gone).
    short = [name for name, w in present.items() if not w.rolling and w.ready < w.desired]

    waiting = waiting or {}
    said: dict[str, list[str]] = {}
    for refusal in refusals:
        said.setdefault(refusal.component, []).append(refusal.message)

    def quoting(name: str, text: str) -> str:
        return f"{text}: {'; '.join(said[name])}" if name in said else text

    not_ready = [*said.get("", []),
                 *(quoting(name, f"{name} waits for its weights: {waiting[name]}"
                           if name in waiting else f"{name} not created") for name in missing),
                 *(quoting(name, text) for name, text in unready)]
    reason = first_reason(refusals) if refusals else None
    ready = (make_condition(c.READY, FALSE, reason or "ComponentsNotReady", "; ".join(not_ready),
                            generation)
             if not_ready else
             make_condition(c.READY, TRUE, "AllReady",
                            "all phases and the router are ready", generation))
    progressing = (
        make_condition(c.PROGRESSING, TRUE, "RollingOut",
                       "rolling out: " + ", ".join(missing + rolling), generation)
        if missing or rolling else
        make_condition(c.PROGRESSING, FALSE, "RolloutComplete", "every component is up to date",
                       generation))
    def counted(name: str) -> str:
        w = present.get(name)
        return f"{name} {w.ready}/{w.desired} ready" if w else name

    problems = [*said.get("", []),
                *(f"{counted(name)}: {'; '.join(said[name])}" for name in workloads
                  if name in said),
                *failing, *(counted(name) for name in short if name not in said)]
    degraded = (make_condition(c.DEGRADED, TRUE, reason or "ReplicasUnavailable",
                               "; ".join(problems), generation)
                if problems else
                make_condition(c.DEGRADED, FALSE, "AsExpected", "no replica is missing",
                               generation))
    return [ready, progressing, degraded]


def kv_integrity_condition(enabled: bool, mismatch_events: Sequence[Mapping[str, Any]],
                           generation: int) -> Condition:
    """From the runtime's KVIntegrityMismatch Events (Warning, involvedObject = the pod)."""
    if not enabled:
        return make_condition(c.KV_INTEGRITY, UNKNOWN, "Disabled",
                              "spec.integrity.enabled is false: KV pages are not checked",
                              generation)
    if not mismatch_events:
        return make_condition(c.KV_INTEGRITY, TRUE, "NoMismatches",
                              "no KV page mismatch reported", generation)
    latest = max(mismatch_events, key=_event_time)
    pods = sorted({e.get("involvedObject", {}).get("name", "?") for e in mismatch_events})
    occurrences = sum(int(e.get("count") or 1) for e in mismatch_events)
    message = (f"{occurrences} mismatch report(s) from pod(s) {', '.join(pods)}; latest from "
               f"{latest.get('involvedObject', {}).get('name', '?')}: {latest.get('message', '')}")
    return make_condition(c.KV_INTEGRITY, FALSE, "MismatchesDetected", message, generation)


def _event_time(event: Mapping[str, Any]) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime")
               or event.get("metadata", {}).get("creationTimestamp") or "")


def _phase_status(phase_spec: Mapping[str, Any], workload: Workload | None,
                  planned: Obj | None) -> Obj:
    w = workload or Workload(int(phase_spec.get("replicas", 1)), 0, 0, 0, False, "")
    # The planner's precision is the effective one (its defaults applied); without a plan,
    # the spec's.
    precision = planned["precision"] if planned else {
        "weights": phase_spec["weights"].get("dtype", "bf16"),
        "kvCache": phase_spec.get("kvCache", {}).get("dtype", "bf16")}
    return {"replicas": w.desired, "readyReplicas": w.ready, "updatedReplicas": w.updated,
            "precision": dict(precision)}


def build_status(md: Mapping[str, Any], plan: DeploymentPlan | None, error: PlanError | None,
                 workloads: Mapping[str, Workload | None],
                 mismatch_events: Sequence[Mapping[str, Any]],
                 now: str, weights: Sequence[WeightsJob] = (),
                 refusals: Sequence[Refusal] = ()) -> tuple[Obj, list[Condition]]:
    """The whole new status, and the conditions that changed since the old one.

    `workloads` maps each phase and "router" to its observed Deployment (None: absent);
    `plan` is None when the planner could not read the spec (then `error` says why);
    `weights` are the fetch and conversion Jobs the phases wait for (WeightsReady);
    `refusals` are what the cluster or the engine refused (refusals.py).
    """
    spec, generation = md["spec"], md["metadata"].get("generation", 1)
    old = md.get("status") or {}
    admitted = plan is not None and plan.ok
    waiting = {phase: job.message for job in weights if not job.ready
               for phase in job.ref.phases}
    conditions = [*rollout_conditions(workloads, admitted, generation, waiting, refusals),
                  *plan_conditions(plan, error, generation),
                  kv_integrity_condition(spec.get("integrity", {}).get("enabled", False),
                                         mismatch_events, generation)]
    if weights:
        conditions.append(weights_condition(weights, generation))
    merged, changed = merge_conditions(old.get("conditions", []), conditions, now)
    phases = phases_of(spec)
    status: Obj = {"observedGeneration": generation, "conditions": merged}
    planned = plan.to_status() if plan is not None else {}
    for phase in phases:
        status[phase] = _phase_status(spec[phase], workloads.get(phase), planned.get(phase))
    router = workloads.get(c.ROUTER)
    status[c.ROUTER] = {"replicas": router.desired if router else
                        int(spec.get("router", {}).get("replicas", 1)),
                        "readyReplicas": router.ready if router else 0}
    status["summary"] = {
        "replicas": ", ".join(f"{p} {status[p]['readyReplicas']}/{status[p]['replicas']}"
                              for p in phases),
        "kvCache": " ".join(f"{p}={status[p]['precision']['kvCache']}" for p in phases),
        "weights": " ".join(f"{p}={status[p]['precision']['weights']}" for p in phases),
    }
    if plan is not None:
        status["plan"] = planned
    if admitted:
        status["endpoint"] = router_endpoint(md)
    return status, changed
