"""SGLang general plugin (entry point group ``sglang.srt.plugins``): integrity in every scheduler.

SGLang 0.5.23 calls ``load_plugins()`` at the start of each scheduler process, before it builds
the ``Scheduler``; hooks must be installed there, since the schedulers are spawned processes that
do not inherit patches from the launcher. ``register`` reads the runtime config named by
``$TESSERA_RUNTIME_CONFIG``; when the tracker is wanted it makes each new ``Scheduler`` install it
right after construction. Otherwise it installs nothing, so the engine runs untouched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from tessera.runtime.config import ENV_CONFIG, RuntimeConfig

log = logging.getLogger(__name__)


def tracker_wanted(config: RuntimeConfig) -> bool:
    """The page-tag tracker runs where decode runs: the decode pool, or a single pool."""
    return config.integrity.enabled and config.phase in ("decode", "single")


def register(env: Mapping[str, str] = os.environ) -> None:
    if not env.get(ENV_CONFIG):
        return  # SGLang started without tessera: nothing to do
    config = RuntimeConfig.from_env(dict(env))
    if not tracker_wanted(config):
        return
    from sglang.srt.managers.scheduler import Scheduler

    from .metrics import IntegrityMetrics
    from .reporter import MismatchReporter, PodRef, kubernetes_poster
    from .sglang_adapter import install

    reporter = MismatchReporter(PodRef.from_env(env), config.deployment, kubernetes_poster())
    construct = Scheduler.__init__

    def init_with_integrity(self: Any, *args: Any, **kwargs: Any) -> None:
        construct(self, *args, **kwargs)
        tracker = install(self, IntegrityMetrics(), reporter)
        log.info("KV integrity tracker installed: %s", tracker.shape)

    Scheduler.__init__ = init_with_integrity
