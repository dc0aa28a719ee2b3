"""`tessera operator run`: the operator process."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import uuid

from tessera.operator.stranded import STRANDED_AFTER_S


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the ModelDeployment operator")
    sub = parser.add_subparsers(dest="operator_command", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="watch ModelDeployments and keep their children converged")
    run.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch only this namespace (repeatable; globs allowed); "
                            "default: all namespaces")
    run.add_argument("--resync-seconds", type=float, default=60.0,
                     help="re-decide every deployment this often (default 60)")
    run.add_argument("--leader-election", metavar="NAMESPACE/NAME", default="",
                     help="run only while holding this Lease, so replicas never act at once "
                          "(e.g. tessera-system/tessera-operator); default: no election")
    run.add_argument("--stranded-group-seconds", type=float, default=STRANDED_AFTER_S,
                     help="restart a LeaderWorkerSet group whose workers the scheduler has "
                          "refused this long for pod affinity while other nodes had room (its "
                          f"leader took a block with no room left; default {STRANDED_AFTER_S:g})")
    run.add_argument("--metrics-port", type=int, default=0,
                     help="serve Prometheus metrics on this port (default: none)")
    run.add_argument("--verbose", "-v", action="store_true")
    run.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    if args.resync_seconds <= 0:
        raise SystemExit("--resync-seconds must be positive, e.g. 60")
    if args.stranded_group_seconds <= 0:
        raise SystemExit("--stranded-group-seconds must be positive, e.g. 120")
    if not 0 <= args.metrics_port <= 65535:
        raise SystemExit(f"--metrics-port {args.metrics_port} is not a port; use 1..65535")
    namespace, _, lease = args.leader_election.partition("/")
    if args.leader_election and not (namespace and lease):
        raise SystemExit(f"--leader-election {args.leader_election!r}: expected NAMESPACE/NAME, "
                         "e.g. tessera-system/tessera-operator")
    import kopf  # imported here so other subcommands do not pay for it
    import prometheus_client
    from tessera.operator import handlers
    from tessera.operator.kube import Kube, new_api_client
    from tessera.operator.leader import LeaderLease

    handlers.RESYNC_SECONDS = args.resync_seconds
    handlers.STRANDED_GROUP_SECONDS = args.stranded_group_seconds
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # kopf logs every handler call at INFO: one line per watch event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port)
    if args.leader_election:
        identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        LeaderLease(Kube(new_api_client(retries=False)), lease, namespace, identity).acquire()
    # Leader election is ours (above), so kopf's own peering stays off.
    kopf.run(clusterwide=not args.namespace, namespaces=args.namespace, standalone=True)
    return 0
