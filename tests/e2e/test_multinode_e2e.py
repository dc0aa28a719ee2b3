"""Replicas wider than one node, with the real LeaderWorkerSet controller of the dev cluster.

A tiny DeepSeek-shaped model at prefill tensorParallel 16 over 8-GPU nodes: each prefill
replica is one LWS group of two pods. The groups get their own tainted pool of four simulated
nodes ("wide"), so no other test's pods take their GPUs; decode stays on the decode pool.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from tessera.operator import constants as c
from tessera.operator import handlers
from tessera.operator.kube import Kube
from tessera.operator.reconcile import Reconciler, Store
from tessera.operator.render import render_configs
from test_operator_e2e import Operator, apply, conditions, get_md, poll, tiny
from test_operator_e2e import operator as operator  # noqa: F401  (the module's operator fixture)

from tessera.devcluster.nodes import POOL_LABEL, NodePool, node_manifest

pytestmark = pytest.mark.e2e

POOL = "wide"
TAINT = {"key": "tessera.dev/wide", "value": "true", "effect": "NoSchedule"}
GROUP_INDEX = c.LWS_LABEL_GROUP_INDEX
READY_TIMEOUT_S = 120.0
BLOCK = "tessera.dev/block"  # two network blocks of two nodes each, for replicaTopologyKey
STRAND_ATTEMPTS = 5


@pytest.fixture(scope="module")
def wide_pool(cluster: Any) -> Iterator[list[str]]:
    """Four 8-GPU nodes for two TP-16 replicas, tainted for this module's deployments, in two
    blocks (nodes 0 and 1, nodes 2 and 3)."""
    nodes = [node_manifest(NodePool(POOL, nodes=4), i) for i in range(4)]
    for i, node in enumerate(nodes):
        node["spec"] = {"taints": [TAINT]}
        node["metadata"]["labels"][BLOCK] = "ab"[i // 2]
    cluster.kubectl("apply", "-f", "-", input={"apiVersion": "v1", "kind": "List",
                                               "items": nodes})
    names = [n["metadata"]["name"] for n in nodes]
    cluster.kubectl("wait", "--for=condition=Ready", *(f"node/{n}" for n in names),
                    "--timeout=60s")
    yield names
    # Pods of namespaces deleted without waiting must leave while their nodes exist: kwok
    # ends a pod's deletion only on a node it runs, and a namespace's deletion waits out the
    # engine's drain period (minutes) before it looks again at pods left on a deleted node.
    poll("the wide nodes free of this module's pods", lambda: not pods_on(cluster.kubectl, names),
         READY_TIMEOUT_S, seen=lambda: pods_on(cluster.kubectl, names))
    cluster.kubectl("delete", "node", *names, "--wait=false", check=False)


def pods_on(kubectl: Callable[..., Any], nodes: list[str]) -> list[str]:
    """namespace/name of every pod bound to one of `nodes`."""
    held = json.loads(kubectl("get", "pods", "-A", "-o", "json").stdout)["items"]
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in held
            if p["spec"].get("nodeName") in nodes]


def wide(name: str, prefill_tp: int = 16) -> dict[str, Any]:
    md = tiny(name)
    spec = md["spec"]
    spec["nodePool"]["tolerations"] = [{**TAINT, "operator": "Equal"}]
    spec["prefill"].update(tensorParallel=prefill_tp, replicas=2,
                           nodeSelector={POOL_LABEL: POOL})
    spec["decode"]["nodeSelector"] = {POOL_LABEL: "decode"}
    return md


def pods(kubectl: Callable[..., Any], namespace: str, phase: str) -> list[dict[str, Any]]:
    items = json.loads(kubectl("get", "pods", "-n", namespace, "-l", f"{c.LABEL_PHASE}={phase}",
                               "-o", "json").stdout)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def objects(kubectl: Callable[..., Any], namespace: str, kind: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads(
        kubectl("get", kind, "-n", namespace, "-o", "json").stdout)["items"]
    return out


def ready(kubectl: Callable[..., Any], namespace: str, name: str) -> bool:
    md = get_md(kubectl, namespace, name)
    return (md.get("status", {}).get("observedGeneration") == md["metadata"]["generation"]
            and conditions(md).get("Ready", {}).get("status") == "True")


def placed_groups(kubectl: Callable[..., Any],
                  namespace: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Prefill pods bound to a node, by group index, then worker index."""
    return {g: placed for g, group in groups(kubectl, namespace).items()
            if (placed := {w: p for w, p in group.items() if p["spec"].get("nodeName")})}


