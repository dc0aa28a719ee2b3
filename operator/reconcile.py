"""One reconcile: decide (pure) what to apply, prune, write to status and announce; then do it.

The reconciler reads only from the Store, an in-memory copy of the ModelDeployments, their
children and the runtime's KVIntegrityMismatch events that the watch handlers keep current.
So a reconcile with nothing to change makes no request at all, and a resync is cheap.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes.client import ApiException
from tessera.operator import constants as c
from tessera.operator import metrics
from tessera.operator.children import child_name, desired_children, phases_of, workload_kind
from tessera.operator.conditions import Condition, event_type
from tessera.operator.drift import needs_apply
from tessera.operator.kube import CHILD_KINDS, Kube
from tessera.operator.refusals import (
    NamespaceGone,
    RejectedError,
    Rejection,
    backoff_seconds,
    observe_refusals,
)
from tessera.operator.status import Workload, build_status, observe_group_set, observe_workload
from tessera.operator.stranded import (
    STRANDED_AFTER_S,
    StrandedGroup,
    affinity_refusals,
    restart_window,
    stranded_groups,
)
from tessera.operator.weights import (
    checkpoint_sizes,
    observe_job,
    weights_job_children,
    weights_jobs,
)
from tessera.runtime.planner import DeploymentPlan, PlanError, plan_deployment

Obj = dict[str, Any]
Key = tuple[str, str, str]  # (kind, namespace, name)

log = logging.getLogger(__name__)


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def _newer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether `a` is at least as new as `b` (resourceVersions compared where numeric)."""
    ra, rb = a["metadata"].get("resourceVersion", ""), b["metadata"].get("resourceVersion", "")
    return not (ra.isdigit() and rb.isdigit()) or int(ra) >= int(rb)


def _after(obj: Mapping[str, Any], version: str) -> bool:
    """Whether `obj` is a change made after resourceVersion `version` (numeric ones only)."""
    rv = obj["metadata"].get("resourceVersion", "")
    return rv.isdigit() and version.isdigit() and int(rv) > int(version)


def _same_object(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether `a` and `b` are one object (one uid; either without a uid counts as the same)."""
    ua, ub = a["metadata"].get("uid"), b["metadata"].get("uid")
    return not (ua and ub) or ua == ub


def _trimmed(obj: Obj) -> Obj:
    """`obj` without managedFields: often half an object's size, and nothing here reads them."""
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items()
                                if k != "managedFields"}}


@dataclass
class Store:
    """Thread-safe latest copies of ModelDeployments, their children and mismatch events."""

    objects: dict[Key, Obj] = field(default_factory=dict)
    _gone: dict[Key, Mapping[str, Any]] = field(default_factory=dict)  # deleted, as last seen
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, obj: Obj) -> None:
        with self._lock:
            self._put(_trimmed(obj))

    def _put(self, obj: Obj) -> None:
        k = key_of(obj)
        old = self.objects.get(k)
        if old is None or _newer(obj, old):
            self.objects[k] = obj

    def replace(self, kind: str, listed: list[Obj], as_of: str = "") -> None:
        """A fresh listing of `kind`, taken at resourceVersion `as_of`, replaces what is
        stored of it, except what watch events stored or dropped after it was taken."""
        trimmed = [_trimmed(obj) for obj in listed]
        with self._lock:
            for k in [k for k, obj in self.objects.items()
                      if k[0] == kind and not _after(obj, as_of)]:
                del self.objects[k]
            gone_since = {k for k, gone in self._gone.items()
                          if k[0] == kind and _after(gone, as_of)}
            for obj in trimmed:
                if key_of(obj) not in gone_since:
                    self._put(obj)
            if as_of.isdigit():  # resourceVersions are cluster-wide: every later listing, of
                # any kind, shows what was deleted before this one
                self._gone = {k: gone for k, gone in self._gone.items() if _after(gone, as_of)}

    def drop(self, obj: Mapping[str, Any]) -> None:
        """Forget `obj`, but not a newer object of the same name: LWS recreates a group's pods
        under their old names, and kopf handles each object (uid) on its own, so the old pod's
        deletion can come after the new pod's creation (seen in CI: the group then looked
        short of a pod for good)."""
        k = key_of(obj)
        with self._lock:
            held = self.objects.get(k)
            if held is not None and _same_object(held, obj):
                del self.objects[k]
                self._gone[k] = obj  # until a listing taken after it (replace)

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        with self._lock:
            return self.objects.get((kind, namespace, name))

    def owned_by(self, namespace: str, name: str) -> dict[Key, Obj]:
        """Children and events labelled with this deployment's name."""
        with self._lock:
            return {k: o for k, o in self.objects.items()
                    if k[1] == namespace and k[0] != c.KIND
                    and o["metadata"].get("labels", {}).get(c.LABEL_DEPLOYMENT) == name}

    def deployments(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(ns, name) for kind, ns, name in self.objects if kind == c.KIND]


