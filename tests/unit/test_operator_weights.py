"""Weight conversion: the Job builder, and decide() holding the phase back until it succeeds."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from tessera.operator import constants as c
from tessera.operator.reconcile import Key, decide, intend, key_of
from tessera.operator.render import render_configs
from tessera.operator.weights import (
    BACKOFF_LIMIT,
    conversion_phase,
    converter_job_child,
    job_name,
    largest_tensor_bytes,
)
from tessera.runtime.planner import resolve_architecture
from tessera.runtime.quantize.job import converter_job
from tessera.runtime.quantize.options import Options

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "01-kimi-k2" / "modeldeployment.yaml"
NOW = "2026-01-01T00:00:00Z"


def converting(source: str = "pvc://ckpt/kimi-fp8", out: str = "pvc://ckpt/kimi-int4"
               ) -> dict[str, Any]:
    md = yaml.safe_load(EXAMPLE.read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    md["spec"]["decode"]["weights"] = {"dtype": "int4", "groupSize": 32, "uri": out,
                                       "convertFrom": {"uri": source}}
    return md


def job_of(md: dict[str, Any]) -> dict[str, Any]:
    (job,) = [o for o in intend(md, render_configs).desired if o["kind"] == "Job"]
    return job


def with_status(obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"].update(uid="child-uid", resourceVersion="7")
    out["status"] = status
    return out


def run(md: dict[str, Any], job_status: dict[str, Any] | None) -> Any:
    """decide() with every other child absent and the Job as given (None: absent)."""
    owned: dict[Key, Any] = {}
    if job_status is not None:
        job = with_status(job_of(md), job_status)
        owned[key_of(job)] = job
    return decide(md, owned, intend(md, render_configs), NOW)


def conds(decision: Any) -> dict[str, dict[str, Any]]:
    return {x["type"]: x for x in decision.status_patch["conditions"]}


def applied(decision: Any) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in decision.apply}


def test_job_runs_convert_then_verify_with_the_converter_contract() -> None:
    md = converting(source="pvc://fp8/kimi", out="pvc://int4/kimi/w4a16")
    arch = resolve_architecture("kimi-k2", {})
    job = converter_job(Options(group_size=32), largest_tensor_bytes(arch))
    name = job_name(md, c.DECODE)
    resources = {"requests": {"memory": str(job.memory_bytes)},
                 "limits": {"memory": str(job.memory_bytes)}}
    out_mount = {"name": "output", "mountPath": job.output_mount, "subPath": "kimi/w4a16"}
    labels = {c.LABEL_DEPLOYMENT: "kimi-k2", c.LABEL_PHASE: c.CONVERTER,
              c.LABEL_MANAGED_BY: c.MANAGED_BY}
    assert converter_job_child(md, c.DECODE, largest_tensor_bytes(arch)) == {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": "llm", "labels": labels,
                     "ownerReferences": [{"apiVersion": c.API_VERSION_FULL, "kind": c.KIND,
                                          "name": "kimi-k2", "uid": "uid-1", "controller": True,
                                          "blockOwnerDeletion": True}]},
        "spec": {"backoffLimit": BACKOFF_LIMIT, "template": {
            "metadata": {"labels": labels},
            "spec": {
                "restartPolicy": "Never",
                "initContainers": [{
                    "name": "convert", "image": md["spec"]["engine"]["image"],
                    "command": job.argv, "resources": resources,
                    "volumeMounts": [{"name": "source", "mountPath": job.source_mount,
                                      "subPath": "kimi", "readOnly": True}, out_mount]}],
                "containers": [{
                    "name": "verify", "image": md["spec"]["engine"]["image"],
                    "command": ["tessera", "quantize", "verify", job.output_mount],
                    "resources": resources, "volumeMounts": [{**out_mount, "readOnly": True}]}],
                "volumes": [
                    {"name": "output", "persistentVolumeClaim": {"claimName": "int4"}},
                    {"name": "source", "persistentVolumeClaim": {"claimName": "fp8",
                                                                 "readOnly": True}}],
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200",
                                 "tessera.dev/pool": "decode"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                 "effect": "NoSchedule"}]}}}}
    assert job.argv[:3] == ["tessera", "quantize", "convert"] and "32" in job.argv


def test_job_runs_on_the_phase_nodes_like_its_deployment() -> None:
    """The conversion lands where the phase's pods will mount its output (and, on a cluster of
    tainted GPU nodes only, somewhere at all)."""
    md = converting()
    md["spec"]["nodePool"]["nodeSelector"] = {"pool": "h200"}
    md["spec"]["decode"]["nodeSelector"] = {"zone": "a"}
    desired = intend(md, render_configs).desired
    (deploy,) = [o for o in desired if o["kind"] == "Deployment"
                 and o["metadata"]["labels"].get(c.LABEL_PHASE) == c.DECODE]
    job_pod, deploy_pod = job_of(md)["spec"]["template"]["spec"], deploy["spec"]["template"]["spec"]
    assert job_pod["nodeSelector"] == deploy_pod["nodeSelector"] == {"pool": "h200", "zone": "a"}
    assert job_pod["tolerations"] == deploy_pod["tolerations"]
    assert "resources" not in job_pod and all(
        "nvidia.com/gpu" not in str(ct["resources"]) for ct in job_pod["initContainers"])


def test_source_and_output_on_one_claim_share_one_volume() -> None:
    spec = job_of(converting())["spec"]["template"]["spec"]
    assert spec["volumes"] == [{"name": "output",
                                "persistentVolumeClaim": {"claimName": "ckpt"}}]
    source, output = spec["initContainers"][0]["volumeMounts"]
    assert (source["name"], source["subPath"], source["readOnly"]) == ("output", "kimi-fp8", True)
    assert (output["subPath"], output.get("readOnly")) == ("kimi-int4", None)


def test_job_name_follows_what_it_converts() -> None:
    a, b = converting(), converting(source="pvc://ckpt/kimi-bf16")
    assert job_name(a, c.DECODE) == job_name(converting(), c.DECODE)
    assert job_name(a, c.DECODE) != job_name(b, c.DECODE)
    assert job_name(a, c.DECODE).startswith("kimi-k2-convert-")


def test_a_spec_without_conversion_has_no_job_and_no_weights_condition() -> None:
    md = yaml.safe_load(EXAMPLE.read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    assert conversion_phase(md["spec"]) is None
    decision = decide(md, {}, intend(md, render_configs), NOW)
    assert "Job" not in {o["kind"] for o in decision.apply}
    assert c.WEIGHTS_READY not in conds(decision)
    assert ("Deployment", "kimi-k2-decode") in applied(decision)


@pytest.mark.parametrize("job_status, reason, message", [
    (None, "Converting", "is not created yet"),
    ({"active": 1, "failed": 1}, "Converting", "1 pod(s) running, 1 failed attempt(s) of 4"),
])
def test_decode_waits_while_the_job_is_pending_or_running(
        job_status: dict[str, Any] | None, reason: str, message: str) -> None:
    md = converting()
    decision = run(md, job_status)
    got = applied(decision)
    assert ("Deployment", "kimi-k2-decode") not in got
    assert ("Deployment", "kimi-k2-prefill") in got and ("Deployment", "kimi-k2-router") in got
    assert (("Job", job_name(md, c.DECODE)) in got) == (job_status is None)
    weights = conds(decision)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("False", reason)
    assert message in weights["message"]
    ready = conds(decision)[c.READY]
    assert ready["status"] == "False" and "decode waits for its weights" in ready["message"]


def test_decode_rolls_out_once_the_job_succeeded() -> None:
    md = converting()
    decision = run(md, {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
    got = applied(decision)
    assert ("Deployment", "kimi-k2-decode") in got
    assert ("Job", job_name(md, c.DECODE)) not in got  # there and unchanged: no write
    weights = conds(decision)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("True", "Converted")
    assert "waits for its weights" not in conds(decision)[c.READY]["message"]


def test_a_failed_job_is_reported_and_not_recreated() -> None:
    md = converting()
    decision = run(md, {"failed": 4, "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
         "message": "Job has reached the specified backoff limit"}]})
    got = applied(decision)
    assert ("Deployment", "kimi-k2-decode") not in got
    assert ("Job", job_name(md, c.DECODE)) not in got
    weights = conds(decision)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("False", "ConversionFailed")
    assert "BackoffLimitExceeded" in weights["message"]
    assert c.WEIGHTS_READY in {x["type"] for x in decision.events}


def test_a_changed_source_prunes_the_old_job() -> None:
    old = with_status(job_of(converting()), {"succeeded": 1})
    md = converting(source="pvc://ckpt/kimi-bf16")
    decision = decide(md, {key_of(old): old}, intend(md, render_configs), NOW)
    assert [o["metadata"]["name"] for o in decision.prune] == [old["metadata"]["name"]]
    assert ("Job", job_name(md, c.DECODE)) in applied(decision)