def groups(kubectl: Callable[..., Any], namespace: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Running prefill pods by group index, then worker index."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for pod in pods(kubectl, namespace, "prefill"):
        labels = pod["metadata"]["labels"]
        out.setdefault(labels[GROUP_INDEX], {})[labels[c.LWS_LABEL_WORKER_INDEX]] = pod
    return out


def test_lws_webhooks_are_called_on_loopback(kubectl: Any, namespace: str) -> None:
    """The API server reaches LWS's webhooks: the mutating one defaults, the validating one
    refuses what only it checks (both unavailable would be a surge of 0 and nothing down)."""
    lws = {"apiVersion": c.LWS_API_VERSION, "kind": c.LWS_KIND,
           "metadata": {"name": "hook", "namespace": namespace},
           "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": {
               "spec": {"containers": [{"name": "c", "image": "i"}]}}}}}
    created = json.loads(kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                 input=lws).stdout)
    assert created["spec"]["networkConfig"] == {"subdomainPolicy": "Shared"}
    lws["spec"]["rolloutStrategy"] = {"type": "RollingUpdate", "rollingUpdateConfiguration": {
        "maxUnavailable": 0, "maxSurge": 0}}
    refused = kubectl("create", "--dry-run=server", "-f", "-", input=lws, check=False)
    assert refused.returncode != 0
    assert 'admission webhook "vleaderworkerset.kb.io" denied the request' in refused.stderr
    assert "must not be 0 when `maxSurge` is 0" in refused.stderr


def test_tp16_prefill_runs_as_two_groups_on_distinct_nodes_and_is_ready(
        operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str],
        cluster: Any) -> None:
    apply(kubectl, namespace, wide("mn"))
    poll("the deployment Ready", lambda: ready(kubectl, namespace, "mn"), READY_TIMEOUT_S)

    [lws] = objects(kubectl, namespace, "leaderworkersets")
    assert lws["metadata"]["name"] == "mn-prefill"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["status"]["readyReplicas"] == 2
    assert not [d for d in objects(kubectl, namespace, "deployments")
                if d["metadata"]["name"] == "mn-prefill"]

    by_group = groups(kubectl, namespace)
    assert sorted(by_group) == ["0", "1"]
    assert all(sorted(g) == ["0", "1"] for g in by_group.values())
    placed = [p["spec"]["nodeName"] for g in by_group.values() for p in g.values()]
    assert sorted(placed) == sorted(wide_pool), placed  # four pods, four distinct nodes
    for group_index, group in by_group.items():
        for index, pod in group.items():
            container = pod["spec"]["containers"][0]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
            env = {e["name"]: e.get("value") for e in container["env"]}
            # LWS's webhook injected its variables first; ours refer to them.
            assert [e["name"] for e in container["env"][:3]] == [
                "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"]
            assert env["LWS_WORKER_INDEX"] == index
            assert env["LWS_LEADER_ADDRESS"].startswith(f"mn-prefill-{group_index}.")
            assert env[c.ENV_NODE_RANK] == "$(LWS_WORKER_INDEX)"
            assert env[c.ENV_DIST_INIT_ADDR] == "$(LWS_LEADER_ADDRESS):20000"

    # Only the two leaders are endpoints of the prefill Service (what the router discovers).
    # The EndpointSlice controller lists a pod some time after it turns Ready, so wait for it.
    leaders = {by_group["0"]["0"]["metadata"]["name"], by_group["1"]["0"]["metadata"]["name"]}

    def endpoints() -> set[str]:
        slices = json.loads(kubectl("get", "endpointslices", "-n", namespace, "-l",
                                    "kubernetes.io/service-name=mn-prefill", "-o", "json").stdout)
        return {e["targetRef"]["name"] for s in slices["items"] for e in s.get("endpoints") or []}

    poll("both leaders, and only they, as the prefill Service's endpoints",
         lambda: endpoints() == leaders, seen=endpoints)  # fmt: skip

    md = get_md(kubectl, namespace, "mn")
    assert md["status"]["prefill"]["replicas"] == 2
    assert md["status"]["prefill"]["readyReplicas"] == 2
    assert md["status"]["plan"]["prefill"]["capacity"]["nodesPerReplica"] == 2
    assert "prefill 2/2" in md["status"]["summary"]["replicas"]

    # What stands in for kopf's watch where it never started one (an LWS installed while the
    # operator ran, docs/operator.md): a resync's listing brings the same ready groups.
    client = kubernetes.config.new_client_from_config(config_file=cluster.env["KUBECONFIG"])
    reconciler = Reconciler(Kube(client), Store(), render_configs)
    handlers.refresh_from_listings(reconciler)
    listed = reconciler.store.get(c.LWS_KIND, namespace, "mn-prefill")
    assert listed is not None and listed["status"]["readyReplicas"] == 2


