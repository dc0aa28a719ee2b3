"""Weight conversion: the Job builder, and decide() holding the phase back until it succeeds."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from tessera.operator import constants as c
from tessera.operator.reconcile import Key, decide, intend, key_of, plan_spec
from tessera.operator.render import render_configs
from tessera.operator.weights import (
    BACKOFF_LIMIT,
    checkpoint_sizes,
    converter_job_child,
    fetch_job_name,
    job_name,
    largest_tensor_bytes,
    weights_jobs,
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
    assert weights_jobs(md) == []
    decision = decide(md, {}, intend(md, render_configs), NOW)
    assert "Job" not in {o["kind"] for o in decision.apply}
    assert c.WEIGHTS_READY not in conds(decision)
    assert ("Deployment", "kimi-k2-decode") in applied(decision)


@pytest.mark.parametrize("job_status, reason, message", [
    (None, "Converting", "is not created yet"),
    ({"active": 1, "failed": 1}, "Converting", "1 pod(s) active, 1 failed attempt(s) of 4"),
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


# ---------------------------------------------------------------- fetching hf/s3/gs weights


def fetching(uri: str = "s3://weights/kimi-int4", claim: str | None = "model-cache",
             secret: str | None = "s3-reader") -> dict[str, Any]:
    md = yaml.safe_load(EXAMPLE.read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    weights = md["spec"]["decode"]["weights"]
    weights["uri"] = uri
    if claim:
        weights["cache"] = {"pvc": claim}
    if secret:
        weights["credentialsSecret"] = secret
    return md


def jobs_of(md: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in intend(md, render_configs).desired if o["kind"] == "Job"]


def engine_pod(decision_or_md: Any, phase: str = "decode") -> dict[str, Any]:
    desired = intend(decision_or_md, render_configs).desired
    (dep,) = [o for o in desired if o["kind"] == "Deployment"
              and o["metadata"]["name"] == f"kimi-k2-{phase}"]
    return dep["spec"]["template"]["spec"]


def test_a_cache_claim_gets_one_fetch_job_that_fails_fast_on_permanent_errors() -> None:
    md = fetching()
    (job,) = jobs_of(md)
    name = fetch_job_name(md, "s3://weights/kimi-int4", "model-cache")
    assert job["metadata"]["name"] == name and name.startswith("kimi-k2-fetch-")
    spec = job["spec"]
    assert spec["backoffLimit"] == BACKOFF_LIMIT
    assert spec["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onExitCodes": {
        "containerName": "fetch", "operator": "In", "values": [2, 20, 21]}}]}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200",
                                   "tessera.dev/pool": "decode"}
    assert pod["volumes"] == [{"name": "cache",
                               "persistentVolumeClaim": {"claimName": "model-cache"}}]
    (container,) = pod["containers"]
    assert container["command"] == ["tessera-runtime", "fetch", "s3://weights/kimi-int4",
                                    "/models"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-reader"}}]
    assert container["volumeMounts"] == [{"name": "cache", "mountPath": "/models",
                                          "subPath": "s3/weights/kimi-int4"}]
    assert spec["template"]["metadata"]["labels"][c.LABEL_PHASE] == c.FETCHER
    assert "priorityClassName" not in pod
    md["spec"]["nodePool"]["priorityClassName"] = "llm-serving"  # the deployment's pods' class
    (job,) = jobs_of(md)
    assert job["spec"]["template"]["spec"]["priorityClassName"] == "llm-serving"


def test_phase_waits_for_its_fetch_then_mounts_the_cache_read_only() -> None:
    md = fetching()
    waiting = run(md, {"active": 1})
    assert ("Deployment", "kimi-k2-decode") not in applied(waiting)
    assert ("Deployment", "kimi-k2-prefill") in applied(waiting)
    weights = conds(waiting)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("False", "Fetching")
    assert "fetching s3://weights/kimi-int4 (about 553 GiB): 1 pod(s) active" in \
        weights["message"]
    assert "decode waits for its weights" in conds(waiting)[c.READY]["message"]
    done = run(md, {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
    assert ("Deployment", "kimi-k2-decode") in applied(done)
    weights = conds(done)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("True", "Fetched")
    pod = engine_pod(md)
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache",
                                                        "readOnly": True}} in pod["volumes"]
    (engine,) = pod["containers"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True,
            "subPath": "s3/weights/kimi-int4"} in engine["volumeMounts"]
    assert "initContainers" not in pod
    assert "ephemeral-storage" not in engine["resources"]["requests"]  # nothing on local disk


def job_pod(job: str, status: dict[str, Any]) -> dict[str, Any]:
    """A pod of fetch Job `job`, as the Job controller labels it, in `status`."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{job}-x1", "namespace": "llm", "resourceVersion": "9",
                         "labels": {c.LABEL_DEPLOYMENT: "kimi-k2", c.LABEL_PHASE: c.FETCHER,
                                    "job-name": job}},
            "status": status}


