"""Why the cluster or the engine said no, in the cluster's own words (pure).

Every refusal becomes a `Refusal`: the component it hit (a phase, the router, or "" for the
deployment as a whole), a condition reason naming the refusal, and a message quoting the
API server, the admission controller, the quota, the scheduler or the engine's container.
status.py turns them into Ready and Degraded.

Where each comes from:
- a child the API server refuses on apply (schema, admission webhook or policy, RBAC): the
  error the apply returned (`Rejection`);
- pods the API server refuses to create (quota, Pod Security): the ReplicaSet's FailedCreate,
  which the Deployment repeats as its ReplicaFailure condition;
- pods the scheduler cannot place: the pod's PodScheduled=False condition;
- an engine that exits: the container's termination state (exit code and message).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.operator import constants as c
from tessera.operator.children import gpus_per_replica, phase_scheduling

CHILD_REJECTED = "ChildRejected"
POD_SECURITY_REJECTED = "PodSecurityRejected"
QUOTA_EXCEEDED = "QuotaExceeded"
PODS_REJECTED = "PodsRejected"
UNSCHEDULABLE = "Unschedulable"
ENGINE_FAILED = "EngineFailed"
# Most fundamental first: a condition that lists several refusals takes the first one's reason.
REASONS = (CHILD_REJECTED, POD_SECURITY_REJECTED, QUOTA_EXCEEDED, PODS_REJECTED, UNSCHEDULABLE,
           ENGINE_FAILED)

# Container waiting reasons that mean the engine will not come up by itself.
STUCK_WAITING = frozenset({"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull",
                           "InvalidImageName", "CreateContainerConfigError",
                           "CreateContainerError", "RunContainerError"})

# Retries of a rejected apply wait BACKOFF_BASE_S, doubling up to BACKOFF_CAP_S.
BACKOFF_BASE_S = 2.0
BACKOFF_CAP_S = 300.0


@dataclass(frozen=True)
class Refusal:
    component: str  # a phase, "router", or "" for the deployment as a whole
    reason: str  # one of REASONS
    message: str  # names the object and quotes the cluster


@dataclass(frozen=True)
class Rejection:
    """A child the API server refused to apply."""

    kind: str
    name: str
    code: int  # the HTTP status
    message: str  # the API server's own words

    def refusal(self) -> Refusal:
        return Refusal("", CHILD_REJECTED, f"{self.kind} {self.name} was rejected by the API "
                                           f"server ({self.code}): {self.message}")


class RejectedError(Exception):
    """Raised by the API adapter when the API server refuses to apply a child."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.refusal().message)
        self.rejection = rejection


class NamespaceGone(Exception):
    """Raised by the API adapter when a child cannot be created because its namespace is
    being deleted or is gone: everything in it, the ModelDeployment included, is going, so
    this is neither reported nor retried."""


def namespace_gone(body: str | bytes | None) -> bool:
    """Whether a Kubernetes Status answer refuses because the namespace is being deleted
    (403, cause NamespaceTerminating) or no longer exists (404 for the namespace itself)."""
    try:
        status = json.loads(body or "")
    except ValueError:
        return False
    details = (status.get("details") if isinstance(status, dict) else None) or {}
    if status.get("reason") == "NotFound" and details.get("kind") == "namespaces":
        return True
    return any(cause.get("reason") == "NamespaceTerminating"
               for cause in details.get("causes") or [])


def is_refusal(code: int) -> bool:
    """Whether an API error is the cluster saying no (bad request, forbidden, invalid, a
    webhook's denial), which retrying unchanged will not fix, rather than a passing failure
    (timeouts, throttling, the server itself failing)."""
    return 400 <= code < 500 and code not in (404, 408, 409, 429)


def api_message(body: str | bytes | None, fallback: str) -> str:
    """The `message` of a Kubernetes Status answer, else `fallback`."""
    try:
        status = json.loads(body or "")
    except ValueError:
        return fallback
    message = status.get("message") if isinstance(status, dict) else None
    return str(message) if message else fallback


def backoff_seconds(attempt: int) -> float:
    """The wait before retry number `attempt` (1, 2, ...) of a rejected apply."""
    return float(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempt - 1)))


def creation_refusal(component: str, replica_failure: str) -> Refusal | None:
    """The refusal behind a Deployment's ReplicaFailure message (its ReplicaSet's
    FailedCreate): the API server would not create the pods."""
    if not replica_failure:
        return None
    if "exceeded quota" in replica_failure:
        reason = QUOTA_EXCEEDED
    elif "violates PodSecurity" in replica_failure:
        reason = POD_SECURITY_REJECTED
    else:
        reason = PODS_REJECTED
    return Refusal(component, reason, f"pods not created: {replica_failure}")


def _condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    return next((x for x in pod.get("status", {}).get("conditions", []) or []
                 if x.get("type") == type_), {})