def test_a_replica_topology_key_puts_each_group_in_one_block(
        operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str]) -> None:
    """Two groups of two nodes on two blocks of two nodes: without the preference for blocks
    that hold no other group, both leaders landed in one block about one run in three, and both
    groups' workers waited forever."""
    md = wide("blk")
    md["spec"]["nodePool"]["replicaTopologyKey"] = BLOCK
    apply(kubectl, namespace, md)
    poll("the deployment Ready", lambda: ready(kubectl, namespace, "blk"), READY_TIMEOUT_S,
         seen=lambda: kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout)
    block = {n["metadata"]["name"]: n["metadata"]["labels"][BLOCK] for n in json.loads(
        kubectl("get", "nodes", "-l", f"{POOL_LABEL}={POOL}", "-o", "json").stdout)["items"]}
    by_group = groups(kubectl, namespace)
    assert sorted(by_group) == ["0", "1"]
    placed = {g: sorted(block[p["spec"]["nodeName"]] for p in group.values())
              for g, group in by_group.items()}
    assert sorted(map(tuple, placed.values())) == [("a", "a"), ("b", "b")], placed
    # The API server narrowed each pod's terms to its own group and to the others (LWS's key,
    # set by its webhook): required with its own, preferably apart from the others.
    for group in by_group.values():
        for pod in group.values():
            affinity = pod["spec"]["affinity"]
            [own] = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            [apart] = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            key = pod["metadata"]["labels"][c.LWS_LABEL_GROUP_KEY]
            assert {"key": c.LWS_LABEL_GROUP_KEY, "operator": "In", "values": [key]} in \
                own["labelSelector"]["matchExpressions"]
            assert {"key": c.LWS_LABEL_GROUP_KEY, "operator": "NotIn", "values": [key]} in \
                apart["podAffinityTerm"]["labelSelector"]["matchExpressions"]


