"""The Jobs that make a phase's weights appear before it rolls out, and what they say about
the weights (pure; no API calls).

- Fetch: a phase with hf/s3/gs weights and a cache claim (`weights.cache.pvc`) gets a Job
  running `tessera-runtime fetch URI` into the claim's folder for that URI; its pods then
  mount that folder read-only. Phases fetching the same URI into the same claim share the Job.
  (Without a cache, each engine pod fetches for itself in an init container: children.py.)
- Convert: a phase whose `weights.convertFrom` names a source gets one Job: an init container
  runs `tessera quantize convert` from the source to `weights.uri`, then the container runs
  `tessera quantize verify` on the result. A hf/s3/gs source is fetched first, by another
  init container, into the output claim.

A phase's workload is applied only once its Job has succeeded. A Job's name carries a hash of
what it does, so a changed URI (a new revision) makes a new Job instead of an edit the API
server refuses (a Job's template is immutable), and the phase rolls when it succeeds. A failed
Job stays failed: nothing recreates it until the spec changes. A fetch that fails for a
reason a retry cannot fix (a refused credential, a missing repository) fails the Job at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.operator import constants as c
from tessera.operator.children import (
    child_name,
    fetch_container,
    owned_metadata,
    phase_scheduling,
    phases_of,
    stable_hash,
)
from tessera.operator.conditions import FALSE, TRUE, Condition, make_condition
from tessera.operator.refusals import UNSCHEDULABLE, pod_refusals
from tessera.runtime.fetch.source import PERMANENT_FAILURES, FetchFailure, cache_dir, is_remote
from tessera.runtime.planner import Architecture, DeploymentPlan, checkpoint_bytes
from tessera.runtime.quantize.job import converter_job
from tessera.runtime.quantize.options import Options

Obj = dict[str, Any]

# Pod retries of one Job; each resumes from the manifest on the output volume.
BACKOFF_LIMIT = 3
PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
# Inside the output claim of a conversion: where a hf/s3/gs source is fetched to.
SOURCES_DIR = ".sources"
GiB = 1 << 30


def _pvc(uri: str) -> tuple[str, str]:
    """pvc://claim/dir -> (claim, dir)."""
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    return claim, path.strip("/")


def job_name(md: Mapping[str, Any], phase: str) -> str:
    weights = md["spec"][phase]["weights"]
    inputs = {"from": weights["convertFrom"], "to": weights["uri"],
              "groupSize": weights.get("groupSize", 128)}
    return child_name(md["metadata"]["name"], c.CONVERTER, stable_hash(inputs)[:8])


def largest_tensor_bytes(arch: Architecture) -> int:
    """The embedding (or output head) in BF16: the biggest tensor the converter holds."""
    return arch.vocab_size * arch.hidden_size * 2


def converter_job_child(md: Mapping[str, Any], phase: str, largest_tensor: int) -> Obj:
    """The Job converting `phase`'s weights; pods run in the engine image, without a GPU, on the
    phase's nodes (its node selector, the pool's tolerations): where the output claim will be
    mounted, and the only nodes a GPU-only cluster has."""
    weights = md["spec"][phase]["weights"]
    job = converter_job(Options(group_size=int(weights.get("groupSize", 128))), largest_tensor)
    source_uri = weights["convertFrom"]["uri"]
    out_claim, out_dir = _pvc(weights["uri"])
    # A hf/s3/gs source is fetched into the output claim first (resumable there too).
    src_claim, src_dir = ((out_claim, f"{SOURCES_DIR}/{cache_dir(source_uri)}")
                          if is_remote(source_uri) else _pvc(source_uri))
    # One volume per claim: source and output may be folders of the same claim.
    volumes = [{"name": "output", "persistentVolumeClaim": {"claimName": out_claim}}]
    if src_claim != out_claim:
        volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": src_claim,
                                                                     "readOnly": True}})
    source_mount = {"name": "source" if src_claim != out_claim else "output",
                    "mountPath": job.source_mount, "subPath": src_dir, "readOnly": True}
    output_mount = {"name": "output", "mountPath": job.output_mount, "subPath": out_dir}
    memory = str(job.memory_bytes)
    image = md["spec"]["engine"]["image"]
    resources = {"requests": {"memory": memory}, "limits": {"memory": memory}}
    fetch = ([fetch_container(image, source_uri, weights.get("credentialsSecret"),
                              {**source_mount, "readOnly": False})]
             if is_remote(source_uri) else [])
    return _job(md, phase, job_name(md, phase), c.CONVERTER, {
        "restartPolicy": "Never",
        "initContainers": [*fetch, {"name": "convert", "image": image,
                                    "command": list(job.argv), "resources": resources,
                                    "volumeMounts": [source_mount, output_mount]}],
        "containers": [{"name": "verify", "image": image,
                        "command": ["tessera", "quantize", "verify", job.output_mount],
                        "resources": resources,
                        "volumeMounts": [{**output_mount, "readOnly": True}]}],
        "volumes": volumes})


