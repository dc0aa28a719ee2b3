"""Leader election through a coordination.k8s.io Lease, so two replicas never both act.

A replica runs the operator only while it holds the Lease: it takes the Lease when it is free
or expired and renews it every RENEW_SECONDS. Through a short API server outage it retries
every RETRY_SECONDS and keeps going; when no renewal has succeeded for RENEW_DEADLINE_SECONDS
(before the Lease could expire and another replica take it), or another replica holds the
Lease, it exits the process, and its Deployment restarts it as a candidate. Everything the
operator does is level-triggered and idempotent, so a hand-over at any moment is safe.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import kubernetes
from tessera.operator.kube import Kube

LEASE_SECONDS = 15
RENEW_SECONDS = 5
RETRY_SECONDS = 2  # after a failed attempt
# Stop leading this long after the last renewal: earlier than LEASE_SECONDS, so this replica
# has stopped before any other may take the Lease.
RENEW_DEADLINE_SECONDS = 10

log = logging.getLogger(__name__)


def _micro_time(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def may_take(spec: Mapping[str, Any], me: str, now: datetime.datetime) -> bool:
    """Whether `me` may hold a Lease with this spec: it is ours, unheld, or expired."""
    holder = spec.get("holderIdentity")
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    if not holder or holder == me or not renewed:
        return True
    duration = datetime.timedelta(seconds=int(spec.get("leaseDurationSeconds") or LEASE_SECONDS))
    return now >= datetime.datetime.fromisoformat(renewed) + duration


class LeaderLease:
    def __init__(self, kube: Kube, name: str, namespace: str, identity: str) -> None:
        self.kube, self.me = kube, identity
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.name, self.where = name, f"{namespace}/{name}"

    def _try(self) -> bool:
        """One attempt to take or renew the Lease; False when another replica holds it.
        Raises when the API server does not answer within RETRY_SECONDS."""
        now = datetime.datetime.now(datetime.UTC)
        stamp = _micro_time(now)
        try:
            lease = self.kube.request("GET", f"{self.collection}/{self.name}",
                                      timeout=RETRY_SECONDS)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise
            lease = None
        try:
            if lease is None:
                self.kube.request("POST", self.collection, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name},
                    "spec": {"holderIdentity": self.me, "leaseDurationSeconds": LEASE_SECONDS,
                             "acquireTime": stamp, "renewTime": stamp}},
                    timeout=RETRY_SECONDS)
                return True
            spec = lease.setdefault("spec", {})
            if not may_take(spec, self.me, now):
                return False
            if spec.get("holderIdentity") != self.me:
                spec["acquireTime"] = stamp
            spec.update(holderIdentity=self.me, leaseDurationSeconds=LEASE_SECONDS,
                        renewTime=stamp)
            # The body's resourceVersion makes this a compare-and-swap: one replica wins.
            self.kube.request("PUT", f"{self.collection}/{self.name}", lease,
                              timeout=RETRY_SECONDS)
            return True
        except kubernetes.client.ApiException as e:
            if e.status == 409:
                return False
            raise

    def acquire(self) -> None:
        """Block until this replica holds the Lease, then keep renewing it in the background."""
        log.info("waiting for leadership (lease %s) as %s", self.where, self.me)
        while True:
            try:
                if self._try():
                    break
            except Exception as err:  # the API server is unreachable: a candidate just waits
                log.warning("taking lease %s failed, retrying in %d s: %s", self.where,
                            RENEW_SECONDS, _one_line(err))
            time.sleep(RENEW_SECONDS)
        log.info("leading as %s", self.me)
        threading.Thread(target=self._renew_forever, daemon=True, name="lease").start()

    def _renew_forever(self) -> None:
        last_ok = time.monotonic()
        wait = RENEW_SECONDS
        while True:
            time.sleep(wait)
            try:
                held = self._try()
            except Exception as err:  # expected while the API server is away: one line each
                since = time.monotonic() - last_ok
                if since < RENEW_DEADLINE_SECONDS:
                    log.warning("renewing lease %s failed (%.0f s since the last renewal, "
                                "stopping at %d s), retrying in %d s: %s", self.where, since,
                                RENEW_DEADLINE_SECONDS, RETRY_SECONDS, _one_line(err))
                    wait = RETRY_SECONDS
                    continue
                log.error("could not renew lease %s for %.0f s: %s; exiting, so that another "
                          "replica may lead (the Deployment restarts this one)", self.where,
                          since, _one_line(err))
                os._exit(1)  # the Lease expires soon: this replica must stop acting at once
            if not held:
                log.error("lost lease %s to another replica; exiting", self.where)
                os._exit(1)
            if wait == RETRY_SECONDS:
                log.info("renewed lease %s again after %.0f s", self.where,
                         time.monotonic() - last_ok)
            last_ok, wait = time.monotonic(), RENEW_SECONDS


def _one_line(err: BaseException) -> str:
    """An exception as one log line: its type and the first line of what it says."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
