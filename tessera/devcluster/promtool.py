"""Builds Prometheus's `promtool` once from the Go module proxy and caches it beside the
control-plane binaries (``<cache root>/prometheus/<version>/bin/promtool``).

The tests use it to check and unit-test the chart's alert rules and to parse every query of the
Grafana dashboard, with Prometheus's own parser rather than a copy of it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tessera.devcluster.build import (
    BuildError,
    Progress,
    _build_go,
    _exclusive,
    _go_env,
    _module_go_mod,
    cache_root,
    find_go,
    parse_go_version,
)

# Prometheus 3.x publishes its Go module as v0.3<minor>.<patch>: v0.316.0 is Prometheus 3.16.0.
PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS_VERSION = "v0.316.0"
PROMETHEUS_MIN_GO = (1, 26)  # its go.mod says go 1.26.7


def promtool_path(root: Path | None = None) -> Path:
    return (root or cache_root()) / "prometheus" / PROMETHEUS_VERSION / "bin" / "promtool"


def ensure_promtool(root: Path | None = None, progress: Progress | None = None,
                    force: bool = False) -> Path:
    """Return the cached promtool, building it first when it is missing (or with `force`)."""
    root = root or cache_root()
    say = progress or (lambda msg: print(f"[tessera build] {msg}", file=sys.stderr, flush=True))
    target = promtool_path(root)
    if target.is_file() and not force:
        return target
    # Its own lock: promtool can build while the control plane builds (the Go caches are safe
    # for concurrent use).
    with _exclusive(root / "promtool.lock"):
        if target.is_file() and not force:
            return target
        go = find_go()
        found = subprocess.run([str(go), "env", "GOVERSION"], env=_go_env(root),
                               capture_output=True, text=True).stdout.strip()
        if parse_go_version(found) < PROMETHEUS_MIN_GO:
            raise BuildError(
                f"{go} is {found}; promtool {PROMETHEUS_VERSION} needs Go >= 1.26.7. "
                "Install a newer Go from https://go.dev/dl/ or set GO=/path/to/go.")
        start = time.monotonic()
        ldflags = f"-s -w -X github.com/prometheus/common/version.Version={PROMETHEUS_VERSION}"
        _build_go("prometheus", PROMETHEUS_VERSION,
                  _module_go_mod(PROMETHEUS_MODULE, PROMETHEUS_VERSION),
                  {"promtool": f"{PROMETHEUS_MODULE}/cmd/promtool"}, ldflags, root, say, force)
        say(f"promtool ready in {time.monotonic() - start:.0f} s")
        return target
