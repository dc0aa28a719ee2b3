"""Weight conversion: the Job that turns an FP8/BF16 checkpoint into INT4, and what it says
about the weights (pure; no API calls).

A phase whose `weights.convertFrom` names a source gets one Job: an init container runs
`tessera quantize convert` from the source to `weights.uri`, then the container runs
`tessera quantize verify` on the result. The phase's Deployment is applied only once that Job
has succeeded. The Job's name carries a hash of what it converts, so a changed source or
output makes a new Job instead of an edit the API server refuses (a Job's template is
immutable). A failed Job stays failed: nothing recreates it until the spec changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.operator import constants as c
from tessera.operator.children import (
    child_name,
    owned_metadata,
    phase_scheduling,
    phases_of,
    stable_hash,
)
from tessera.operator.conditions import FALSE, TRUE, Condition, make_condition
from tessera.runtime.planner import Architecture
from tessera.runtime.quantize.job import converter_job
from tessera.runtime.quantize.options import Options

Obj = dict[str, Any]

# Pod retries of one Job; each resumes from the manifest on the output volume.
BACKOFF_LIMIT = 3
PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"


def conversion_phase(spec: Mapping[str, Any]) -> str | None:
    """The phase whose weights are converted (the CRD allows decode or single), if any."""
    for phase in phases_of(spec):
        if "convertFrom" in spec[phase]["weights"]:
            return phase
    return None


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
    src_claim, src_dir = _pvc(weights["convertFrom"]["uri"])
    out_claim, out_dir = _pvc(weights["uri"])
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
    name = job_name(md, phase)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": owned_metadata(md, name, c.CONVERTER),
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "template": {
                "metadata": {"labels": {c.LABEL_DEPLOYMENT: md["metadata"]["name"],
                                        c.LABEL_PHASE: c.CONVERTER,
                                        c.LABEL_MANAGED_BY: c.MANAGED_BY}},
                "spec": {
                    "restartPolicy": "Never",
                    "initContainers": [{"name": "convert", "image": image,
                                        "command": list(job.argv), "resources": resources,
                                        "volumeMounts": [source_mount, output_mount]}],
                    "containers": [{"name": "verify", "image": image,
                                    "command": ["tessera", "quantize", "verify",
                                                job.output_mount],
                                    "resources": resources,
                                    "volumeMounts": [{**output_mount, "readOnly": True}]}],
                    "volumes": volumes,
                    **phase_scheduling(md["spec"], phase),
                },
            },
        },
    }


@dataclass(frozen=True)
class Conversion:
    """One observed conversion Job, reduced to what decide and status need."""

    phase: str
    job: str
    state: str  # PENDING | RUNNING | SUCCEEDED | FAILED
    message: str

    @property
    def ready(self) -> bool:
        return self.state == SUCCEEDED


def observe_conversion(phase: str, name: str, job: Mapping[str, Any] | None) -> Conversion:
    if job is None:
        return Conversion(phase, name, PENDING, f"Job {name} is not created yet")
    st = job.get("status", {})
    conds = {cond.get("type"): cond for cond in st.get("conditions", [])
             if cond.get("status") == TRUE}
    if "Complete" in conds:
        return Conversion(phase, name, SUCCEEDED, f"Job {name} converted and verified the "
                          f"{phase} weights")
    if "Failed" in conds:
        cond = conds["Failed"]
        return Conversion(phase, name, FAILED, f"Job {name} failed: {cond.get('reason', '')}: "
                          f"{cond.get('message', '')} (fix the cause, then change the spec or "
                          "delete the Job to run it again)")
    return Conversion(phase, name, RUNNING,
                      f"Job {name} converting: {int(st.get('active', 0))} pod(s) running, "
                      f"{int(st.get('failed', 0))} failed attempt(s) of {BACKOFF_LIMIT + 1}")


def weights_condition(conversion: Conversion, generation: int) -> Condition:
    if conversion.ready:
        return make_condition(c.WEIGHTS_READY, TRUE, "Converted", conversion.message, generation)
    reason = "ConversionFailed" if conversion.state == FAILED else "Converting"
    return make_condition(c.WEIGHTS_READY, FALSE, reason, conversion.message, generation)