def _engine_failure(status: Mapping[str, Any]) -> str:
    """What a container status says about a container that failed, or ""."""
    state, last = status.get("state") or {}, status.get("lastState") or {}
    waiting = state.get("waiting") or {}
    # A container running again after an exit is judged by its probes, not its past.
    terminated = state.get("terminated") or (last.get("terminated") if waiting else None) or {}
    stuck = waiting.get("reason") in STUCK_WAITING
    if not stuck and int(terminated.get("exitCode", 0) or 0) == 0:
        return ""
    parts = []
    if terminated and int(terminated.get("exitCode", 0) or 0) != 0:
        said = terminated.get("message") or terminated.get("reason") or "no termination message"
        parts.append(f"exited with code {terminated['exitCode']}: {said.strip()}")
    if stuck:
        restarts = int(status.get("restartCount", 0) or 0)
        parts.append(f"{waiting['reason']} after {restarts} restart(s)" if
                     waiting["reason"] == "CrashLoopBackOff" else
                     f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": "))
    return f"container {status.get('name', '?')} " + "; ".join(parts)


NAMED_PODS = 3  # pods named in one message; the rest are counted


def _some(names: Sequence[str]) -> str:
    more = len(names) - NAMED_PODS
    return ", ".join(names[:NAMED_PODS]) + (f" and {more} more" if more > 0 else "")


def pod_refusals(component: str, pods: Iterable[Mapping[str, Any]],
                 need: str = "") -> list[Refusal]:
    """Pods the scheduler cannot place and engines that exited, one refusal per distinct
    message (pods refused for the same words are named together); `need` (pool_need) is
    added to what the scheduler said."""
    found: dict[tuple[str, str], list[str]] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        scheduled = _condition(pod, "PodScheduled")
        if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
            found.setdefault((UNSCHEDULABLE, scheduled.get("message", "")), []).append(
                meta["name"])
        status = pod.get("status", {})
        statuses = [*(status.get("initContainerStatuses") or []),
                    *(status.get("containerStatuses") or [])]
        for failure in filter(None, map(_engine_failure, statuses)):
            found.setdefault((ENGINE_FAILED, failure), []).append(meta["name"])
    out = []
    for (reason, said), names in found.items():
        who = f"pod {names[0]}" if len(names) == 1 else f"pods {_some(names)}"
        out.append(Refusal(component, reason,
                           f"{who} unschedulable: {said}{f' ({need})' if need else ''}"
                           if reason == UNSCHEDULABLE else f"{who}: {said}"))
    return out


def pool_need(replicas: int, gpus_per_replica: int, gpus_per_node: int,
              selector: Mapping[str, str]) -> str:
    """How many nodes a phase needs, for a message about pods that cannot be placed: a
    replica no wider than a node keeps its GPUs on one node (so a node holds
    gpus_per_node // gpus_per_replica of them); a wider one takes whole nodes."""
    if gpus_per_replica > gpus_per_node:
        nodes, free = replicas * -(-gpus_per_replica // gpus_per_node), gpus_per_node
    else:
        per_node = gpus_per_node // max(1, gpus_per_replica)
        nodes, free = -(-replicas // per_node), gpus_per_replica * min(per_node, replicas)
    where = ", ".join(f"{k}={v}" for k, v in sorted(selector.items())) or "any node"
    return (f"{replicas} replica(s) x {gpus_per_replica} GPU(s) need {nodes} node(s) with "
            f"{free} free GPU(s) each, matching {where}")


def first_reason(refusals: Sequence[Refusal]) -> str:
    return min((r.reason for r in refusals), key=REASONS.index)


def observe_refusals(spec: Mapping[str, Any], replica_failures: Mapping[str, str],
                     pods: Iterable[Mapping[str, Any]],
                     rejections: Sequence[Rejection] = ()) -> list[Refusal]:
    """Every refusal of one deployment: its rejected children, then per component (the
    phases and the router, in `replica_failures`' order, each mapped to its Deployment's
    ReplicaFailure message) the pods not created, not placed, or whose engine exited."""
    by_component: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        component = pod["metadata"].get("labels", {}).get(c.LABEL_PHASE, "")
        by_component.setdefault(component, []).append(pod)
    gpus_per_node = int(spec.get("nodePool", {}).get("gpu", {}).get("perNode", 8))
    out = [r.refusal() for r in rejections]
    for component, failure in replica_failures.items():
        if (created := creation_refusal(component, failure)) is not None:
            out.append(created)
        need = ""
        if component in spec and component in c.PHASES:
            need = pool_need(int(spec[component].get("replicas", 1)),
                             gpus_per_replica(spec[component]), gpus_per_node,
                             phase_scheduling(spec, component).get("nodeSelector", {}))
        out += pod_refusals(component, by_component.get(component, []), need)
    return out