def test_a_group_stranded_in_a_full_block_is_restarted_where_it_fits(
        operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str]) -> None:
    """Block b is taken while the two groups' leaders are placed, so both land in block a,
    whose two nodes hold one group: both workers wait. Once block b is free (nodes refused for
    affinity alone), the operator restarts one group (the operator's patience is 10 s here),
    whose new leader takes block b, and the other group's worker gets the freed node."""
    held = [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"hold-{node}", "namespace": namespace},
             "spec": {"nodeName": node, "tolerations": [{**TAINT, "operator": "Equal"}],
                      "containers": [{"name": "hold", "image": "hold",
                                      "resources": {"limits": {c.GPU_RESOURCE: "8"}}}]}}
            for node in wide_pool[2:]]
    kubectl("apply", "-f", "-", input={"apiVersion": "v1", "kind": "List", "items": held})
    md = wide("strand")
    md["spec"]["nodePool"]["replicaTopologyKey"] = BLOCK

    def block_a_full() -> bool:
        placed = [p["spec"].get("nodeName") for p in pods(kubectl, namespace, "prefill")]
        return sorted(filter(None, placed)) == wide_pool[:2] and len(placed) == 4

    def gone() -> bool:
        listed = json.loads(kubectl("get", "pods", "-n", namespace, "-l",
                                    f"{c.LABEL_PHASE}=prefill", "-o", "json").stdout)
        return not listed["items"]

    # Which two pods take block a is a race: both leaders (the strand), or one whole group
    # when its worker is scheduled before the other leader exists. Only the first is this
    # test's case, so the second is torn down and made again.
    for _ in range(STRAND_ATTEMPTS):
        apply(kubectl, namespace, md)
        poll("block a full, two prefill pods waiting", block_a_full, READY_TIMEOUT_S,
             seen=lambda: kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout)
        if all(set(group) == {"0"} for group in placed_groups(kubectl, namespace).values()):
            break
        kubectl("delete", "md", "strand", "-n", namespace)
        poll("the prefill pods gone", gone, READY_TIMEOUT_S)
    else:
        pytest.fail(f"no strand in {STRAND_ATTEMPTS} attempts: each time one group took block a")
    kubectl("delete", "pod", *(p["metadata"]["name"] for p in held), "-n", namespace,
            "--wait=false")
    poll("the deployment Ready", lambda: ready(kubectl, namespace, "strand"), READY_TIMEOUT_S,
         seen=lambda: kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout)
    # Shown only when an assertion below fails (pytest cuts a long assertion message).
    print(kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp").stdout,
          kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout)
    block = {n: "ab"[i // 2] for i, n in enumerate(wide_pool)}
    placed = {g: sorted(block[p["spec"]["nodeName"]] for p in group.values())
              for g, group in groups(kubectl, namespace).items()}
    assert sorted(map(tuple, placed.values())) == [("a", "a"), ("b", "b")], placed
    events = json.loads(kubectl("get", "events", "-n", namespace, "-o", "json",
                                "--field-selector", "reason=GroupRestarted").stdout)["items"]
    restarts = [e for e in events if e["involvedObject"]["name"] == "strand"]
    assert len(restarts) == 1, restarts
    [restart] = restarts
    assert restart["type"] == "Warning"
    # Either group may go: the one whose worker the operator first saw refused for affinity.
    assert re.match(r"prefill group [01]: its leader's block \(tessera\.dev/block",
                    restart["message"]), restart["message"]
    assert "had room" in restart["message"]


def test_a_lost_worker_restarts_its_whole_group_and_ready_says_so(
        operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str]) -> None:
    apply(kubectl, namespace, wide("loss"))
    poll("the deployment Ready", lambda: ready(kubectl, namespace, "loss"), READY_TIMEOUT_S)
    before = groups(kubectl, namespace)
    # Group 0's nodes are cordoned, so the group LWS recreates waits for them: Ready must say
    # so for as long as it takes (kwok would otherwise make the new pods Ready at once).
    nodes = sorted(p["spec"]["nodeName"] for p in before["0"].values())
    kubectl("cordon", *nodes)
    try:
        worker = before["0"]["1"]["metadata"]["name"]
        kubectl("delete", "pod", worker, "-n", namespace, "--wait=false")

        def short() -> dict[str, Any] | None:
            # LWS may show the recreated group as updating for a moment (Progressing, not yet
            # Degraded); the loss is Degraded once LWS settles.
            got = conditions(get_md(kubectl, namespace, "loss"))
            return got if ("prefill 1/2 ready" in got["Ready"].get("message", "")
                           and got["Degraded"]["status"] == "True") else None

        def state() -> dict[str, Any]:
            [lws] = objects(kubectl, namespace, "leaderworkersets")
            return {"conditions": conditions(get_md(kubectl, namespace, "loss")),
                    "lws_status": lws.get("status"),
                    "prefill_pods": {p["metadata"]["name"]: p["status"].get("phase")
                                     for p in pods(kubectl, namespace, "prefill")}}

        got = poll("Ready False and Degraded: prefill 1/2 ready", short, READY_TIMEOUT_S,
                   seen=state)
        assert got["Ready"]["status"] == "False"
        assert "prefill 1/2 ready" in got["Degraded"]["message"]
        # LWS deleted the group's leader too (the whole group restarts), not only the worker.
        leader = before["0"]["0"]["metadata"]
        poll("group 0's leader replaced", lambda: leader["uid"] not in {
            p["metadata"]["uid"] for p in pods(kubectl, namespace, "prefill")}, 60)
        assert not ready(kubectl, namespace, "loss")
    finally:
        kubectl("uncordon", *nodes)
    poll("the deployment Ready again", lambda: ready(kubectl, namespace, "loss"),
         READY_TIMEOUT_S, seen=state)
    after = groups(kubectl, namespace)
    assert all(after["0"][i]["metadata"]["uid"] != before["0"][i]["metadata"]["uid"]
               for i in ("0", "1"))
    # Group 1 was left alone.
    assert {i: p["metadata"]["uid"] for i, p in after["1"].items()} == {
        i: p["metadata"]["uid"] for i, p in before["1"].items()}
    lws_events = json.loads(kubectl("get", "events", "-n", namespace, "--field-selector",
                                    "involvedObject.kind=LeaderWorkerSet", "-o", "json").stdout)
    assert any(e["reason"] == "RecreateGroupOnPodRestart" and worker in e["message"]
               for e in lws_events["items"])


def test_changing_only_decode_leaves_the_groups_untouched(
        operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str]) -> None:
    apply(kubectl, namespace, wide("dec"))
    poll("the deployment Ready", lambda: ready(kubectl, namespace, "dec"), READY_TIMEOUT_S)
    [lws] = objects(kubectl, namespace, "leaderworkersets")
    prefill = {p["metadata"]["uid"] for p in pods(kubectl, namespace, "prefill")}
    decode = {p["metadata"]["uid"] for p in pods(kubectl, namespace, "decode")}

    changed = wide("dec")
    changed["spec"]["decode"]["weights"]["groupSize"] = 32
    apply(kubectl, namespace, changed)

    def decode_rolled() -> bool:
        new = {p["metadata"]["uid"] for p in pods(kubectl, namespace, "decode")}
        return len(new) == 2 and not new & decode and ready(kubectl, namespace, "dec")

    poll("decode rolled and Ready", decode_rolled, READY_TIMEOUT_S)
    [after] = objects(kubectl, namespace, "leaderworkersets")
    assert after["metadata"]["generation"] == lws["metadata"]["generation"]
    assert after["spec"] == lws["spec"]
    assert {p["metadata"]["uid"] for p in pods(kubectl, namespace, "prefill")} == prefill


