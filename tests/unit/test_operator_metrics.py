"""The per-ModelDeployment gauges the dashboard and the alerts read: replicas per phase and
conditions, taken from the operator's store at scrape time."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from tessera.operator import metrics
from tessera.operator.reconcile import Store


def deployment(name: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "tessera.dev/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": name, "namespace": "llm", "resourceVersion": "1"},
            "spec": {}, "status": status}


def scrape(store: Store | None) -> str:
    collector = metrics.StatusCollector()
    collector.store = store
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_gauges_follow_status() -> None:
    store = Store()
    store.put(deployment("kimi-k2", {
        "prefill": {"replicas": 1, "readyReplicas": 1},
        "decode": {"replicas": 2, "readyReplicas": 1},
        "router": {"replicas": 1, "readyReplicas": 0},
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "ComponentsNotReady"},
            {"type": "WeightsReady", "status": "False", "reason": "ConversionFailed"}]}))
    text = scrape(store)
    for line in (
        'tessera_modeldeployment_replicas{deployment="kimi-k2",namespace="llm",phase="decode"} 2.0',
        'tessera_modeldeployment_ready_replicas{deployment="kimi-k2",namespace="llm",'
        'phase="decode"} 1.0',
        'tessera_modeldeployment_ready_replicas{deployment="kimi-k2",namespace="llm",'
        'phase="router"} 0.0',
        'tessera_modeldeployment_condition{deployment="kimi-k2",namespace="llm",'
        'reason="ConversionFailed",status="False",type="WeightsReady"} 1.0',
    ):
        assert line in text, text
    assert 'phase="single"' not in text


def test_a_deleted_deployment_leaves_no_series() -> None:
    store = Store()
    md = deployment("gone", {"single": {"replicas": 1, "readyReplicas": 1}})
    store.put(md)
    assert 'deployment="gone"' in scrape(store)
    store.drop(md)
    assert 'deployment="gone"' not in scrape(store)


def test_a_replica_without_the_lease_reports_no_deployment() -> None:
    text = scrape(None)
    assert "# TYPE tessera_modeldeployment_replicas gauge" in text
    assert "tessera_modeldeployment_replicas{" not in text


def test_the_process_registry_serves_them() -> None:
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("tessera_operator_deployments") is not None
    names = {m.name for m in REGISTRY.collect()}
    assert {"tessera_modeldeployment_replicas", "tessera_modeldeployment_ready_replicas",
            "tessera_modeldeployment_condition"} <= names