# The reason of the event that says the API server refused a status write.
STATUS_REJECTED = "StatusRejected"
GROUP_RESTARTED = "GroupRestarted"

# Owned objects the operator reads but never applies or prunes.
_OBSERVED_ONLY = ("Event", "Pod")


@dataclass(frozen=True)
class Decision:
    apply: list[Obj]
    prune: list[Obj]
    status_patch: Obj | None  # a JSON merge patch for .status; None: unchanged
    events: list[Condition]  # conditions whose status or reason changed
    restart: list[StrandedGroup] = field(default_factory=list)  # groups to restart (stranded.py)


def plan_spec(spec: Mapping[str, Any]) -> tuple[DeploymentPlan | None, PlanError | None]:
    try:
        return plan_deployment(spec), None
    except PlanError as e:
        return None, e


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> Obj | None:
    """A merge patch turning `old` into `new` at the top level (None when equal)."""
    if old == new:
        return None
    return {**{k: None for k in old if k not in new}, **new}


@dataclass(frozen=True)
class Intent:
    """What a spec asks for: the plan (or why there is none) and, if admitted, the children.
    It depends only on the spec and the parent's identity, so it is computed once per
    generation."""

    plan: DeploymentPlan | None
    error: PlanError | None
    desired: list[Obj]  # empty when the spec is not admitted
    sizes: dict[str, int] = field(default_factory=dict)  # each phase's checkpoint bytes

    @property
    def admitted(self) -> bool:
        return self.plan is not None and self.plan.ok


def intend(md: Mapping[str, Any],
           render_configs: Callable[[Mapping[str, Any], DeploymentPlan], dict[str, str]]
           ) -> Intent:
    plan, error = plan_spec(md["spec"])
    sizes = checkpoint_sizes(plan) if plan is not None else {}
    if plan is None or not plan.ok:
        return Intent(plan, error, [], sizes)
    jobs = weights_job_children(md, plan.architecture)
    return Intent(plan, error, desired_children(md, render_configs(md, plan), jobs, sizes),
                  sizes)


