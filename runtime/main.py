"""`tessera-runtime`: the process each engine and router pod runs.

    tessera-runtime serve      [--config PATH]   preflight, metrics, then SGLang as a child
    tessera-runtime preflight  [--config PATH]   the checks alone; prints the result
    tessera-runtime router     [--config PATH]   replaces itself with the SGLang router
    tessera-runtime fetch URI DIR                weights from hf://, s3:// or gs://, verified

PATH defaults to $TESSERA_RUNTIME_CONFIG. Any failure before the engine starts is one log
line, the same text in the termination message file, and an exit code from
`preflight.Failure`.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tessera.runtime.config import (
    ENV_CONFIG,
    ENV_DIST_INIT_ADDR,
    ENV_NODE_RANK,
    ConfigError,
    RouterConfig,
    RuntimeConfig,
)
from tessera.runtime.fetch.download import DEFAULT_WORKERS, FetchError, fetch
from tessera.runtime.fetch.source import FetchFailure, SourceError
from tessera.runtime.preflight import (
    Failure,
    PreflightResult,
    installed_engine_version,
    probe_gpus_isolated,
    probe_rdma,
    read_checkpoint,
    run_preflight,
)
from tessera.runtime.sglang_args import (
    SGLANG_ROUTER,
    SGLANG_SERVER,
    NodePlacement,
    router_argv,
    sglang_argv,
    transfer_env,
)
from tessera.runtime.sglang_kernels import kernel_problem

log = logging.getLogger("tessera-runtime")

TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_LIMIT = 4096  # bytes Kubernetes keeps of the termination message
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Stop(Exception):
    """A failure before the engine starts: its exit code and one-line reason."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


def write_termination_message(path: str, message: str) -> None:
    """Best effort: outside Kubernetes the file's directory may not exist."""
    try:
        with open(path, "w") as f:
            f.write(message.encode()[:TERMINATION_LOG_LIMIT].decode(errors="ignore"))
    except OSError:
        pass


def config_path(args: argparse.Namespace) -> str:
    path = args.config or os.environ.get(ENV_CONFIG)
    if not path:
        raise Stop(Failure.CONFIG, f"no runtime config: pass --config PATH or set ${ENV_CONFIG}")
    return str(path)


def node_placement(config: RuntimeConfig, env: Mapping[str, str]) -> NodePlacement | None:
    """This pod's rank in a replica spanning nodes, from the env the operator sets."""
    if config.parallel.nnodes == 1:
        return None
    rank, addr = env.get(ENV_NODE_RANK, ""), env.get(ENV_DIST_INIT_ADDR, "")
    if not rank.isdigit() or not addr:
        raise Stop(Failure.CONFIG,
                   f"parallel.nnodes is {config.parallel.nnodes}: set ${ENV_NODE_RANK} "
                   f"(0..{config.parallel.nnodes - 1}) and ${ENV_DIST_INIT_ADDR} (host:port)")
    return NodePlacement(rank=int(rank), dist_init_addr=addr)


def preflight(config: RuntimeConfig) -> PreflightResult:
    return run_preflight(config, probe_gpus_isolated(), read_checkpoint(config.model.path),
                         installed_engine_version(), probe_rdma())


def engine_env(config: RuntimeConfig, result: PreflightResult) -> dict[str, str]:
    """What SGLang's process needs beyond ours: the transfer backend's transport."""
    if result.transport is None:
        return {}
    return transfer_env(config.disaggregation, result.transport)


