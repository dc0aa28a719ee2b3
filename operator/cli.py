"""`tessera operator run`: the operator process."""

from __future__ import annotations

import argparse
import logging
import os
import uuid


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the ModelDeployment operator")
    sub = parser.add_subparsers(dest="operator_command", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="watch ModelDeployments and keep their children converged")
    run.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch only this namespace (repeatable; globs allowed); "
                            "default: all namespaces")
    run.add_argument("--resync-seconds", type=float, default=60.0,
                     help="re-decide every deployment this often (default 60)")
    run.add_argument("--peering", metavar="NAME", default="",
                     help="coordinate replicas through the ClusterKopfPeering NAME: one "
                          "active, the others standing by (needs crds/kopf-peering.yaml)")
    run.add_argument("--verbose", "-v", action="store_true")
    run.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    if args.resync_seconds <= 0:
        raise SystemExit("--resync-seconds must be positive, e.g. 60")
    if args.peering and args.namespace:
        raise SystemExit("--peering coordinates cluster-wide replicas; drop --namespace or "
                         "--peering")
    import kopf  # imported here so other subcommands do not pay for it
    from tessera.operator import handlers

    handlers.RESYNC_SECONDS = args.resync_seconds
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Peers with equal priority all pause (kopf's rule), so each replica takes a distinct one;
    # the highest runs and the rest wait for it to disappear.
    priority = uuid.UUID(os.environ.get("POD_UID") or str(uuid.uuid4())).int % (2**31)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace or None,
        standalone=not args.peering,
        peering_name=args.peering or None,
        priority=priority,
    )
    return 0