def decide(md: Mapping[str, Any], owned: Mapping[Key, Obj], intent: Intent,
           now: str, rejections: Sequence[Rejection] = (),
           unserved_kinds: frozenset[str] = frozenset(),
           stranded_after_s: float = STRANDED_AFTER_S,
           settling: frozenset[str] = frozenset(),
           refused_since: Mapping[str, str] | None = None) -> Decision:
    """Everything one reconcile must do, from the parent, its intent, what it owns (its
    children, their pods, the runtime's events), the children the API server rejected
    when last applied, the optional child kinds the cluster does not serve, the phases
    that restarted a stranded group moments ago and since when its pods have been refused
    for pod affinity (`stranded.affinity_refusals`, kept by the caller; None: none yet)
    (pure)."""
    meta, spec = md["metadata"], md["spec"]
    children = {k: o for k, o in owned.items() if o["kind"] not in _OBSERVED_ONLY}
    pods = [o for o in owned.values() if o["kind"] == "Pod"]
    mismatches = [o for o in owned.values() if o["kind"] == "Event"
                  and o.get("reason") == c.EVENT_REASON_KV_MISMATCH]
    apply: list[Obj] = []
    prune: list[Obj] = []
    # A phase whose weights a Job fetches or converts waits for that Job to succeed.
    weights = [observe_job(ref, children.get(("Job", meta["namespace"], ref.name)),
                           intent.sizes.get(ref.phases[0], 0) if ref.action == c.FETCHER
                           else 0, pods)
               for ref in weights_jobs(md)]
    held: set[Key] = {(workload_kind(spec, phase), meta["namespace"],
                       child_name(meta["name"], phase))
                      for job in weights if not job.ready for phase in job.ref.phases}
    # A spec the plan refuses gets no children; one that turned bad keeps the children it
    # has (a bad edit must not take a serving model down). A held Deployment already there is
    # kept as it is.
    if intent.admitted:
        # A kind the cluster does not serve cannot be applied: reported as rejected instead.
        unserved = [d for d in intent.desired if d["kind"] in unserved_kinds]
        rejections = [*rejections, *(r for r in map(_not_served, unserved)
                                     if r not in rejections)]
        held |= {key_of(d) for d in unserved}
        apply = [d for d in intent.desired
                 if key_of(d) not in held and needs_apply(d, children.get(key_of(d)))]
        wanted = {key_of(d) for d in intent.desired}
        # What an unserved child would replace (a phase's Deployment) keeps serving.
        kept = {d["metadata"]["name"] for d in unserved}
        prune = [o for k, o in children.items() if k not in wanted and k[2] not in kept]
    workloads = {component: _observe(spec, children, pods, meta["namespace"], meta["name"],
                                     component)
                 for component in (*phases_of(spec), c.ROUTER)}
    refusals = observe_refusals(spec, {name: w.replica_failure if w else ""
                                       for name, w in workloads.items()}, pods, rejections)
    status, changed = build_status(md, intent.plan, intent.error, workloads, mismatches, now,
                                   weights, refusals)
    return Decision(apply, prune, status_patch(md.get("status") or {}, status), changed,
                    stranded_groups(pods, now, refused_since or {}, stranded_after_s, settling))


def _observe(spec: Mapping[str, Any], children: Mapping[Key, Obj], pods: Sequence[Obj],
             namespace: str, name: str, component: str) -> Workload | None:
    """A component's workload as status reads it (the router is always a Deployment)."""
    child = child_name(name, component)
    if component != c.ROUTER and workload_kind(spec, component) == c.LWS_KIND:
        return observe_group_set(children.get((c.LWS_KIND, namespace, child)),
                                 [p for p in pods if p["metadata"].get("labels", {}).get(
                                     c.LABEL_PHASE) == component])
    return observe_workload(children.get(("Deployment", namespace, child)))


# Child kinds a cluster may lack (their CRD is installed separately), and what to do about it.
OPTIONAL_KINDS = {c.LWS_KIND: (
    "install LeaderWorkerSet (sigs.k8s.io/lws, v0.7.0 or newer) for replicas wider than one "
    "node, or lower tensorParallel to nodePool.gpu.perNode")}


def _not_served(obj: Obj) -> Rejection:
    kind = obj["kind"]
    return Rejection(kind, obj["metadata"]["name"], 404,
                     f"this cluster does not serve {kind} ({obj['apiVersion']}): "
                     f"{OPTIONAL_KINDS[kind]}")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _call_later(delay: float, call: Callable[[], object]) -> None:
    timer = threading.Timer(delay, call)
    timer.daemon = True
    timer.start()


@dataclass(frozen=True)
class Backoff:
    """Children of one generation the API server rejected, and when to try them again."""

    generation: int
    rejections: list[Rejection]
    attempts: int
    retry_at: float  # time.monotonic()


