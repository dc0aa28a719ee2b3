"""Weights fetched from S3 into a cache claim, on the real control plane.

What is simulated: the fetch Job's pod. It cannot be scheduled until its claim exists; once it
does, kwok runs it and, being a Job's, marks it Succeeded, and the real Job controller marks
the Job Complete. The fetch the pod stands for is run here first: the Job's own command, with
the Secret's keys as its environment, against a real S3 server on loopback (tests/stores.py).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stores import S3Server
from tessera.operator import constants as c
from tessera.runtime.fetch.source import STATE_DIR
from test_operator_e2e import (
    RESYNC_S,
    apply,
    children,
    claim,
    conditions,
    get_md,
    poll,
    tiny,
    wait_ready,
)
from test_operator_e2e import operator as operator  # noqa: F401  (the module's operator fixture)

SECRET = "s3-reader"


def jobs(kubectl: Any, namespace: str, action: str = c.FETCHER) -> list[dict[str, Any]]:
    return json.loads(kubectl("get", "jobs", "-n", namespace, "-l",
                              f"{c.LABEL_PHASE}={action}", "-o", "json").stdout)["items"]


def s3_secret(kubectl: Any, namespace: str, server: S3Server) -> None:
    """The Secret `credentialsSecret` names: the loopback server's address and keys."""
    kubectl("create", "secret", "generic", SECRET, "-n", namespace,
            *(f"--from-literal={k}={v}" for k, v in server.env().items()))


def secret_env(kubectl: Any, namespace: str, name: str) -> dict[str, str]:
    """What envFrom gives the pod: the Secret's keys and values."""
    data = json.loads(kubectl("get", "secret", name, "-n", namespace, "-o", "json").stdout)
    return {k: base64.b64decode(v).decode() for k, v in data["data"].items()}


