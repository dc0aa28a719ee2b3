"""Leader election through a coordination.k8s.io Lease, so two replicas never both act.

A replica runs the operator only while it holds the Lease: it takes the Lease when it is free
or expired, renews it every RENEW_SECONDS, and exits the process when it cannot renew before
the Lease would expire (the Deployment restarts it as a candidate). Everything the operator
does is level-triggered and idempotent, so a hand-over at any moment is safe.
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
        """One attempt to take or renew the Lease; False when another replica holds it."""
        now = datetime.datetime.now(datetime.UTC)
        stamp = _micro_time(now)
        try:
            lease = self.kube.request("GET", f"{self.collection}/{self.name}")
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
                             "acquireTime": stamp, "renewTime": stamp}})
                return True
            spec = lease.setdefault("spec", {})
            if not may_take(spec, self.me, now):
                return False
            if spec.get("holderIdentity") != self.me:
                spec["acquireTime"] = stamp
            spec.update(holderIdentity=self.me, leaseDurationSeconds=LEASE_SECONDS,
                        renewTime=stamp)
            # The body's resourceVersion makes this a compare-and-swap: one replica wins.
            self.kube.request("PUT", f"{self.collection}/{self.name}", lease)
            return True
        except kubernetes.client.ApiException as e:
            if e.status == 409:
                return False
            raise

    def acquire(self) -> None:
        """Block until this replica holds the Lease, then keep renewing it in the background."""
        log.info("waiting for leadership (lease %s) as %s", self.where, self.me)
        while not self._try():
            time.sleep(RENEW_SECONDS)
        log.info("leading as %s", self.me)
        threading.Thread(target=self._renew_forever, daemon=True, name="lease").start()

    def _renew_forever(self) -> None:
        last_ok = time.monotonic()
        while True:
            time.sleep(RENEW_SECONDS)
            try:
                if self._try():
                    last_ok = time.monotonic()
                    continue
                log.error("lost the lease to another replica; exiting")
            except Exception:
                log.exception("renewing the lease failed")
                if time.monotonic() - last_ok < LEASE_SECONDS - RENEW_SECONDS:
                    continue
            os._exit(1)  # another replica may act now; this one must stop at once
