"""KV-cache integrity: per-page generation tags, a batched check before decode, reporting.

Off by default: the runtime then holds a `NoopTracker` and installs nothing.
On: `sglang_adapter.install(scheduler, metrics, reporter)` inside SGLang's scheduler process.
"""

from .metrics import IntegrityMetrics
from .reporter import MismatchReporter, PodRef, build_event, kubernetes_poster
from .tracker import NoopTracker, PageTagTracker, Tracker, TrackerShape, agree_across_ranks

__all__ = [
    "IntegrityMetrics",
    "MismatchReporter",
    "NoopTracker",
    "PageTagTracker",
    "PodRef",
    "Tracker",
    "TrackerShape",
    "agree_across_ranks",
    "build_event",
    "kubernetes_poster",
]
