"""Which LeaderWorkerSet groups are stranded by their own affinity (operator/stranded.py)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import yaml
from tessera.operator import constants as c
from tessera.operator.reconcile import GROUP_RESTARTED, Reconciler, Store
from tessera.operator.render import render_configs
from tessera.operator.stranded import affinity_refusals, restart_window, stranded_groups
from test_operator_refusals import RejectingKube

NOW = "2026-12-05T10:00:00Z"
# The scheduler's messages (kube-scheduler 1.34, from the e2e) for a worker whose leader's block
# is full while the other block has room, and for one in a pool with no room at all.
STRANDED = ("0/8 nodes are available: 2 Insufficient nvidia.com/gpu, 2 node(s) didn't match pod "
            "affinity rules, 4 node(s) didn't match Pod's node affinity/selector.")
FULL = ("0/8 nodes are available: 4 Insufficient nvidia.com/gpu, 4 node(s) didn't match Pod's "
        "node affinity/selector.")


def pod(phase: str, group: int, worker: int, node: str = "", refused: str = "",
        since: str = "2026-12-05T09:57:00Z", deleting: bool = False,
        created: str = "2026-12-05T09:56:00Z") -> dict[str, Any]:
    name = f"md-{phase}-{group}" + (f"-{worker}" if worker else "")
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "creationTimestamp": created,
                            "labels": {c.LABEL_PHASE: phase, c.LWS_LABEL_GROUP_INDEX: str(group),
                                       c.LWS_LABEL_WORKER_INDEX: str(worker)}}
    if deleting:
        meta["deletionTimestamp"] = NOW
    conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                   "message": refused, "lastTransitionTime": since}] if refused else []
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"conditions": conditions}}


def seen(pods: list[dict[str, Any]]) -> dict[str, str]:
    """Since when the operator has seen each pod refused for pod affinity: here, as if from
    when the scheduler first could not place it."""
    return {p["metadata"]["uid"]: cond["lastTransitionTime"] for p in pods
            for cond in p["status"]["conditions"] if "pod affinity" in cond["message"]}


def stranded(pods: list[dict[str, Any]], **kw: Any) -> list[Any]:
    return stranded_groups(pods, NOW, seen(pods), **kw)


def test_a_group_whose_workers_are_refused_for_affinity_long_enough_is_restarted() -> None:
    pods = [pod("prefill", 0, 0, "wide-0"), pod("prefill", 0, 1, refused=STRANDED)]
    [group] = stranded(pods, after_s=120)
    assert (group.phase, group.group, group.node) == ("prefill", "0", "wide-0")
    assert group.leader["metadata"]["name"] == "md-prefill-0"
    assert group.waited_s == 180 and group.said == STRANDED
    message = group.message("tessera.dev/block")
    assert "prefill group 0" in message and "tessera.dev/block of node wide-0" in message
    assert "180 s" in message


def test_nothing_restarts_before_its_time_or_in_a_full_pool_or_without_a_placed_leader() -> None:
    young = [pod("prefill", 0, 0, "wide-0"),
             pod("prefill", 0, 1, refused=STRANDED, since="2026-12-05T09:59:00Z")]
    assert stranded(young, after_s=120) == []
    full = [pod("prefill", 0, 0, "wide-0"), pod("prefill", 0, 1, refused=FULL)]
    assert stranded(full, after_s=120) == []  # no node had room: nothing to gain
    unplaced = [pod("prefill", 0, 0, refused=STRANDED), pod("prefill", 0, 1, refused=STRANDED)]
    assert stranded(unplaced, after_s=120) == []
    going = [pod("prefill", 0, 0, "wide-0", deleting=True), pod("prefill", 0, 1, refused=STRANDED)]
    assert stranded(going, after_s=120) == []  # already restarting
    # A restarted group's new leader beside the old worker, still leaving: not stranded again.
    restarted = [pod("prefill", 0, 0, "wide-2", created="2026-12-05T09:59:58Z"),
                 pod("prefill", 0, 1, refused=STRANDED)]
    assert stranded(restarted, after_s=120) == []
    # ... nor another group of its phase, until the new leader has had its time.
    other = [pod("prefill", 1, 0, "wide-0"), pod("prefill", 1, 1, refused=STRANDED)]
    assert stranded(restarted + other, after_s=120) == []
    assert [g.group for g in stranded(other, after_s=120)] == ["1"]
    # A phase that restarted a group moments ago (the caller remembers) waits as well.
    assert stranded(other, after_s=120, settling={"prefill"}) == []
    plain = [pod("decode", 0, 0, "n-0")]
    plain[0]["metadata"]["labels"].pop(c.LWS_LABEL_GROUP_INDEX)  # a Deployment's pod
    assert stranded(plain, after_s=120) == []


def test_the_wait_counts_from_the_first_refusal_seen_not_from_the_pods_condition() -> None:
    """A worker that could not be placed for an hour (a full pool) and is refused for pod
    affinity only now (a node outside its block freed): its group waits its full patience,
    so a block about to free up has its chance."""
    leader = pod("prefill", 0, 0, "wide-0")
    worker = pod("prefill", 0, 1, refused=FULL, since="2026-12-05T09:00:00Z")
    assert affinity_refusals([leader, worker], {}, NOW) == {}  # a full pool: no refusal
    worker["status"]["conditions"][0]["message"] = STRANDED  # the time stays the scheduler's
    first = affinity_refusals([leader, worker], {}, NOW)
    assert first == {"uid-md-prefill-0-1": NOW}
    assert stranded_groups([leader, worker], NOW, first, after_s=120) == []
    later = "2026-12-05T10:02:00Z"
    kept = affinity_refusals([leader, worker], first, later)
    assert kept == first
    [group] = stranded_groups([leader, worker], later, kept, after_s=120)
    assert group.waited_s == 120
    # Placed, the worker drops out: a later refusal starts its wait anew.
    worker["status"]["conditions"] = []
    assert affinity_refusals([leader, worker], kept, later) == {}


def test_one_group_a_phase_restarts_at_a_time_the_highest_index() -> None:
    """Two groups stranded in one block: the one restarted leaves, the one that stays gets the
    freed node."""
    pods = [pod("prefill", 0, 0, "wide-0"), pod("prefill", 0, 1, refused=STRANDED),
            pod("prefill", 1, 0, "wide-1"), pod("prefill", 1, 1, refused=STRANDED),
            pod("decode", 2, 0, "wide-4"), pod("decode", 2, 1, refused=STRANDED),
            pod("decode", 10, 0, "wide-5"), pod("decode", 10, 1, refused=STRANDED)]
    got = stranded(pods, after_s=60)
    assert [(g.phase, g.group) for g in got] == [("decode", "10"), ("prefill", "1")]


def test_the_restart_window_doubles_with_restarts_in_a_row_up_to_16_times() -> None:
    assert [restart_window(n, 120) for n in (1, 2, 3, 5, 9)] == [120, 240, 480, 1920, 1920]


class RecordingKube(RejectingKube):
    """An API server that accepts everything (LeaderWorkerSet included) and records it."""

    def __init__(self) -> None:
        super().__init__(None)

    def serves(self, api_version: str, plural: str) -> bool:
        return True


def test_a_reconciler_restarts_a_stranded_group_and_backs_off_while_it_stays_stranded() -> None:
    """The multi-node example with a topology key, its prefill group 0 stranded (as a store
    that never sees the pods change would show it): restarted once the operator has seen it
    so for its patience (the pod's own condition is older), then not again within
    the window, which doubles with each restart in a row and starts over after a quiet spell."""
    example = Path(__file__).resolve().parents[2] / "examples/03-kimi-k2-multinode"
    md = yaml.safe_load((example / "modeldeployment.yaml").read_text())
    md["metadata"].update(namespace="llm", uid="uid-3", generation=1, resourceVersion="1")
    md["spec"]["nodePool"]["replicaTopologyKey"] = "tessera.dev/block"
    kube, store, now = RecordingKube(), Store(), [1000.0]
    wall = datetime.datetime(2026, 12, 5, 10, tzinfo=datetime.UTC)  # at now[0] == 0
    store.put(md)
    for member in (pod("prefill", 0, 0, "wide-0", created="2020-01-01T00:00:00Z"),
                   pod("prefill", 0, 1, refused=STRANDED, since="2020-01-01T00:00:01Z",
                       created="2020-01-01T00:00:00Z")):
        member["metadata"].update(namespace="llm", labels={
            **member["metadata"]["labels"], c.LABEL_DEPLOYMENT: "kimi-k2-multinode",
            c.LABEL_MANAGED_BY: c.MANAGED_BY})
        store.put({"apiVersion": "v1", "kind": "Pod", **member})
    reconciler = Reconciler(kube, store, render_configs,  # type: ignore[arg-type]
                            clock=lambda: now[0], schedule=lambda d, _: None,
                            stranded_after_s=120, now=lambda: (wall + datetime.timedelta(
                                seconds=now[0])).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def restarts() -> int:
        reconciler.reconcile("llm", "kimi-k2-multinode")
        assert set(kube.deleted) <= {("Pod", "md-prefill-0")}
        assert kube.events.count(("Warning", GROUP_RESTARTED)) == len(kube.deleted)
        return len(kube.deleted)

    assert restarts() == 0  # the refusal is new to the operator: its patience starts now
    now[0] += 120
    assert restarts() == 1
    for advance, expected in ((119, 1), (2, 2), (239, 2), (2, 3), (481, 4)):
        now[0] += advance
        assert restarts() == expected, (advance, expected)
    now[0] += 2 * 960 + 1  # quiet for twice the 4th window: the next one is the first again
    assert restarts() == 5
    now[0] += 121
    assert restarts() == 6


def test_a_leader_refused_beside_its_placed_workers_restarts_its_group() -> None:
    """The workers came first: both groups' workers took one block, and each leader (whose
    group must share a block) is refused there while the other block has room."""
    pods = [pod("prefill", 0, 0, refused=STRANDED), pod("prefill", 0, 1, "wide-2"),
            pod("prefill", 1, 0, refused=STRANDED, since="2026-12-05T09:58:00Z"),
            pod("prefill", 1, 1, "wide-3")]
    [group] = stranded(pods, after_s=60)
    assert (group.phase, group.group, group.node) == ("prefill", "1", "")
    assert group.leader["metadata"]["name"] == "md-prefill-1"
    assert group.waited_s == 120 and group.said == STRANDED
    message = group.message("tessera.dev/block")
    assert "prefill group 1: its workers' block (tessera.dev/block)" in message
    assert "120 s" in message
    assert stranded(pods, after_s=200) == []  # not before its time
    assert stranded(pods[:1] + [pod("prefill", 0, 1, refused=STRANDED)], after_s=60) == []
