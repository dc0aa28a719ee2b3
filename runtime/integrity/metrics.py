"""Prometheus counters of the KV page check (served by the runtime's metrics exporter)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge


class IntegrityMetrics:
    """Checks run, mismatching pages seen, requests aborted, pages under watch."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.checks = Counter(
            "tessera_kv_integrity_checks",
            "Decode-batch requests whose KV pages were checked",
            registry=registry,
        )
        self.mismatched_pages = Counter(
            "tessera_kv_integrity_mismatched_pages",
            "KV pages found freed, re-allocated or remapped under a running request",
            registry=registry,
        )
        self.aborted_requests = Counter(
            "tessera_kv_integrity_aborted_requests",
            "Requests aborted because a KV page they read was not theirs",
            registry=registry,
        )
        self.tracked_pages = Gauge(
            "tessera_kv_integrity_pages_tracked",
            "Physical KV pages carrying a generation tag",
            registry=registry,
        )

    def checked(self, requests: int) -> None:
        self.checks.inc(requests)

    def mismatched(self, requests: int, pages: int) -> None:
        self.aborted_requests.inc(requests)
        self.mismatched_pages.inc(pages)

    def pages_tracked(self, pages: int) -> None:
        self.tracked_pages.set(pages)