def test_changing_prefill_rolls_every_group_and_not_decode(
        operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str]) -> None:
    apply(kubectl, namespace, wide("pre"))
    poll("the deployment Ready", lambda: ready(kubectl, namespace, "pre"), READY_TIMEOUT_S)
    prefill = {p["metadata"]["uid"] for p in pods(kubectl, namespace, "prefill")}
    decode = {p["metadata"]["uid"] for p in pods(kubectl, namespace, "decode")}

    changed = wide("pre")
    changed["spec"]["prefill"]["memFractionStatic"] = 0.85
    apply(kubectl, namespace, changed)

    def rolled() -> bool:
        new = {p["metadata"]["uid"] for p in pods(kubectl, namespace, "prefill")}
        return len(new) == 4 and not new & prefill and ready(kubectl, namespace, "pre")

    poll("every prefill group replaced and Ready", rolled, 2 * READY_TIMEOUT_S)
    [lws] = objects(kubectl, namespace, "leaderworkersets")
    assert lws["status"]["updatedReplicas"] == lws["status"]["readyReplicas"] == 2
    assert {p["metadata"]["uid"] for p in pods(kubectl, namespace, "decode")} == decode


def test_switching_between_one_and_two_nodes_per_replica_leaves_no_orphans(
        operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str]) -> None:
    apply(kubectl, namespace, wide("sw", prefill_tp=8))
    poll("Ready at TP 8", lambda: ready(kubectl, namespace, "sw"), READY_TIMEOUT_S)

    def only(kind: str, pod_count: int) -> bool:
        lwss = objects(kubectl, namespace, "leaderworkersets")
        deployments = [d for d in objects(kubectl, namespace, "deployments")
                       if d["metadata"]["name"] == "sw-prefill"]
        sets = objects(kubectl, namespace, "statefulsets")
        replica_sets = [r for r in objects(kubectl, namespace, "replicasets")
                        if r["metadata"]["labels"].get(c.LABEL_PHASE) == "prefill"]
        running = pods(kubectl, namespace, "prefill")
        if kind == c.LWS_KIND:
            shape = len(lwss) == 1 and not deployments and not replica_sets
        else:
            shape = not lwss and len(deployments) == 1 and not sets
        return (shape and len(running) == pod_count
                and all(bool(p["metadata"]["labels"].get(GROUP_INDEX)) == (kind == c.LWS_KIND)
                        for p in running)
                and ready(kubectl, namespace, "sw"))

    poll("one Deployment of 2 prefill pods", lambda: only("Deployment", 2), READY_TIMEOUT_S)
    apply(kubectl, namespace, wide("sw", prefill_tp=16))
    poll("one LeaderWorkerSet of 2 groups x 2 pods, no Deployment left",
         lambda: only(c.LWS_KIND, 4), READY_TIMEOUT_S)
    apply(kubectl, namespace, wide("sw", prefill_tp=8))
    poll("back to one Deployment, no LeaderWorkerSet or StatefulSet left",
         lambda: only("Deployment", 2), READY_TIMEOUT_S)


