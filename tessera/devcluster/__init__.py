"""A real local Kubernetes control plane for tests and the demo (see docs/dev-cluster.md)."""

from tessera.devcluster.build import (
    KUBERNETES_VERSION,
    Binaries,
    BuildError,
    cache_root,
    ensure_binaries,
)
from tessera.devcluster.cluster import ClusterError, DevCluster, KubectlError
from tessera.devcluster.nodes import DEFAULT_POOLS, NodePool

__all__ = [
    "DEFAULT_POOLS",
    "KUBERNETES_VERSION",
    "Binaries",
    "BuildError",
    "ClusterError",
    "DevCluster",
    "KubectlError",
    "NodePool",
    "cache_root",
    "ensure_binaries",
]
