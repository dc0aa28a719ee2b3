"""The `tessera` command line.

Each subcommand lives beside the code it drives and registers itself through a
`register(subparsers)` function; this module only lists them, imported lazily so
that `tessera plan` does not pay for kopf or torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand module -> its one-line help. Each module defines register(subparsers).
SUBCOMMANDS: dict[str, str] = {
    "tessera.devcluster.cli": "local Kubernetes control plane with simulated H200 nodes",
    "tessera.demo": "the whole project on one machine: cluster, chart, operator, examples",
    "tessera.operator.cli": "run the ModelDeployment operator",
    "tessera.runtime.planner.cli": "capacity plan of a ModelDeployment",
    "tessera.runtime.quantize.cli": "FP8/BF16 checkpoint -> INT4 W4A16 checkpoint",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
