"""Prometheus metrics of the operator (served with `tessera operator run --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("tessera_operator_reconciles_total",
                     "Reconciles of a ModelDeployment, by result", ["result"])
RECONCILE_SECONDS = Histogram("tessera_operator_reconcile_seconds",
                              "Time to decide and carry out one reconcile")
WRITES = Counter("tessera_operator_writes_total",
                 "Write requests the operator made, by what it wrote",
                 ["action"])  # apply | prune | status | event
DEPLOYMENTS = Gauge("tessera_operator_deployments", "ModelDeployments the operator knows")
