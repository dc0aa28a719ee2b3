"""Prometheus metrics of the operator (served with `tessera operator run --metrics-port`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from tessera.operator import constants as c

RECONCILES = Counter("tessera_operator_reconciles_total",
                     "Reconciles of a ModelDeployment, by result", ["result"])
RECONCILE_SECONDS = Histogram("tessera_operator_reconcile_seconds",
                              "Time to decide and carry out one reconcile")
WRITES = Counter("tessera_operator_writes_total",
                 "Write requests the operator made, by what it wrote",
                 ["action"])  # apply | prune | status | event | restart
DEPLOYMENTS = Gauge("tessera_operator_deployments", "ModelDeployments the operator knows")


# Per-ModelDeployment gauges, read from the operator's store when Prometheus scrapes, so they
# follow status exactly and vanish with the deployment. Only the Lease holder has a store.
DEPLOYMENT_LABELS = ["namespace", "deployment"]
COMPONENTS = (*c.PHASES, c.ROUTER)


def replica_samples(md: Mapping[str, Any]) -> Iterator[tuple[str, int, int]]:
    """(component, desired, ready) for each phase and the router in the deployment's status."""
    status = md.get("status") or {}
    for component in COMPONENTS:
        if component in status:
            part = status[component]
            yield component, int(part.get("replicas", 0)), int(part.get("readyReplicas", 0))


def condition_samples(md: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(type, status, reason) of each condition in the deployment's status."""
    for cond in (md.get("status") or {}).get("conditions", []):
        yield cond["type"], cond["status"], cond.get("reason", "")


class Deployments(Protocol):
    def deployments(self) -> list[tuple[str, str]]: ...
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...


class StatusCollector(Collector):
    """`tessera_modeldeployment_*` gauges from the ModelDeployments the operator holds."""

    def __init__(self) -> None:
        self.store: Deployments | None = None  # set when this replica starts reconciling

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = [*DEPLOYMENT_LABELS, "phase"]
        desired = GaugeMetricFamily("tessera_modeldeployment_replicas",
                                    "Desired replicas of one phase or the router", labels=labels)
        ready = GaugeMetricFamily("tessera_modeldeployment_ready_replicas",
                                  "Ready replicas of one phase or the router", labels=labels)
        conditions = GaugeMetricFamily(
            "tessera_modeldeployment_condition",
            "1 for each condition of a ModelDeployment, with its status and reason",
            labels=[*DEPLOYMENT_LABELS, "type", "status", "reason"])
        store = self.store
        for namespace, name in store.deployments() if store else []:
            md = store.get(c.KIND, namespace, name) if store else None
            if md is None:
                continue
            for component, want, have in replica_samples(md):
                desired.add_metric([namespace, name, component], want)
                ready.add_metric([namespace, name, component], have)
            for kind, status, reason in condition_samples(md):
                conditions.add_metric([namespace, name, kind, status, reason], 1)
        yield from (desired, ready, conditions)


STATUS = StatusCollector()
REGISTRY.register(STATUS)