def cache_claim(weights: Mapping[str, Any]) -> str | None:
    """The claim hf/s3/gs weights are fetched into once, if the spec names one."""
    claim = weights.get("cache", {}).get("pvc")
    return str(claim) if claim and is_remote(weights["uri"]) else None


def fetch_job_name(md: Mapping[str, Any], uri: str, claim: str) -> str:
    return child_name(md["metadata"]["name"], c.FETCHER,
                      stable_hash({"uri": uri, "claim": claim})[:8])


def fetch_job_child(md: Mapping[str, Any], phase: str) -> Obj:
    """The Job fetching `phase`'s weights into its cache claim, on the phase's nodes (where
    the claim will be mounted). Its pods retry on errors a retry can fix (the store
    unreachable, a corrupted download), resuming from what the claim already holds."""
    weights = md["spec"][phase]["weights"]
    uri = weights["uri"]
    claim = cache_claim(weights)
    assert claim is not None
    mount = {"name": "cache", "mountPath": c.MODELS_DIR, "subPath": cache_dir(uri)}
    container = fetch_container(md["spec"]["engine"]["image"], uri,
                                weights.get("credentialsSecret"), mount)
    return _job(md, phase, fetch_job_name(md, uri, claim), c.FETCHER, {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": claim}}],
    }, pod_failure_policy={"rules": [{"action": "FailJob", "onExitCodes": {
        "containerName": container["name"], "operator": "In",
        "values": [int(f) for f in PERMANENT_FAILURES]}}]})


def _job(md: Mapping[str, Any], phase: str, name: str, component: str, pod_spec: Obj,
         pod_failure_policy: Obj | None = None) -> Obj:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": owned_metadata(md, name, component),
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            **({"podFailurePolicy": pod_failure_policy} if pod_failure_policy else {}),
            "template": {
                "metadata": {"labels": {c.LABEL_DEPLOYMENT: md["metadata"]["name"],
                                        c.LABEL_PHASE: component,
                                        c.LABEL_MANAGED_BY: c.MANAGED_BY}},
                "spec": {**pod_spec, **phase_scheduling(md["spec"], phase)},
            },
        },
    }


@dataclass(frozen=True)
class WeightsJobRef:
    """A Job some phases wait for, named from the spec alone."""

    name: str
    action: str  # c.FETCHER | c.CONVERTER
    phases: tuple[str, ...]
    source: str  # the URI it fetches or converts from


def weights_jobs(spec_md: Mapping[str, Any]) -> list[WeightsJobRef]:
    """Every fetch or conversion Job of a ModelDeployment, with the phases that wait for it."""
    spec = spec_md["spec"]
    refs: dict[str, WeightsJobRef] = {}
    for phase in phases_of(spec):
        weights = spec[phase]["weights"]
        claim = cache_claim(weights)
        if "convertFrom" in weights:
            ref = WeightsJobRef(job_name(spec_md, phase), c.CONVERTER, (phase,),
                                weights["convertFrom"]["uri"])
        elif claim is not None:
            ref = WeightsJobRef(fetch_job_name(spec_md, weights["uri"], claim), c.FETCHER,
                                (phase,), weights["uri"])
        else:
            continue
        old = refs.get(ref.name)
        refs[ref.name] = ref if old is None else WeightsJobRef(
            ref.name, ref.action, (*old.phases, phase), ref.source)
    return list(refs.values())


def checkpoint_sizes(plan: DeploymentPlan) -> dict[str, int]:
    """The planner's bytes on disk of each phase's checkpoint."""
    return {phase: checkpoint_bytes(plan.architecture, planned.spec.weights)
            for phase, planned in plan.phases.items()}


def weights_job_children(md: Mapping[str, Any], arch: Architecture) -> list[Obj]:
    return [converter_job_child(md, ref.phases[0], largest_tensor_bytes(arch))
            if ref.action == c.CONVERTER else fetch_job_child(md, ref.phases[0])
            for ref in weights_jobs(md)]


@dataclass(frozen=True)
class WeightsJob:
    """One observed fetch or conversion Job, reduced to what decide and status need."""

    ref: WeightsJobRef
    state: str  # PENDING | RUNNING | SUCCEEDED | FAILED
    message: str

    @property
    def ready(self) -> bool:
        return self.state == SUCCEEDED


_VERB = {c.FETCHER: ("fetching", "fetched and verified"),
         c.CONVERTER: ("converting", "converted and verified")}
