"""LeaderWorkerSet groups stranded by their own affinity, and which one to restart (pure).

With `nodePool.replicaTopologyKey` every pod of a group must share one block (children.py,
`group_affinity`). The scheduler places one pod at a time and never moves a placed one, so a
leader can land in a block with no room left for its workers: two groups' leaders in a block
that holds one group, or a block whose other nodes were still taken when the leader came
(seen in the e2e when the previous test's pods were leaving). The workers then wait for good
while nodes elsewhere stand free. Workers placed before their leader can do the same to it:
they fill a block that then has no room for the leader. Restarting the group (deleting its
leader: LWS recreates the whole group) lets the new leader go where the group fits, and frees
its node for the group that was there first.

A worker counts as stranded only when the scheduler refused some nodes for pod affinity alone
(they had the room): a pool that is simply full restarts nothing. Its wait counts from when the
operator first saw it so refused (`affinity_refusals`, remembered by the caller): the pod's
own condition dates from when it first could not be placed, which may be long before any node
had room, and a group restarted on that date would give a block about to free up no chance.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import constants as c

# The scheduler's words for a node refused by a pod's (anti-)affinity, in its FailedScheduling
# message (InterPodAffinity's ErrReasonAffinityRulesNotMatch, the same since Kubernetes 1.20).
AFFINITY_REFUSAL = "didn't match pod affinity rules"
# How long a worker may wait so before its group restarts: the scheduler retries an
# unschedulable pod at least every 5 minutes and at once when a pod or node changes, so a
# block that is about to free up has had its chance by then.
STRANDED_AFTER_S = 120.0


def restart_window(in_a_row: int, after_s: float = STRANDED_AFTER_S) -> float:
    """How long a phase waits after its `in_a_row`-th restart in a row before it restarts a
    group again: the patience, doubling with each restart in a row, at most 16 times it. A
    group that fits in no block at all is then not restarted every few minutes for good."""
    return after_s * 2 ** min(in_a_row - 1, 4)


@dataclass(frozen=True)
class StrandedGroup:
    phase: str
    group: str  # LWS group index
    leader: Mapping[str, Any]  # the pod whose deletion restarts the group
    node: str  # where the leader runs ("": it waits for room beside its workers)
    waited_s: float  # the longest a worker (or the unplaced leader) of the group has waited
    said: str  # the scheduler's last words on that pod

    def message(self, topology_key: str) -> str:
        if not self.node:  # the workers came first and took a block without room for the leader
            return (f"{self.phase} group {self.group}: its workers' block ({topology_key}) has no "
                    f"room for its leader, which waited {self.waited_s:.0f} s while nodes outside "
                    f"it had room ({self.said}); restarted the group so that it can start where "
                    "the whole group fits")
        return (f"{self.phase} group {self.group}: its leader's block ({topology_key} of node "
                f"{self.node}) has no room for its workers, which waited {self.waited_s:.0f} s "
                f"while nodes outside it had room ({self.said}); restarted the group so that "
                "its leader can go where the whole group fits")


def _time(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _refused_for_affinity(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message on a pod it cannot place while some nodes were refused for pod
    affinity alone; None otherwise."""
    for cond in pod.get("status", {}).get("conditions") or []:
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
                and AFFINITY_REFUSAL in cond.get("message", "")):
            return str(cond["message"])
    return None


def affinity_refusals(pods: Iterable[Mapping[str, Any]], seen: Mapping[str, str],
                      now: str) -> dict[str, str]:
    """Pod uid -> since when each pod refused for pod affinity now has been seen so: kept from
    `seen` (the previous answer), else `now`. A pod placed or gone drops out, so a later
    refusal starts its wait anew."""
    return {uid: seen.get(uid, now) for pod in pods
            if _refused_for_affinity(pod) is not None and (uid := pod["metadata"]["uid"])}


def stranded_groups(pods: Iterable[Mapping[str, Any]], now: str,
                    refused_since: Mapping[str, str], after_s: float = STRANDED_AFTER_S,
                    settling: Collection[str] = ()) -> list[StrandedGroup]:
    """Per phase, the stranded group to restart now: a group whose leader runs on a node and
    one of whose workers has been refused for pod affinity for `after_s` or longer (since
    `refused_since[uid]`, from `affinity_refusals`), or whose leader has been so refused while a
    worker of its group runs (the workers came first). One a phase at a time (the highest group
    index), and none in a phase that is `settling` (it restarted a group within its restart
    window: the caller remembers) or whose leaders include one younger than `after_s` (a group
    rolled out moments ago), so that two groups stranded in one block do not both leave it:
    the one that stays gets the freed node."""
    now_t = _time(now)

    def age(stamp: str) -> float:
        return (now_t - _time(stamp)).total_seconds()

    leaders: dict[tuple[str, str], Mapping[str, Any]] = {}
    unplaced_leaders: dict[tuple[str, str], Mapping[str, Any]] = {}
    workers: list[tuple[tuple[str, str], Mapping[str, Any]]] = []
    for pod in pods:
        meta = pod["metadata"]
        labels = meta.get("labels", {})
        group = labels.get(c.LWS_LABEL_GROUP_INDEX)
        if group is None or meta.get("deletionTimestamp"):
            continue
        key = (labels.get(c.LABEL_PHASE, ""), group)
        if labels.get(c.LWS_LABEL_WORKER_INDEX) != c.LWS_LEADER_INDEX:
            workers.append((key, pod))
        elif pod.get("spec", {}).get("nodeName"):
            leaders[key] = pod
        else:
            unplaced_leaders[key] = pod
    waiting: dict[tuple[str, str], tuple[float, str]] = {}
    for key, pod in workers:
        said = _refused_for_affinity(pod)
        if said is None or (since := refused_since.get(pod["metadata"]["uid"])) is None:
            continue
        leader = leaders.get(key)
        # A worker older than its leader is a restarted group's leftover, on its way out.
        if leader is None or _time(pod["metadata"]["creationTimestamp"]) < \
                _time(leader["metadata"]["creationTimestamp"]):
            continue
        waited = age(since)
        if waited > waiting.get(key, (-1.0, ""))[0]:
            waiting[key] = (waited, said)
    # A leader refused for affinity while a worker of its group runs: the worker came first and
    # took a block with no room left for the leader (the scheduler places pods in any order).
    placed_workers = {key for key, pod in workers if pod.get("spec", {}).get("nodeName")}
    for key, leader in unplaced_leaders.items():
        if key not in placed_workers:
            continue
        said = _refused_for_affinity(leader)
        if said is None or (since := refused_since.get(leader["metadata"]["uid"])) is None:
            continue
        leaders[key] = leader
        waiting[key] = (age(since), said)
    settling = {*settling, *(phase for (phase, _), leader in leaders.items()
                             if age(leader["metadata"]["creationTimestamp"]) < after_s)}
    due = sorted((key for key, (waited, _) in waiting.items()
                  if waited >= after_s and key[0] not in settling),
                 key=lambda k: (k[0], int(k[1])), reverse=True)
    picked: dict[str, StrandedGroup] = {}
    for phase, group in due:
        if phase not in picked:
            leader = leaders[(phase, group)]
            waited, said = waiting[(phase, group)]
            picked[phase] = StrandedGroup(phase, group, leader,
                                          leader.get("spec", {}).get("nodeName", ""), waited, said)
    return [picked[phase] for phase in sorted(picked)]