def test_a_refused_credential_is_a_fetch_failure_that_says_so() -> None:
    decision = run(fetching(), {"failed": 1, "conditions": [
        {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
         "message": "Container fetch for pod llm/kimi-k2-fetch-x failed with exit code 20 "
                    "matching FailJob rule at index 0"}]})
    weights = conds(decision)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("False", "FetchFailed")
    assert "failed: the store refused the credentials; PodFailurePolicy" in weights["message"]
    assert "kubectl logs job/kimi-k2-fetch-" in weights["message"]
    assert ("Deployment", "kimi-k2-decode") not in applied(decision)


def test_fetch_failed_quotes_the_line_the_fetch_pod_left() -> None:
    md = fetching()
    (job,) = jobs_of(md)
    name = job["metadata"]["name"]
    said = ("s3://weights: the store refused the credentials (HTTP 403 SignatureDoesNotMatch); "
            "check the Secret named in weights.credentialsSecret")
    pod = job_pod(name, {"phase": "Failed", "containerStatuses": [{"name": "fetch", "state": {
        "terminated": {"exitCode": 20, "message": said + "\n",
                       "finishedAt": "2026-01-01T00:00:00Z"}}}]})
    failed = with_status(job, {"failed": 1, "conditions": [
        {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
         "message": "Container fetch for pod llm/x failed with exit code 20 matching FailJob "
                    "rule at index 0"}]})
    owned = {key_of(failed): failed, key_of(pod): pod}
    decision = decide(md, owned, intend(md, render_configs), NOW)
    message = conds(decision)[c.WEIGHTS_READY]["message"]
    assert f"the fetch said: {said} (logs: kubectl logs job/{name}" in message