class Reconciler:
    """Runs decide() for each deployment, never twice at once, and carries out the decision."""

    def __init__(self, kube: Kube, store: Store,
                 render_configs: Callable[[Mapping[str, Any], DeploymentPlan],
                                          dict[str, str]],
                 clock: Callable[[], float] = time.monotonic,
                 schedule: Callable[[float, Callable[[], object]], None] | None = None,
                 stranded_after_s: float = STRANDED_AFTER_S,
                 now: Callable[[], str] = _now) -> None:
        self.kube, self.store, self._render = kube, store, render_configs
        self._now = now  # the wall clock, as status and pods' timestamps write it
        self._stranded_after_s = stranded_after_s
        # (deployment uid, phase) -> when it last restarted a stranded group, and how many
        # restarts in a row that was (stranded.py)
        self._restarts: dict[tuple[str, str], tuple[float, int]] = {}
        # deployment uid -> {pod uid: since when it has been refused for pod affinity}
        self._refusals: dict[str, dict[str, str]] = {}
        # When a backoff's retry is due, and how to be called back then (a timer thread).
        self._clock, self._schedule = clock, schedule or _call_later
        self._intents: dict[str, tuple[int, Intent]] = {}  # uid -> (generation, intent)
        self._guard = threading.Lock()
        self._running: set[tuple[str, str]] = set()  # being reconciled now
        self._dirty: set[tuple[str, str]] = set()  # to go round again when that run ends
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="apply")
        self._backoffs: dict[str, Backoff] = {}  # uid -> the rejected apply being retried
        self._status_backoffs: dict[str, Backoff] = {}  # uid -> the refused status write
        self._served: dict[str, bool] = {}  # optional kind -> does the cluster serve it

    def _intent(self, md: Obj) -> Intent:
        meta = md["metadata"]
        generation = int(meta.get("generation", 0))
        cached = self._intents.get(meta["uid"])
        if cached is None or cached[0] != generation:
            cached = (generation, intend(md, self._render))
            self._intents[meta["uid"]] = cached
        return cached[1]

    def _unserved(self, intent: Intent) -> frozenset[str]:
        """The optional kinds `intent` wants that the cluster does not serve. Discovery is
        asked the first time a kind is wanted and again after each resync, so installing or
        removing its CRD is noticed within one resync period (or at the next apply's 404)."""
        wanted = {d["kind"]: d["apiVersion"] for d in intent.desired if d["kind"] in OPTIONAL_KINDS}
        for kind, api_version in wanted.items():
            if kind not in self._served:
                self._served[kind] = self.kube.serves(api_version,
                                                      CHILD_KINDS[(api_version, kind)])
        return frozenset(kind for kind in wanted if not self._served[kind])

    def forget(self, uid: str) -> None:
        """Drop what is cached for a deleted deployment."""
        self._intents.pop(uid, None)
        self._backoffs.pop(uid, None)
        self._status_backoffs.pop(uid, None)
        self._refusals.pop(uid, None)

    def reconcile(self, namespace: str, name: str) -> Decision | None:
        """Reconcile one deployment; if it is already being reconciled, have that run go
        round once more instead of waiting (so no worker thread blocks on another's work,
        and a burst of events for one deployment costs one or two reconciles)."""
        key = (namespace, name)
        with self._guard:
            if key in self._running:
                self._dirty.add(key)
                return None
            self._running.add(key)
        try:
            while True:
                decision = self._reconcile_once(namespace, name)
                with self._guard:
                    if key not in self._dirty:
                        return decision
                    self._dirty.discard(key)
        finally:
            with self._guard:
                self._running.discard(key)
                self._dirty.discard(key)

    def _reconcile_once(self, namespace: str, name: str) -> Decision | None:
        with metrics.RECONCILE_SECONDS.time():
            md = self.store.get(c.KIND, namespace, name)
            if md is None or md["metadata"].get("deletionTimestamp"):
                return None  # gone or going: owner references garbage-collect the children
            try:
                decision = self._decide_and_apply(md)
                self._carry_out(md, decision)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                raise
            metrics.RECONCILES.labels("ok").inc()
            return decision

    def _decide_and_apply(self, md: Obj) -> Decision:
        """decide(), then apply and prune what it asks for. Children the API server refuses
        to apply or delete are reported in status (decided again with them) and retried with
        exponential backoff; each retry logs one line. A rejected generation writes no
        children until its retry is due; an edited spec (a new generation) is tried at once."""
        meta = md["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        generation = int(meta.get("generation", 0))
        held = self._backoffs.get(uid)
        if held is not None and held.generation != generation:
            held = None
        rejected = held.rejections if held else []
        intent = self._intent(md)
        unserved = self._unserved(intent)
        owned, now = self.store.owned_by(namespace, name), self._now()
        refused = self._refusals[uid] = affinity_refusals(
            [o for o in owned.values() if o["kind"] == "Pod"], self._refusals.get(uid, {}), now)
        decision = decide(md, owned, intent, now, rejected, unserved, self._stranded_after_s,
                          self._settling(uid), refused)
        if not (decision.apply or decision.prune) or (
                held is not None and self._clock() < held.retry_at):
            return replace(decision, apply=[], prune=[])
        try:
            rejections = self._apply(decision.apply) + self._prune(decision.prune)
        except NamespaceGone:
            log.debug("%s/%s: its namespace is being deleted; nothing more is applied",
                      namespace, name)
            return replace(decision, apply=[], prune=[])
        if not rejections:
            self._backoffs.pop(uid, None)
        else:
            attempts = held.attempts + 1 if held else 1
            delay = backoff_seconds(attempts)
            self._backoffs[uid] = Backoff(generation, rejections, attempts,
                                          self._clock() + delay)
            said = "; ".join(r.refusal().message for r in rejections).replace("\n", " ")
            log.warning("%s/%s: %s; retry %d in %gs", namespace, name, said, attempts, delay)
            self._schedule(delay, lambda: self.reconcile(namespace, name))
        if rejections != rejected:  # status reports what this apply found
            return replace(decide(md, self.store.owned_by(namespace, name), intent, self._now(),
                                  rejections, self._unserved(intent), self._stranded_after_s,
                                  self._settling(uid), refused),
                           apply=decision.apply, prune=decision.prune)
        return decision

    def _apply(self, objs: list[Obj]) -> list[Rejection]:
        """Apply in parallel, wave by wave: a RoleBinding is checked against its Role, and
        a Deployment's pods need their ServiceAccount and ConfigMaps; so after a wave with a
        rejected child, the later waves wait. Returns the rejections."""
        applied = 0
        rejections: list[Rejection] = []
        for wave in _apply_waves(objs):
            for result in self._pool.map(self._try_apply, wave):
                if isinstance(result, Rejection):
                    rejections.append(result)
                    continue
                self.store.put(result)  # write-through: the next decide sees it
                metrics.WRITES.labels("apply").inc()
                applied += 1
            if rejections:
                break
        if applied:
            log.info("%s/%s: applied %d", objs[0]["metadata"]["namespace"],
                     objs[0]["metadata"]["labels"][c.LABEL_DEPLOYMENT], applied)
        return rejections

    def _prune(self, objs: list[Obj]) -> list[Rejection]:
        """Delete what is no longer wanted; returns the deletions the API server refused."""
        rejections = []
        for obj in objs:
            try:
                self.kube.delete(obj)
            except RejectedError as e:
                rejections.append(e.rejection)
                continue
            self.store.drop(obj)
            metrics.WRITES.labels("prune").inc()
        if pruned := len(objs) - len(rejections):
            log.info("%s/%s: pruned %d", objs[0]["metadata"]["namespace"],
                     objs[0]["metadata"]["labels"][c.LABEL_DEPLOYMENT], pruned)
        return rejections

    def _try_apply(self, obj: Obj) -> Obj | Rejection:
        try:
            return self.kube.apply(obj)
        except RejectedError as e:
            return e.rejection
        except ApiException as e:
            # An optional kind whose CRD was removed since discovery found it (a 404 can also
            # mean the namespace is gone: discovery tells which).
            if e.status != 404 or obj["kind"] not in OPTIONAL_KINDS:
                raise
            served = self.kube.serves(obj["apiVersion"], CHILD_KINDS[(obj["apiVersion"],
                                                                      obj["kind"])])
            self._served[obj["kind"]] = served
            if served:
                raise
            return _not_served(obj)

    def _carry_out(self, md: Obj, decision: Decision) -> None:
        """Write status and post events (children were written in _decide_and_apply). A
        status write the API server refuses is retried with backoff, its events held back
        until it is written (so each is posted once), and said in one line and an event."""
        meta = md["metadata"]
        if decision.status_patch is not None:
            held = self._status_backoffs.get(meta["uid"])
            if held is not None and self._clock() < held.retry_at:
                return
            try:
                written = self.kube.patch_status(md, decision.status_patch)
            except NamespaceGone:
                return  # going with its namespace
            except RejectedError as e:
                attempts = held.attempts + 1 if held else 1
                delay = backoff_seconds(attempts)
                self._status_backoffs[meta["uid"]] = Backoff(
                    int(meta.get("generation", 0)), [e.rejection], attempts,
                    self._clock() + delay)
                said = f"status not written ({e.rejection.code}): {e.rejection.message}"
                log.warning("%s/%s: %s; retry %d in %gs", meta["namespace"], meta["name"],
                            said.replace("\n", " "), attempts, delay)
                self.kube.post_event(md, "Warning", STATUS_REJECTED, said)
                self._schedule(delay, lambda: self.reconcile(meta["namespace"], meta["name"]))
                return
            self._status_backoffs.pop(meta["uid"], None)
            metrics.WRITES.labels("status").inc()
            if written is None:
                return  # deleted meanwhile: its DELETED event drops it from the store
            self.store.put(written)
        for cond in decision.events:
            self.kube.post_event(md, event_type(cond), cond["reason"],
                                 f"{cond['type']} is {cond['status']}: {cond['message']}")
            metrics.WRITES.labels("event").inc()
        self._restart(md, decision.restart)

    def _window(self, in_a_row: int) -> float:
        return restart_window(in_a_row, self._stranded_after_s)

    def _settling(self, uid: str) -> frozenset[str]:
        """The deployment's phases that restarted a group within its restart window: until
        the new leader is placed, the group it left may look stranded too (its worker still
        waits, the freed node not yet given to it), and restarts in a row wait longer. A
        restart more than twice its window ago no longer counts as in a row."""
        now = self._clock()
        self._restarts = {k: (t, n) for k, (t, n) in self._restarts.items()
                          if now - t < 2 * self._window(n)}
        return frozenset(phase for (owner, phase), (t, n) in self._restarts.items()
                         if owner == uid and now - t < self._window(n))

    def _restart(self, md: Obj, groups: Sequence[StrandedGroup]) -> None:
        """Delete each stranded group's leader (LWS then recreates the whole group) and say
        so in an event; a deletion the API server refuses is logged and tried again at the
        next reconcile, which finds the group still stranded."""
        meta = md["metadata"]
        topology = md["spec"].get("nodePool", {}).get("replicaTopologyKey", "the topology key")
        for group in groups:
            try:
                self.kube.delete(dict(group.leader))
            except RejectedError as e:
                log.warning("%s/%s: could not restart %s group %s: %s", meta["namespace"],
                            meta["name"], group.phase, group.group, e.rejection.message)
                continue
            phase = (meta["uid"], group.phase)
            in_a_row = self._restarts.get(phase, (0.0, 0))[1] + 1  # _settling dropped old ones
            self._restarts[phase] = (self._clock(), in_a_row)
            metrics.WRITES.labels("restart").inc()
            message = group.message(topology)
            log.warning("%s/%s: %s", meta["namespace"], meta["name"], message)
            self.kube.post_event(md, "Warning", GROUP_RESTARTED, message)
            metrics.WRITES.labels("event").inc()

    def resync(self) -> int:
        """Reconcile every known deployment; returns how many made any request."""
        busy = 0
        self._served = {}  # discovery is asked again (optional kinds come and go)
        deployments = self.store.deployments()
        metrics.DEPLOYMENTS.set(len(deployments))
        for namespace, name in deployments:
            decision = self.reconcile(namespace, name)
            busy += bool(decision and (decision.apply or decision.prune or decision.events
                                       or decision.status_patch))
        return busy


_LATE_KINDS = ("RoleBinding", "Deployment", c.LWS_KIND)


def _apply_waves(objs: list[Obj]) -> list[list[Obj]]:
    """Everything else first, then RoleBindings, then Deployments, then LeaderWorkerSets
    (empty waves dropped)."""
    waves = [[o for o in objs if o["kind"] not in _LATE_KINDS],
             *([o for o in objs if o["kind"] == kind] for kind in _LATE_KINDS)]
    return [wave for wave in waves if wave]
