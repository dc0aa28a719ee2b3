"""kopf wiring: watch events feed the Store and trigger a reconcile of the owning deployment.
Watched: the ModelDeployments, their children, the children's pods, and the runtime's
KVIntegrityMismatch events.

Only raw watch events are used (no create/update handlers), so kopf keeps no state on our
objects: no annotations, no finalizers, nothing written but what the reconciler decides.
Decisions live in reconcile.decide; these handlers only route.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from tessera.operator import constants as c
from tessera.operator import metrics
from tessera.operator.kube import CHILD_KINDS, PLURALS, Kube, new_api_client
from tessera.operator.reconcile import Reconciler, Store
from tessera.operator.render import render_configs
from tessera.operator.stranded import STRANDED_AFTER_S

from tessera import API_GROUP, API_VERSION

log = logging.getLogger(__name__)

# Set by `tessera operator run` before kopf starts.
RESYNC_SECONDS = 60.0
STRANDED_GROUP_SECONDS = STRANDED_AFTER_S
MANAGED = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.enabled = False  # our own events only, and only on condition changes
    settings.execution.max_workers = 16  # handler threads mostly wait on the API server
    store = Store()
    kube = Kube(new_api_client())
    # Fill the store before the watches start, so the first reconciles see existing children
    # and mismatch reports: a restarted operator neither re-applies what is there nor flips a
    # condition back and forth.
    listings = [(api_version, kind, plural, MANAGED) for (api_version, kind), plural in
                PLURALS.items()]
    listings.append(("v1", "Event", "events", c.LABEL_DEPLOYMENT))
    for listing in listings:
        for obj in (await asyncio.to_thread(kube.list_labelled, *listing)).items:
            if obj["kind"] != "Event" or obj.get("reason") == c.EVENT_REASON_KV_MISMATCH:
                store.put(obj)
    memo.reconciler = Reconciler(kube, store, render_configs,
                                 stranded_after_s=STRANDED_GROUP_SECONDS)
    metrics.STATUS.store = store  # the per-deployment gauges read it at scrape time
    memo.resync = asyncio.create_task(_resync_forever(memo))
    log.info("operator started: %d children cached, resync every %gs", len(store.objects),
             RESYNC_SECONDS)


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    memo.resync.cancel()


async def _resync_forever(memo: kopf.Memo) -> None:
    """Level-triggered safety net: refresh the store from listings, then re-decide every
    deployment; unchanged ones cost nothing."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        try:
            await asyncio.to_thread(refresh_from_listings, memo.reconciler)
            busy = await asyncio.to_thread(memo.reconciler.resync)
            log.info("resync: %d deployment(s) needed requests", busy)
        except Exception:  # a failed resync must not end the loop; the next one retries
            log.exception("resync failed")


def refresh_from_listings(reconciler: Reconciler) -> None:
    """What the watches may have missed, from a listing of each kind the store holds.

    Watches miss things a listing does not: kopf re-reads API discovery only when a CRD
    changes, and a CRD installed while the operator runs (LWS) is often not in discovery yet
    at its last change, so kopf never watches the kind (seen in the e2e tests: LWS groups
    never seen ready); and a watch that restarts from a fresh list reports no deletion of what
    went meanwhile. What a watch event stored after a listing was taken stays."""
    for (api_version, kind), plural in PLURALS.items():
        listing = reconciler.kube.list_labelled(api_version, kind, plural, MANAGED)
        reconciler.store.replace(kind, listing.items, as_of=listing.version)


def _route(memo: kopf.Memo, event: kopf.RawEvent, namespace: str | None, name: str) -> None:
    store: Store = memo.reconciler.store
    obj = dict(event["object"])
    if event["type"] == "DELETED":
        store.drop(obj)
    else:
        store.put(obj)
    memo.reconciler.reconcile(namespace or "", name)


@kopf.on.event(API_GROUP, API_VERSION, c.PLURAL)
def on_model_deployment(event: kopf.RawEvent, memo: kopf.Memo, namespace: str | None,
                        name: str, uid: str, **_: Any) -> None:
    _route(memo, event, namespace, name)
    if event["type"] == "DELETED":
        memo.reconciler.forget(uid)


def _on_child(event: kopf.RawEvent, memo: kopf.Memo, namespace: str | None,
              labels: Mapping[str, str], **_: Any) -> None:
    _route(memo, event, namespace, labels[c.LABEL_DEPLOYMENT])


for (_api_version, _kind), _plural in CHILD_KINDS.items():
    _group, _, _version = _api_version.rpartition("/")
    kopf.on.event(_group, _version, _plural, id=f"child-{_plural}",
                  labels={c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_DEPLOYMENT: kopf.PRESENT},
                  )(_on_child)


# The children's pods: read for what the scheduler and the engines say (refusals.pod_refusals);
# a stranded group's leader is deleted (stranded.py).
kopf.on.event("", "v1", "pods", id="pods",
              labels={c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_DEPLOYMENT: kopf.PRESENT},
              )(_on_child)


def _is_mismatch(body: kopf.Body, **_: Any) -> bool:
    return body.get("reason") == c.EVENT_REASON_KV_MISMATCH


@kopf.on.event("", "v1", "events", labels={c.LABEL_DEPLOYMENT: kopf.PRESENT}, when=_is_mismatch)
def on_mismatch_event(event: kopf.RawEvent, memo: kopf.Memo, namespace: str | None,
                      labels: Mapping[str, str], **_: Any) -> None:
    """The runtime's KVIntegrityMismatch events decide the KVIntegrity condition."""
    _route(memo, event, namespace, labels[c.LABEL_DEPLOYMENT])