_EXIT_CODE = re.compile(r"exit code (\d+)")
_WHY = {FetchFailure.BAD_URI: "the URI names nothing fetchable",
        FetchFailure.CREDENTIALS: "the store refused the credentials",
        FetchFailure.NOT_FOUND: "the repository, revision, bucket or folder does not exist",
        FetchFailure.VERIFY: "a file did not match its published checksum",
        FetchFailure.UNREACHABLE: "the store could not be reached"}


def _failure_words(message: str) -> str:
    """What a fetch's exit code in a Job's failure message means."""
    found = _EXIT_CODE.search(message)
    why = _WHY.get(int(found.group(1))) if found else None
    return f"{why}; " if why else ""


def _pods_of(job_name: str, pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [p for p in pods if p["metadata"].get("labels", {}).get("job-name") == job_name]


def _fetch_outcome(job_name: str, pods: Sequence[Mapping[str, Any]]) -> str:
    """The one line the last failed fetch container of `job_name`'s pods left as its
    termination message (it names the source and the cause), or ""."""
    outcomes = []
    for pod in _pods_of(job_name, pods):
        st = pod.get("status", {})
        for cs in [*st.get("initContainerStatuses", []), *st.get("containerStatuses", [])]:
            done = cs.get("state", {}).get("terminated") or {}
            if cs.get("name") == "fetch" and done.get("exitCode") and done.get("message"):
                outcomes.append((str(done.get("finishedAt", "")), " ".join(
                    str(done["message"]).split())))
    return max(outcomes)[1] if outcomes else ""


def observe_job(ref: WeightsJobRef, job: Mapping[str, Any] | None,
                checkpoint_bytes: int = 0, pods: Sequence[Mapping[str, Any]] = ()
                ) -> WeightsJob:
    """`checkpoint_bytes`: the planner's size of what is fetched (0: unknown); `pods`: the
    deployment's observed pods (a failed fetch's pod says why)."""
    name, (doing, done) = ref.name, _VERB[ref.action]
    phases = " and ".join(ref.phases)
    if job is None:
        return WeightsJob(ref, PENDING, f"Job {name} is not created yet")
    st = job.get("status", {})
    conds = {cond.get("type"): cond for cond in st.get("conditions", [])
             if cond.get("status") == TRUE}
    if "Complete" in conds:
        return WeightsJob(ref, SUCCEEDED, f"Job {name} {done} the {phases} weights from "
                          f"{ref.source}")
    if "Failed" in conds:
        cond = conds["Failed"]
        words = _failure_words(cond.get("message", "")) if ref.action == c.FETCHER else ""
        said = _fetch_outcome(name, pods)
        return WeightsJob(ref, FAILED, f"Job {name} failed: {words}{cond.get('reason', '')}: "
                          f"{cond.get('message', '')}{f'; the fetch said: {said}' if said else ''}"
                          f" (logs: kubectl logs job/{name}; fix the cause, then change the "
                          "spec or delete the Job to run it again)")
    size = f" (about {checkpoint_bytes / GiB:.0f} GiB)" if checkpoint_bytes else ""
    # A pod the scheduler cannot place (its claim missing, no node fits) makes no progress:
    # say why, in the scheduler's words.
    unplaced = "".join(f"; {r.message}" for r in pod_refusals(ref.action, _pods_of(name, pods))
                       if r.reason == UNSCHEDULABLE)
    return WeightsJob(ref, RUNNING,
                      f"Job {name} {doing} {ref.source}{size}: {int(st.get('active', 0))} "
                      f"pod(s) active, {int(st.get('failed', 0))} failed attempt(s) of "
                      f"{BACKOFF_LIMIT + 1}{unplaced}; progress: kubectl logs job/{name}")


_REASONS = {c.FETCHER: ("Fetched", "Fetching", "FetchFailed"),
            c.CONVERTER: ("Converted", "Converting", "ConversionFailed")}


def weights_condition(jobs: Sequence[WeightsJob], generation: int) -> Condition:
    """True once every Job succeeded; else the first failed one's reason, or the first
    still running; the message lists every Job not done (or, when all are, every Job)."""
    failed = [j for j in jobs if j.state == FAILED]
    waiting = [j for j in jobs if not j.ready]
    if not waiting:
        action = c.CONVERTER if any(j.ref.action == c.CONVERTER for j in jobs) else c.FETCHER
        return make_condition(c.WEIGHTS_READY, TRUE, _REASONS[action][0],
                              "; ".join(j.message for j in jobs), generation)
    first = (failed or waiting)[0]
    reason = _REASONS[first.ref.action][2 if failed else 1]
    return make_condition(c.WEIGHTS_READY, FALSE, reason,
                          "; ".join(j.message for j in (failed or waiting)), generation)
