"""The runtime's mismatch reporter against the real API server, through to `KVIntegrity`.

The reporter posts with a least-privilege identity (a ServiceAccount that may only create
Events in its own namespace), merges a burst of mismatches into one Event, and the operator
turns that Event into the ModelDeployment's `KVIntegrity` condition.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from tessera.runtime.integrity.reporter import (
    EVENT_REASON,
    MismatchReporter,
    PodRef,
    kubernetes_poster,
)
from test_operator_e2e import Operator, apply, conditions, get_md, poll, tiny
from test_operator_e2e import operator as operator  # noqa: F401  (the module's operator fixture)

pytestmark = pytest.mark.e2e

RUNTIME_SA = "tessera-runtime-events"


def runtime_client(cluster: Any, kubectl: Any, namespace: str) -> kubernetes.client.ApiClient:
    """An API client with the runtime's rights only: create Events in `namespace`."""
    for manifest in (
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": RUNTIME_SA}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": RUNTIME_SA},
            "rules": [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": RUNTIME_SA},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": RUNTIME_SA,
            },
            "subjects": [{"kind": "ServiceAccount", "name": RUNTIME_SA, "namespace": namespace}],
        },
    ):
        kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    token = kubectl("create", "token", RUNTIME_SA, "-n", namespace).stdout.strip()
    admin = kubernetes.config.new_client_from_config(str(cluster.kubeconfig)).configuration
    config = kubernetes.client.Configuration()
    config.host, config.ssl_ca_cert, config.verify_ssl = admin.host, admin.ssl_ca_cert, True
    config.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(config)


@pytest.fixture
def decode_pod(operator: Operator, kubectl: Any, namespace: str) -> Iterator[dict[str, Any]]:
    apply(kubectl, namespace, tiny("tags"))
    kubectl(
        "wait",
        "--for=condition=Ready",
        "modeldeployment/tags",
        "-n",
        namespace,
        "--timeout=90s",
        timeout=100,
    )
    pods = json.loads(
        kubectl(
            "get", "pods", "-n", namespace, "-l", "tessera.dev/phase=decode", "-o", "json"
        ).stdout
    )["items"]
    md = get_md(kubectl, namespace, "tags")
    assert conditions(md)["KVIntegrity"]["status"] == "True"
    yield pods[0]["metadata"]


def test_mismatch_burst_becomes_one_event_and_kv_integrity_false(
    cluster: Any, kubectl: Any, namespace: str, decode_pod: dict[str, Any]
) -> None:
    client = runtime_client(cluster, kubectl, namespace)
    pod = PodRef(decode_pod["name"], namespace, decode_pod["uid"])
    reporter = MismatchReporter(pod, "tags", kubernetes_poster(client), min_interval_s=30)
    for requests, pages in ((1, 2), (2, 3), (1, 1)):  # one burst: three mismatching batches
        reporter.mismatch(requests=requests, pages=pages)
    # The first report goes out at once; the rest wait out the interval, so close() posts them.
    poll("the first Event", lambda: events(kubectl, namespace))
    reporter.close()

    posted = events(kubectl, namespace)
    assert sum(e["count"] for e in posted) == 3 and len(posted) <= 2
    first = posted[0]
    assert first["type"] == "Warning" and first["reason"] == EVENT_REASON
    assert first["involvedObject"]["uid"] == decode_pod["uid"]
    assert first["metadata"]["labels"] == {"tessera.dev/deployment": "tags"}

    md = poll(
        "KVIntegrity False",
        lambda: (
            (m := get_md(kubectl, namespace, "tags"))
            and conditions(m)["KVIntegrity"]["status"] == "False"
            and m
        ),
    )
    message = conditions(md)["KVIntegrity"]["message"]
    assert "3 mismatch report(s)" in message and decode_pod["name"] in message


def test_runtime_identity_may_only_create_events_in_its_namespace(
    cluster: Any, kubectl: Any, namespace: str
) -> None:
    core = kubernetes.client.CoreV1Api(runtime_client(cluster, kubectl, namespace))
    with pytest.raises(kubernetes.client.ApiException) as denied:
        core.list_namespaced_pod(namespace)
    assert denied.value.status == 403
    with pytest.raises(kubernetes.client.ApiException) as denied:
        core.create_namespaced_event(
            "default",
            {
                "metadata": {"generateName": "x-"},
                "involvedObject": {"kind": "Pod", "name": "x"},
                "reason": EVENT_REASON,
                "message": "m",
                "type": "Warning",
            },
        )
    assert denied.value.status == 403


def events(kubectl: Any, namespace: str) -> list[dict[str, Any]]:
    items = json.loads(
        kubectl(
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            f"reason={EVENT_REASON}",
            "-o",
            "json",
        ).stdout
    )["items"]
    return sorted(items, key=lambda e: e["metadata"]["creationTimestamp"])