def versions() -> dict[str, str]:
    found = {}
    for package in ("tessera", "sglang", "torch"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "none"
    return found


def run_engine(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the engine as a child, pass SIGTERM/SIGINT on, return its exit code."""
    child = subprocess.Popen(list(argv), env=dict(env))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def cmd_preflight(args: argparse.Namespace) -> int:
    result = preflight(RuntimeConfig.from_file(config_path(args)))
    if result.problem is not None:
        raise Stop(result.problem.failure, result.summary)
    log.info(result.summary)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    path = config_path(args)
    config = RuntimeConfig.from_file(path)
    # Our own process keeps prometheus-client in single-process mode; only the engine's
    # processes write to the multiprocess directory (see metrics.py).
    os.environ.pop(MULTIPROC_ENV, None)
    from prometheus_client import start_http_server
    from tessera.runtime.metrics import RuntimeMetrics, TesseraSamples

    multiproc_dir = tempfile.mkdtemp(prefix="tessera-metrics-")
    atexit.register(shutil.rmtree, multiproc_dir, ignore_errors=True)
    metrics = RuntimeMetrics()
    metrics.registry.register(TesseraSamples(multiproc_dir))
    metrics.describe(config, versions())
    start_http_server(config.ports.metrics, registry=metrics.registry)

    result = preflight(config)
    metrics.record_preflight(result)
    if result.problem is not None:
        raise Stop(result.problem.failure, result.summary)
    log.info(result.summary)
    # The kernel patches run inside SGLang's processes, where a mismatch would kill a
    # scheduler; check the pinned contract here, where it is one line and an exit code.
    problem = kernel_problem(config)
    if problem is not None:
        raise Stop(Failure.ENGINE_VERSION, problem)

    argv = [*SGLANG_SERVER, *sglang_argv(config, node_placement(config, os.environ),
                                         result.transport)]
    log.info("starting SGLang: %s", " ".join(argv))
    env = {**os.environ, **engine_env(config, result),
           MULTIPROC_ENV: multiproc_dir, ENV_CONFIG: os.path.abspath(path)}
    code = run_engine(argv, env)
    if code != 0:
        write_termination_message(args.termination_log, f"SGLang exited with code {code}")
    return code


def cmd_router(args: argparse.Namespace) -> int:
    config = RouterConfig.from_file(config_path(args))
    argv = [*SGLANG_ROUTER, *router_argv(config)]
    log.info("starting the SGLang router: %s", " ".join(argv))
    os.execv(argv[0], argv)


def cmd_fetch(args: argparse.Namespace) -> int:
    """Exit codes: FetchFailure; the one-line reason also goes to the termination log."""
    try:
        summary = fetch(args.uri, Path(args.dir), workers=args.workers)
    except SourceError as e:
        return _fail(args, FetchFailure.BAD_URI, str(e))
    except FetchError as e:
        return _fail(args, e.failure, str(e))
    log.info(summary)
    write_termination_message(args.termination_log, summary)
    return 0


def _fail(args: argparse.Namespace, code: int, message: str) -> int:
    log.error(message)
    write_termination_message(args.termination_log, message)
    return code


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "serve": (cmd_serve, "preflight, metrics, then SGLang for this phase"),
    "preflight": (cmd_preflight, "only the checks; exit code says which failed"),
    "router": (cmd_router, "run the SGLang router for a RouterConfig"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera-runtime",
                                     description="Runs one tessera engine or router pod.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (func, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", help=f"runtime config file (default: ${ENV_CONFIG})")
        p.add_argument("--termination-log", default=TERMINATION_LOG,
                       help="where the reason for a failed start is written")
        p.set_defaults(func=func)
    fetch = sub.add_parser("fetch", help="fetch weights (hf://, s3://, gs://) into DIR, "
                           "resumable, every file verified")
    fetch.add_argument("uri", help="hf://org/repo[@revision], s3://bucket/dir or gs://bucket/dir")
    fetch.add_argument("dir", help="destination folder (a retried fetch resumes there)")
    fetch.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                       help="files fetched at once")
    fetch.add_argument("--termination-log", default=TERMINATION_LOG,
                       help="where the outcome is written")
    fetch.set_defaults(func=cmd_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        return stop(args, Stop(Failure.CONFIG, str(e)))
    except Stop as e:
        return stop(args, e)


def stop(args: argparse.Namespace, reason: Stop) -> int:
    log.error(str(reason))
    write_termination_message(args.termination_log, str(reason))
    return int(reason.failure)


if __name__ == "__main__":
    sys.exit(main())