def test_a_fetch_pod_the_scheduler_cannot_place_is_named_with_its_words() -> None:
    """The claim not created yet: the Job is active but its pod waits, and the condition says
    why in the scheduler's words, so an admin knows what to create."""
    md = fetching()
    (job,) = jobs_of(md)
    name = job["metadata"]["name"]
    said = '0/4 nodes are available: persistentvolumeclaim "model-cache" not found.'
    pod = job_pod(name, {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": said}]})
    active = with_status(job, {"active": 1})
    decision = decide(md, {key_of(active): active, key_of(pod): pod},
                      intend(md, render_configs), NOW)
    weights = conds(decision)[c.WEIGHTS_READY]
    assert (weights["status"], weights["reason"]) == ("False", "Fetching")
    assert f"1 pod(s) active, 0 failed attempt(s) of 4; pod {name}-x1 unschedulable: {said}; " \
        f"progress: kubectl logs job/{name}" in weights["message"]
    assert said in conds(decision)[c.READY]["message"]


def test_a_new_revision_makes_a_new_job_and_the_phase_rolls_only_after_it() -> None:
    old_md = fetching("hf://moonshotai/Kimi-K2-Instruct-w4a16@aaaa", secret=None)
    new_md = fetching("hf://moonshotai/Kimi-K2-Instruct-w4a16@bbbb", secret=None)
    (old_job,), (new_job,) = jobs_of(old_md), jobs_of(new_md)
    assert old_job["metadata"]["name"] != new_job["metadata"]["name"]
    old_pod, new_pod = engine_pod(old_md), engine_pod(new_md)
    mounts = [m for m in new_pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
    assert mounts[0]["subPath"] == "hf/moonshotai/Kimi-K2-Instruct-w4a16@bbbb"
    assert old_pod != new_pod  # the template changes: the phase rolls
    done = with_status(old_job, {"conditions": [{"type": "Complete", "status": "True"}]})
    decision = decide(new_md, {key_of(done): done}, intend(new_md, render_configs), NOW)
    assert [o["metadata"]["name"] for o in decision.prune] == [old_job["metadata"]["name"]]
    got = applied(decision)
    assert ("Job", new_job["metadata"]["name"]) in got
    assert ("Deployment", "kimi-k2-decode") not in got  # the running pods stay until it is done


def test_phases_fetching_the_same_uri_into_one_claim_share_one_job() -> None:
    md = fetching("hf://org/model")
    md["spec"]["prefill"]["weights"] = {**md["spec"]["decode"]["weights"], "dtype": "int4"}
    (ref,) = weights_jobs(md)
    assert ref.phases == ("prefill", "decode")
    decision = run(md, None)
    got = applied(decision)
    assert not {("Deployment", "kimi-k2-prefill"), ("Deployment", "kimi-k2-decode")} & got


def test_without_a_cache_every_pod_fetches_into_a_volume_of_the_checkpoint_size() -> None:
    md = fetching("hf://moonshotai/Kimi-K2-Instruct-w4a16", claim=None, secret="hf-token")
    assert jobs_of(md) == []
    plan, _ = plan_spec(md["spec"])
    assert plan is not None
    size = checkpoint_sizes(plan)["decode"]
    pod = engine_pod(md)
    assert {"name": "models", "emptyDir": {"sizeLimit": str(size + size // 20)}} in pod["volumes"]
    (fetch,) = pod["initContainers"]
    assert fetch["command"] == ["tessera-runtime", "fetch",
                                "hf://moonshotai/Kimi-K2-Instruct-w4a16", "/models"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert fetch["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]
    (engine,) = pod["containers"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    # the scheduler places it only on a node with that much local disk free (requested, and
    # not a limit: the emptyDir's sizeLimit already bounds it)
    assert engine["resources"]["requests"]["ephemeral-storage"] == str(size + size // 20)
    assert "ephemeral-storage" not in engine["resources"]["limits"]
    # the fetch asks for the engine's CPU and memory (the pod's request stays the engine's)
    assert fetch["resources"] == {"requests": {"cpu": "32", "memory": "192Gi"}}
    assert {k: engine["resources"]["requests"][k] for k in ("cpu", "memory")} == \
        fetch["resources"]["requests"]
    assert any(f.reason == "WeightsDownloadedPerReplica" and "every replica (2) downloads about"
               in f.message for f in plan.findings)


def test_conversion_from_the_hub_fetches_the_source_into_the_output_claim_first() -> None:
    md = converting(source="hf://moonshotai/Kimi-K2-Instruct@abc123")
    md["spec"]["decode"]["weights"]["credentialsSecret"] = "hf-token"
    (job,) = jobs_of(md)
    pod = job["spec"]["template"]["spec"]
    fetch, convert = pod["initContainers"]
    folder = ".sources/hf/moonshotai/Kimi-K2-Instruct@abc123"
    assert fetch["command"][:3] == ["tessera-runtime", "fetch",
                                    "hf://moonshotai/Kimi-K2-Instruct@abc123"]
    assert fetch["volumeMounts"] == [{"name": "output", "mountPath": "/models/source",
                                      "subPath": folder, "readOnly": False}]
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert {"name": "output", "mountPath": "/models/source", "subPath": folder,
            "readOnly": True} in convert["volumeMounts"]
    assert [v["name"] for v in pod["volumes"]] == ["output"]
