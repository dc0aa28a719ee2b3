"""`tessera dev-cluster build|up|down|status|env`: the local control plane from a shell."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tessera.devcluster.build import Binaries, BuildError, cache_root, ensure_binaries
from tessera.devcluster.cluster import ClusterError, DevCluster
from tessera.devcluster.nodes import DEFAULT_POOLS, parse_pool
from tessera.devcluster.promtool import ensure_promtool


def default_state_dir() -> Path:
    return cache_root() / "state" / "dev-cluster"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "dev-cluster", help="a real local Kubernetes control plane with simulated H200 nodes")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where a detached cluster keeps its state "
                             "(default: $TESSERA_CACHE/state/dev-cluster)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = actions.add_parser("build", help="build and cache the control-plane binaries "
                               "(and promtool, for the tests)")
    build.add_argument("--force", action="store_true", help="rebuild even if cached")
    build.add_argument("--cluster-only", action="store_true",
                       help="only what the cluster runs (no promtool; the demo needs none)")
    up = actions.add_parser("up", help="start the cluster (or report the one already up)")
    up.add_argument("--pool", action="append", default=[], metavar="NAME=COUNT[,RES=N]",
                    help="a node pool of simulated H200 nodes, optionally advertising RDMA "
                         "devices (decode=2,rdma/ib=8); repeatable (default: prefill=2 decode=2)")
    up.add_argument("--gpus-per-node", type=int, default=8)
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for Ready")
    actions.add_parser("down", help="stop every process of the cluster and remove its state")
    actions.add_parser("status", help="say whether the cluster is up and list its nodes")
    actions.add_parser("env", help="print `export KUBECONFIG=...` for the running cluster")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or default_state_dir()
    try:
        return ACTIONS[args.action](args, state_dir)
    except (BuildError, ClusterError, ValueError) as err:
        print(f"tessera dev-cluster {args.action}: {err}", file=sys.stderr)
        return 1


def _build(args: argparse.Namespace, state_dir: Path) -> int:
    binaries = ensure_binaries(force=args.force)
    for name, path in vars(binaries).items():
        print(f"{name:24} {path}")
    # Not part of the cluster: the tests check the chart's alert rules and dashboard with it.
    if not args.cluster_only:
        print(f"{'promtool':24} {ensure_promtool(force=args.force)}")
    return 0


def _up(args: argparse.Namespace, state_dir: Path) -> int:
    pools = tuple(parse_pool(s, args.gpus_per_node) for s in args.pool) or DEFAULT_POOLS
    binaries = ensure_binaries()
    existing = DevCluster.attach(state_dir, binaries)
    if existing is not None and existing.running():
        print(f"dev cluster already up at {existing.server} (state: {state_dir}); "
              "`tessera dev-cluster down` stops it")
        if args.pool and existing.pools != pools:
            print("note: it runs pools " + ", ".join(f"{p.name}={p.nodes}" for p in existing.pools)
                  + "; `down` first to change them", file=sys.stderr)
        _print_env(existing)
        return 0
    if existing is not None:
        print(f"removing a stale dev cluster in {state_dir}", file=sys.stderr)
        existing.stop()
    start = time.monotonic()
    cluster = DevCluster.create(state_dir, binaries, pools, detached=True, timeout=args.timeout)
    nodes = sum(p.nodes for p in pools)
    print(f"dev cluster up at {cluster.server} in {time.monotonic() - start:.1f} s "
          f"with {nodes} simulated H200 nodes; audit log: {cluster.audit_log}")
    _print_env(cluster)
    return 0


def _running(state_dir: Path) -> DevCluster | None:
    cluster = DevCluster.attach(state_dir, Binaries.in_cache(cache_root()))
    return cluster if cluster is not None and cluster.running() else None


def _down(args: argparse.Namespace, state_dir: Path) -> int:
    cluster = DevCluster.attach(state_dir, Binaries.in_cache(cache_root()))
    if cluster is None:
        print("no dev cluster is up")
        return 0
    cluster.stop()
    print(f"dev cluster stopped; removed {state_dir}")
    return 0


def _status(args: argparse.Namespace, state_dir: Path) -> int:
    cluster = _running(state_dir)
    if cluster is None:
        print("dev cluster is not up (`tessera dev-cluster up` starts it)")
        return 1
    print(f"dev cluster up at {cluster.server}; kubeconfig: {cluster.kubeconfig}")
    for proc in cluster.processes:
        print(f"  {proc.name:24} pid {proc.pid}")
    print(cluster.kubectl("get", "nodes", "-L", "tessera.dev/pool,nvidia.com/gpu.product").stdout,
          end="")
    return 0


def _env(args: argparse.Namespace, state_dir: Path) -> int:
    cluster = _running(state_dir)
    if cluster is None:
        print("dev cluster is not up; run `tessera dev-cluster up` first", file=sys.stderr)
        return 1
    _print_env(cluster)
    return 0


def _print_env(cluster: DevCluster) -> None:
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print(f"export PATH={cluster.binaries.kubectl.parent}{os.pathsep}$PATH")


ACTIONS = {"build": _build, "up": _up, "down": _down, "status": _status, "env": _env}
