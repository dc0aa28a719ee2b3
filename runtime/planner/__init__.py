"""Capacity planner: from architecture, precision and parallelism to memory per GPU, KV tokens
and concurrency per phase, mirroring SGLang 0.5.23's memory accounting. Pure Python."""

from tessera.runtime.planner.architecture import PRESETS, Architecture, resolve_architecture
from tessera.runtime.planner.errors import PlanError
from tessera.runtime.planner.kv import kv_bytes_per_token_per_gpu
from tessera.runtime.planner.plan import (
    Condition,
    DeploymentPlan,
    Finding,
    PhasePlan,
    PhaseSpec,
    compare_precisions,
    nodes_per_replica,
    plan_deployment,
    plan_phase,
)
from tessera.runtime.planner.weights import (
    Module,
    WeightScheme,
    checkpoint_bytes,
    weight_bytes_per_gpu,
)

__all__ = [
    "PRESETS",
    "Architecture",
    "Condition",
    "DeploymentPlan",
    "Finding",
    "Module",
    "PhasePlan",
    "PhaseSpec",
    "PlanError",
    "WeightScheme",
    "checkpoint_bytes",
    "compare_precisions",
    "kv_bytes_per_token_per_gpu",
    "nodes_per_replica",
    "plan_deployment",
    "plan_phase",
    "resolve_architecture",
    "weight_bytes_per_gpu",
]
