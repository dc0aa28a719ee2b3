"""Simulated H200 nodes: pure builders for Node objects that kwok keeps alive and Ready."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
POOL_LABEL = "tessera.dev/pool"
H200 = "NVIDIA-H200"
# kwok manages only nodes carrying this annotation (see --manage-nodes-with-annotation-selector).
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")


@dataclass(frozen=True)
class NodePool:
    """A group of identical simulated GPU nodes, like one node pool of a cloud cluster."""

    name: str
    nodes: int = 2
    gpus_per_node: int = 8
    gpu_product: str = H200
    cpu: str = "224"
    memory: str = "2Ti"
    # node-local disk for emptyDirs (pods that fetch their weights request its size): a DGX
    # H200's eight 3.84 TB NVMe drives
    ephemeral_storage: str = "27Ti"
    max_pods: int = 250
    # RDMA devices each node advertises, as a device plugin would (e.g. {"rdma/ib": 8}), so
    # the scheduler places RDMA-requesting pods only here. Empty: a pool without RDMA.
    rdma: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.name):
            raise ValueError(
                f"node pool name {self.name!r} is not a DNS label: use lowercase letters, "
                "digits and '-', at most 42 characters"
            )
        if self.nodes < 1:
            raise ValueError(f"node pool {self.name!r}: nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ValueError(f"node pool {self.name!r}: gpus_per_node must be >= 0")
        for resource, count in self.rdma.items():
            if "/" not in resource or resource == GPU_RESOURCE or count < 0:
                raise ValueError(
                    f"node pool {self.name!r}: RDMA resource {resource}={count} must be an "
                    "extended resource name (domain/name, not the GPUs) with a count >= 0")


DEFAULT_POOLS = (NodePool("prefill"), NodePool("decode"))


def parse_pool(spec: str, gpus_per_node: int = 8) -> NodePool:
    """Parse a CLI pool spec `NAME=COUNT[,RESOURCE=N...]` (e.g. `decode=4` or
    `decode=2,rdma/ib=8` for nodes that also advertise 8 RDMA devices)."""
    usage = f"pool spec {spec!r} must look like NAME=COUNT[,RESOURCE=N...], e.g. decode=2,rdma/ib=8"
    pool, *extras = spec.split(",")
    name, sep, count = pool.partition("=")
    if not sep or not count.isdigit():
        raise ValueError(usage)
    rdma = {}
    for extra in extras:
        resource, sep, n = extra.partition("=")
        if not sep or not n.isdigit():
            raise ValueError(usage)
        rdma[resource] = int(n)
    return NodePool(name=name, nodes=int(count), gpus_per_node=gpus_per_node, rdma=rdma)


def node_name(pool: NodePool, index: int) -> str:
    return f"h200-{pool.name}-{index}"


def node_manifest(pool: NodePool, index: int) -> dict[str, Any]:
    resources = {
        "cpu": pool.cpu,
        "memory": pool.memory,
        "ephemeral-storage": pool.ephemeral_storage,
        "pods": str(pool.max_pods),
        GPU_RESOURCE: str(pool.gpus_per_node),
        **{resource: str(count) for resource, count in pool.rdma.items()},
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node_name(pool, index),
            "annotations": {KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE},
            "labels": {
                "kubernetes.io/hostname": node_name(pool, index),
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                GPU_PRODUCT_LABEL: pool.gpu_product,
                POOL_LABEL: pool.name,
            },
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def node_manifests(pools: tuple[NodePool, ...]) -> list[dict[str, Any]]:
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"node pool names must be unique, got {names}")
    return [node_manifest(pool, i) for pool in pools for i in range(pool.nodes)]
