"""Falling back to SGLang's own kernel: counted every time, logged the first time per reason."""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("tessera.sglang_kernels")


class Fallbacks:
    """Per (family, reason): how many calls fell back to SGLang's kernel."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def record(self, family: str, reason: str) -> None:
        key = (family, reason)
        if key not in self.counts:
            log.warning("%s: using SGLang's own kernel: %s (logged once)", family, reason)
        self.counts[key] += 1


FALLBACKS = Fallbacks()