def run_like_the_pod(job: dict[str, Any], env: dict[str, str], claim_dir: Path) -> Path:
    """The Job's container command, its mount pointed at the claim's folder on this host."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (mount,) = container["volumeMounts"]
    folder = claim_dir / mount["subPath"]
    argv = [folder.as_posix() if a == mount["mountPath"] else a for a in container["command"]]
    assert argv[:2] == ["tessera-runtime", "fetch"]
    result = subprocess.run([sys.executable, "-m", "tessera.runtime.main", *argv[1:],
                             "--termination-log", str(claim_dir / "termination")],
                            env={**os.environ, "PYTHONSAFEPATH": "1", **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return folder


def test_s3_weights_fetched_once_into_the_cache_claim_then_mounted_read_only(
        operator: Any, kubectl: Any, namespace: str, tmp_path: Path) -> None:
    from tessera.runtime.quantize.synthetic import TINY_CONFIGS, write_checkpoint

    bucket = tmp_path / "bucket"
    source = write_checkpoint(bucket / "tiny", TINY_CONFIGS["deepseek-v3"], dtype="fp8")
    write_checkpoint(bucket / "tiny-v2", TINY_CONFIGS["deepseek-v3"], dtype="fp8", seed=1)
    server = S3Server({"weights": bucket}, tmp_path)
    try:
        s3_secret(kubectl, namespace, server)
        md = tiny("fetch")
        md["spec"]["decode"]["weights"] = {"dtype": "fp8", "uri": "s3://weights/tiny",
                                           "cache": {"pvc": "model-cache"},
                                           "credentialsSecret": SECRET}
        apply(kubectl, namespace, md)

        (job,) = poll("the fetch Job", lambda: jobs(kubectl, namespace))
        poll("router and prefill rolled out", lambda: {"fetch-router", "fetch-prefill"} <= {
            n for k, n in children(kubectl, namespace, "fetch") if k == "Deployment"})
        time.sleep(2 * RESYNC_S)  # resyncs change nothing while the Job waits
        assert ("Deployment", "fetch-decode") not in children(kubectl, namespace, "fetch")
        weights = conditions(get_md(kubectl, namespace, "fetch"))[c.WEIGHTS_READY]
        assert (weights["status"], weights["reason"]) == ("False", "Fetching")
        assert "fetching s3://weights/tiny" in weights["message"]
        poll("the scheduler's word on the fetch pod, on the deployment", lambda: (
            'persistentvolumeclaim "model-cache" not found' in conditions(get_md(
                kubectl, namespace, "fetch"))[c.WEIGHTS_READY]["message"]))
        pod_spec = job["spec"]["template"]["spec"]
        assert pod_spec["containers"][0]["envFrom"] == [{"secretRef": {"name": SECRET}}]
        assert server.env()["AWS_SECRET_ACCESS_KEY"] not in json.dumps(
            [job, get_md(kubectl, namespace, "fetch")])

        # The pod's work, then the claim it waited for.
        claim_dir = tmp_path / "claim"
        fetched = run_like_the_pod(job, secret_env(kubectl, namespace, SECRET), claim_dir)
        assert fetched == claim_dir / "s3" / "weights" / "tiny"
        for f in source.rglob("*"):
            if f.is_file():
                assert (fetched / f.relative_to(source)).read_bytes() == f.read_bytes()
        assert json.loads((fetched / STATE_DIR / "manifest.json").read_text())["complete"]
        for obj in claim("model-cache", namespace, str(claim_dir)):
            apply(kubectl, namespace, obj)
        wait_ready(kubectl, namespace, "fetch", timeout=90)

        md_now = get_md(kubectl, namespace, "fetch")
        weights = conditions(md_now)[c.WEIGHTS_READY]
        assert (weights["status"], weights["reason"]) == ("True", "Fetched")
        assert md_now["status"]["decode"]["readyReplicas"] == 2
        decode = json.loads(kubectl("get", "deployment", "fetch-decode", "-n", namespace,
                                    "-o", "json").stdout)["spec"]["template"]["spec"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache",
                                                            "readOnly": True}} in decode["volumes"]
        (engine,) = decode["containers"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True,
                "subPath": "s3/weights/tiny"} in engine["volumeMounts"]
        assert "initContainers" not in decode

        # A new source: a new Job; decode keeps its pods until that Job has succeeded, then
        # rolls onto the new folder. The claim is there now, so kwok completes the Job.
        md["spec"]["decode"]["weights"]["uri"] = "s3://weights/tiny-v2"
        apply(kubectl, namespace, md)
        (new_job,) = poll("the new fetch Job", lambda: [
            j for j in jobs(kubectl, namespace)
            if j["metadata"]["name"] != job["metadata"]["name"]])
        run_like_the_pod(new_job, secret_env(kubectl, namespace, SECRET), claim_dir)

        def rolled() -> bool:
            spec = json.loads(kubectl("get", "deployment", "fetch-decode", "-n", namespace,
                                      "-o", "json").stdout)["spec"]["template"]["spec"]
            return any(m.get("subPath") == "s3/weights/tiny-v2"
                       for m in spec["containers"][0]["volumeMounts"])

        poll("decode rolled onto the new folder", rolled, timeout=60)
        wait_ready(kubectl, namespace, "fetch", timeout=90)
        assert [j["metadata"]["name"] for j in jobs(kubectl, namespace)] == [
            new_job["metadata"]["name"]]  # the old Job was pruned
    finally:
        server.stop()


def test_int4_conversion_starts_from_s3(operator: Any, kubectl: Any, namespace: str,
                                        tmp_path: Path) -> None:
    """convertFrom s3://: the conversion Job's init containers fetch, then convert; its
    container verifies. Each runs here with its own command and mounts (the claim's folders
    on this host), then kwok completes the Job once its claim exists."""
    from tessera.runtime.quantize.synthetic import TINY_CONFIGS, write_checkpoint

    write_checkpoint(tmp_path / "bucket" / "fp8", TINY_CONFIGS["deepseek-v3"], dtype="fp8")
    server = S3Server({"weights": tmp_path / "bucket"}, tmp_path)
    try:
        s3_secret(kubectl, namespace, server)
        md = tiny("conv3")
        md["spec"]["decode"]["weights"] = {"dtype": "int4", "uri": "pvc://ckpt/int4",
                                           "convertFrom": {"uri": "s3://weights/fp8"},
                                           "credentialsSecret": SECRET}
        apply(kubectl, namespace, md)
        (job,) = poll("the conversion Job", lambda: jobs(kubectl, namespace, c.CONVERTER))
        pod = job["spec"]["template"]["spec"]
        assert [x["name"] for x in pod["initContainers"]] == ["fetch", "convert"]
        claim_dir = tmp_path / "claim"
        env = {**os.environ, "PYTHONSAFEPATH": "1", **secret_env(kubectl, namespace, SECRET)}
        for container in [*pod["initContainers"], *pod["containers"]]:
            folders = {m["mountPath"]: (claim_dir / m["subPath"]).as_posix()
                       for m in container["volumeMounts"]}
            argv = [folders.get(a, a) for a in container["command"]]
            module = ("tessera.runtime.main" if argv[0] == "tessera-runtime" else "tessera")
            subprocess.run([sys.executable, "-m", module, *argv[1:]], env=env, check=True,
                           capture_output=True, timeout=180)
        assert json.loads((claim_dir / "int4" / "config.json").read_text())[
            "quantization_config"]
        assert (claim_dir / ".sources" / "s3" / "weights" / "fp8" / "config.json").exists()
        for obj in claim("ckpt", namespace, str(claim_dir)):
            apply(kubectl, namespace, obj)
        wait_ready(kubectl, namespace, "conv3", timeout=90)
        weights = conditions(get_md(kubectl, namespace, "conv3"))[c.WEIGHTS_READY]
        assert (weights["status"], weights["reason"]) == ("True", "Converted")
    finally:
        server.stop()