@pytest.mark.parametrize("install_later", [False, True])
def test_without_lws_a_multi_node_spec_says_so_and_one_node_keeps_serving(
        cluster: Any, operator: Operator, kubectl: Any, namespace: str, wide_pool: list[str],
        tmp_path: Path, install_later: bool) -> None:
    """An operator started on a cluster without LWS's CRD (and, slow, LWS installed later).
    Last in this module: it removes the CRD from the shared cluster and puts it back. The
    module's operator is stopped first: kopf's watch of a CRD deleted under it fails
    (docs/operator.md)."""
    operator.stop()
    # The TP-16 replica below needs all four wide nodes: wait for the pods of earlier tests'
    # namespaces (deleted without waiting) to leave them.
    poll("the wide nodes free of earlier tests' pods", lambda: not pods_on(kubectl, wide_pool),
         READY_TIMEOUT_S, seen=lambda: pods_on(kubectl, wide_pool))
    crd = "leaderworkersets.leaderworkerset.x-k8s.io"
    kubectl("delete", "crd", crd, "--wait=true", timeout=120)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    alone = Operator(cluster.env, tmp_path / "operator.log", "--metrics-port", str(port))
    try:
        alone.start()
        apply(kubectl, namespace, wide("nolws", prefill_tp=8))
        poll("Ready at TP 8", lambda: ready(kubectl, namespace, "nolws"), READY_TIMEOUT_S)
        apply(kubectl, namespace, wide("nolws", prefill_tp=16))

        def refused() -> dict[str, Any] | None:
            cond = conditions(get_md(kubectl, namespace, "nolws")).get("Ready", {})
            return cond if "does not serve LeaderWorkerSet" in cond.get("message", "") else None

        cond = poll("Ready False naming LeaderWorkerSet", refused, 60)
        assert (cond["status"], cond["reason"]) == ("False", "ChildRejected")
        assert "install LeaderWorkerSet" in cond["message"]
        # The one-node prefill Deployment keeps serving meanwhile.
        assert [d["metadata"]["name"] for d in objects(kubectl, namespace, "deployments")
                if d["metadata"]["name"] == "nolws-prefill"] == ["nolws-prefill"]
        assert len(pods(kubectl, namespace, "prefill")) == 2

        if not install_later:
            assert "Traceback" not in alone.text(), alone.text()[-4000:]
            return
        # Installed later: noticed within a resync, and the replica becomes two nodes wide.
        cluster.apply_lws_crds()
        poll("Ready as a LeaderWorkerSet once LWS is installed",
             lambda: ready(kubectl, namespace, "nolws") and len(objects(
                 kubectl, namespace, "leaderworkersets")) == 1 and not [
                 d for d in objects(kubectl, namespace, "deployments")
                 if d["metadata"]["name"] == "nolws-prefill"], 2 * READY_TIMEOUT_S)
        assert "Traceback" not in alone.text(), alone.text()[-4000:]
    finally:
        alone.stop()
        if kubectl("get", "crd", crd, check=False).returncode:
            cluster.apply_lws_crds()
