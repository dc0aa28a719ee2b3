"""The `tessera` command line.

Each subcommand lives beside the code it drives and registers itself through a
`register(subparsers)` function. Only the chosen subcommand's module is imported, so each
command needs only its own dependencies: `tessera plan` runs on the base install,
`tessera operator run` on the `operator` extra, without the dev cluster's or the kernels'.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

# command -> (module defining register(subparsers), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "dev-cluster": ("tessera.devcluster.cli",
                    "local Kubernetes control plane with simulated H200 nodes"),
    "demo": ("tessera.demo",
             "the whole project on one machine: cluster, chart, operator, examples"),
    "operator": ("tessera.operator.cli", "run the ModelDeployment operator"),
    "plan": ("tessera.runtime.planner.cli", "capacity plan of a ModelDeployment"),
    "quantize": ("tessera.runtime.quantize.cli", "FP8/BF16 checkpoint -> INT4 W4A16 checkpoint"),
}

# Commands whose dependencies one extra of the package carries, for the missing-package hint.
EXTRAS = {"operator": "operator"}

T = TypeVar("T")


def _needing_dependencies(command: str, step: Callable[[], T]) -> T:
    """Runs `step`; a missing third-party package becomes an error that says what to install."""
    try:
        return step()
    except ModuleNotFoundError as err:
        if not err.name or err.name.partition(".")[0] == "tessera":
            raise
        install = (f"'tessera[{EXTRAS[command]}]'" if command in EXTRAS
                   else err.name.partition(".")[0])
        raise SystemExit(f"tessera {command}: needs the Python package {err.name!r}, which is not "
                         f"installed here (pip install {install})") from err


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: the named subcommand fully registered, the others by name only."""
    args = sys.argv[1:] if argv is None else argv
    chosen = next((arg for arg in args if not arg.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command, (module, help_line) in SUBCOMMANDS.items():
        if command == chosen:
            _needing_dependencies(command, partial(importlib.import_module, module)).register(sub)
        else:
            sub.add_parser(command, help=help_line)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return int(_needing_dependencies(args.command, lambda: args.func(args)) or 0)


if __name__ == "__main__":
    sys.exit(main())
