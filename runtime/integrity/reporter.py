"""Report KV page mismatches to the cluster: a Warning Event on the pod, at most one per interval.

The operator watches Events with reason ``KVIntegrityMismatch`` and the label
``tessera.dev/deployment`` and turns them into the ModelDeployment's ``KVIntegrity`` condition.
Mismatches that arrive while an Event was posted less than ``min_interval_s`` ago are merged
into the next one (its ``count`` says how many mismatch reports it stands for), so a burst costs
the API server one write. Posting happens on a worker thread: the scheduler never waits on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)

EVENT_REASON = "KVIntegrityMismatch"
LABEL_DEPLOYMENT = "tessera.dev/deployment"
REPORTING_COMPONENT = "tessera.dev/runtime"
POD_ENV = {"name": "POD_NAME", "namespace": "POD_NAMESPACE", "uid": "POD_UID"}


@dataclass(frozen=True)
class PodRef:
    """The pod this runtime runs in, from the downward API."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PodRef:
        missing = [var for var in POD_ENV.values() if not env.get(var)]
        if missing:
            raise ValueError(
                f"integrity reporting needs the pod's identity in {', '.join(missing)}: set them "
                "from the downward API (fieldRef metadata.name, metadata.namespace, metadata.uid)"
            )
        return cls(**{field: env[var] for field, var in POD_ENV.items()})


@dataclass(frozen=True)
class Burst:
    """Mismatches merged into one Event."""

    reports: int
    requests: int
    pages: int
    first: datetime
    last: datetime

    def add(self, requests: int, pages: int, at: datetime) -> Burst:
        return Burst(self.reports + 1, self.requests + requests, self.pages + pages, self.first, at)


def _timestamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_event(pod: PodRef, deployment: str, burst: Burst) -> dict[str, Any]:
    """The core/v1 Event for one burst of mismatches."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "generateName": f"{pod.name}.kv-integrity-",
            "namespace": pod.namespace,
            "labels": {LABEL_DEPLOYMENT: deployment},
        },
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.name,
            "namespace": pod.namespace,
            "uid": pod.uid,
        },
        "type": "Warning",
        "reason": EVENT_REASON,
        "message": (
            f"KV page check aborted {burst.requests} request(s): {burst.pages} KV page(s) were "
            f"freed, re-allocated or remapped under them ({burst.reports} mismatching decode "
            f"batch(es) between {_timestamp(burst.first)} and {_timestamp(burst.last)})"
        ),
        "count": burst.reports,
        "firstTimestamp": _timestamp(burst.first),
        "lastTimestamp": _timestamp(burst.last),
        "source": {"component": REPORTING_COMPONENT},
        "reportingComponent": REPORTING_COMPONENT,
        "reportingInstance": pod.name,
    }


class MismatchReporter:
    """Merges mismatches into bursts and posts one Event per burst from a worker thread."""

    def __init__(
        self,
        pod: PodRef,
        deployment: str,
        post: Callable[[dict[str, Any]], None],
        min_interval_s: float = 60.0,
    ) -> None:
        if min_interval_s <= 0:
            raise ValueError(f"min_interval_s must be > 0, got {min_interval_s}")
        self.pod, self.deployment, self._post = pod, deployment, post
        self.min_interval_s = min_interval_s
        self._pending: Burst | None = None
        self._last_post = -float("inf")  # monotonic seconds
        self._cond = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="kv-integrity-events", daemon=True)
        self._worker.start()

    def mismatch(self, requests: int, pages: int) -> None:
        """Called by the scheduler after it aborted ``requests`` requests; never blocks on I/O."""
        now = datetime.now(UTC)
        with self._cond:
            if self._pending is None:
                self._pending = Burst(1, requests, pages, now, now)
            else:
                self._pending = self._pending.add(requests, pages, now)
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Post what is pending now, then stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._worker.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                # Rate limit: hold a burst until min_interval_s has passed since the last post.
                while (
                    not self._closed
                    and (wait := self._last_post + self.min_interval_s - time.monotonic()) > 0
                ):
                    self._cond.wait(wait)
                burst, self._pending = self._pending, None
                closed = self._closed
            if burst is not None:
                self._last_post = time.monotonic()
                try:
                    self._post(build_event(self.pod, self.deployment, burst))
                except Exception:  # reporting must never take the server down
                    log.exception("could not post the KV integrity Event for %s", self.pod.name)
            if closed:
                return


def kubernetes_poster(api_client: Any | None = None) -> Callable[[dict[str, Any]], None]:
    """Post Events with the pod's ServiceAccount (in-cluster config unless a client is given)."""
    from kubernetes import client, config

    if api_client is None:
        config.load_incluster_config()
        api_client = client.ApiClient()
    core = client.CoreV1Api(api_client)

    def post(event: dict[str, Any]) -> None:
        body: Any = event  # the client sends a plain dict as it is; no model class needed
        core.create_namespaced_event(event["metadata"]["namespace"], body)

    return post
