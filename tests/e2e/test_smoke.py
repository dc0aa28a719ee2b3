"""Smoke tests of the local control plane: real apiserver, scheduler, GC and kwok nodes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from tessera.devcluster import KUBERNETES_VERSION, DevCluster
from tessera.devcluster.nodes import GPU_PRODUCT_LABEL, GPU_RESOURCE, H200, POOL_LABEL

pytestmark = pytest.mark.e2e


def _poll(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Return check()'s first truthy value; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)
    return value


def _gpu_pod_spec(gpus: int, pool: str) -> dict[str, Any]:
    return {
        "nodeSelector": {GPU_PRODUCT_LABEL: H200, POOL_LABEL: pool},
        "containers": [{
            "name": "server",
            "image": "registry.invalid/sglang:never-pulled",
            "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
        }],
    }


def test_server_reports_the_pinned_version(kubectl: Callable[..., Any]) -> None:
    version = json.loads(kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBERNETES_VERSION


def test_gpu_nodes_of_both_pools_are_ready(kubectl: Callable[..., Any]) -> None:
    nodes = json.loads(kubectl("get", "nodes", "-o", "json").stdout)["items"]
    pools = sorted(n["metadata"]["labels"][POOL_LABEL] for n in nodes)
    assert pools == ["decode", "decode", "prefill", "prefill"]
    for node in nodes:
        assert node["status"]["allocatable"][GPU_RESOURCE] == "8"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]


def test_every_node_heartbeats_through_a_lease(kubectl: Callable[..., Any]) -> None:
    # Without leases the node lifecycle controller marks nodes NotReady between status updates.
    nodes = kubectl("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}").stdout.split()

    def leases() -> dict[str, int]:
        items = json.loads(kubectl("get", "leases", "-n", "kube-node-lease", "-o", "json").stdout)
        return {i["metadata"]["name"]: i["spec"]["leaseDurationSeconds"] for i in items["items"]}

    found = _poll("a lease for every node", lambda: (got := leases()).keys() >= set(nodes) and got)
    assert {found[n] for n in nodes} == {40}


def test_deployment_with_8_gpus_becomes_ready_on_an_h200_node(
    kubectl: Callable[..., Any], namespace: str
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "decode", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "decode"}},
            "template": {"metadata": {"labels": {"app": "decode"}},
                         "spec": _gpu_pod_spec(8, "decode")},
        },
    }
    kubectl("apply", "-f", "-", input=deployment)
    kubectl("rollout", "status", "deployment/decode", "-n", namespace, "--timeout=60s")
    pod = json.loads(kubectl("get", "pods", "-n", namespace, "-l", "app=decode",
                             "-o", "json").stdout)["items"][0]
    node = json.loads(kubectl("get", "node", pod["spec"]["nodeName"], "-o", "json").stdout)
    assert node["metadata"]["labels"][POOL_LABEL] == "decode"
    assert node["metadata"]["labels"][GPU_PRODUCT_LABEL] == H200
    assert pod["status"]["phase"] == "Running"


def test_pod_asking_for_9_gpus_stays_pending(kubectl: Callable[..., Any], namespace: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "too-big", "namespace": namespace},
           "spec": _gpu_pod_spec(9, "prefill")}
    kubectl("apply", "-f", "-", input=pod)

    def failed_scheduling() -> list[dict[str, Any]]:
        events = kubectl("get", "events", "-n", namespace, "-o", "json",
                         "--field-selector", "involvedObject.name=too-big,reason=FailedScheduling")
        return list(json.loads(events.stdout)["items"])

    event = _poll("a FailedScheduling event for pod too-big", failed_scheduling)[0]
    assert "Insufficient nvidia.com/gpu" in event["message"]
    phase = kubectl("get", "pod", "too-big", "-n", namespace, "-o", "jsonpath={.status.phase}")
    assert phase.stdout == "Pending"


def test_deleting_the_owner_garbage_collects_the_owned_configmap(
    kubectl: Callable[..., Any], namespace: str
) -> None:
    kubectl("create", "configmap", "owner", "-n", namespace)
    uid = kubectl("get", "configmap", "owner", "-n", namespace,
                  "-o", "jsonpath={.metadata.uid}").stdout
    owned = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "owned", "namespace": namespace, "ownerReferences": [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]},
    }
    kubectl("apply", "-f", "-", input=owned)
    kubectl("delete", "configmap", "owner", "-n", namespace)

    def owned_is_gone() -> bool:
        got = kubectl("get", "configmap", "owned", "-n", namespace, check=False)
        return got.returncode != 0 and "NotFound" in got.stderr

    _poll("the garbage collector to delete configmap owned", owned_is_gone)


def test_audit_log_records_writes(cluster: DevCluster, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "audited", "-n", namespace)

    def create_event() -> list[dict[str, Any]]:
        events = [json.loads(line) for line in cluster.audit_log.read_text().splitlines()]
        return [e for e in events if e["verb"] == "create"
                and e.get("objectRef", {}).get("namespace") == namespace
                and e.get("objectRef", {}).get("name") == "audited"]

    event = _poll("the audit event of creating configmap audited", create_event, timeout=10)[0]
    assert event["user"]["username"] == "tessera-admin"
