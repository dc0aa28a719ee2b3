"""The API server itself refuses malformed ModelDeployments (schema + CEL), naming the field.

Each case sends one broken manifest through `kubectl apply --dry-run=server`: the whole
admission chain runs (defaulting, structural schema, CEL), nothing is stored.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def valid() -> dict[str, Any]:
    phase = {"tensorParallel": 8, "kvCache": {"dtype": "fp8_e4m3"}}
    return {
        "apiVersion": "tessera.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": "bad"},
        "spec": {
            "model": {"name": "m", "architecture": {"preset": "kimi-k2"}, "contextLength": 8192},
            "engine": {"image": "tessera/runtime:test"},
            "prefill": {**copy.deepcopy(phase), "weights": {"dtype": "fp8", "uri": "hf://m/fp8"}},
            "decode": {**copy.deepcopy(phase), "weights": {"dtype": "int4", "uri": "hf://m/i4"}},
        },
    }


Edit = Callable[[dict[str, Any]], Any]

# (what is wrong, the edit, text the refusal must contain: the field and what is expected)
CASES: list[tuple[str, Edit, list[str]]] = [
    ("no served model name", lambda m: m["spec"]["model"].pop("name"),
     ["spec.model.name", "Required value"]),
    ("unknown weight dtype", lambda m: m["spec"]["decode"]["weights"].update(dtype="int8"),
     ["spec.decode.weights.dtype", "Unsupported value", '"int4"']),
    ("unknown KV dtype", lambda m: m["spec"]["prefill"]["kvCache"].update(dtype="fp16"),
     ["spec.prefill.kvCache.dtype", "Unsupported value"]),
    ("negative replicas", lambda m: m["spec"]["decode"].update(replicas=-1),
     ["spec.decode.replicas", "greater than or equal to 0"]),
    ("tensor parallel 3", lambda m: m["spec"]["decode"].update(tensorParallel=3),
     ["spec.decode.tensorParallel", "Unsupported value"]),
    ("mem fraction 0.99", lambda m: m["spec"]["prefill"].update(memFractionStatic=0.99),
     ["spec.prefill.memFractionStatic", "less than or equal to 0.95"]),
    ("cpu not a quantity", lambda m: m["spec"]["decode"].update(resources={"cpu": "lots"}),
     ["spec.decode.resources.cpu", "positive Kubernetes quantity"]),
    ("no memory", lambda m: m["spec"]["prefill"].update(resources={"memory": "0Gi"}),
     ["spec.prefill.resources.memory", "positive Kubernetes quantity"]),
    ("no time to drain", lambda m: m["spec"]["decode"].update(terminationGracePeriodSeconds=5),
     ["spec.decode.terminationGracePeriodSeconds", "greater than or equal to 30"]),
    ("priority class in capitals", lambda m: m["spec"].setdefault("nodePool", {}).update(
        priorityClassName="LLM-Serving"), ["spec.nodePool.priorityClassName", "should match"]),
    ("unknown preset", lambda m: m["spec"]["model"]["architecture"].update(preset="llama"),
     ["spec.model.architecture.preset", "Unsupported value"]),
    ("context length 0", lambda m: m["spec"]["model"].update(contextLength=0),
     ["spec.model.contextLength", "greater than or equal to 1"]),
    ("no engine image", lambda m: m["spec"]["engine"].pop("image"),
     ["spec.engine.image", "Required value"]),
    ("misspelt field", lambda m: m["spec"]["decode"].update(tensorParallelism=8),
     ['unknown field "spec.decode.tensorParallelism"']),
    ("both modes", lambda m: m["spec"].update(single=copy.deepcopy(m["spec"]["decode"])),
     ["spec: Invalid value", "set either spec.single"]),
    ("prefill without decode", lambda m: m["spec"].pop("decode"),
     ["spec: Invalid value", "needs both spec.prefill and spec.decode"]),
    ("no phase at all", lambda m: (m["spec"].pop("decode"), m["spec"].pop("prefill")),
     ["spec: Invalid value", "set either spec.single"]),
    ("expert parallel not dividing", lambda m: m["spec"]["decode"].update(expertParallel=3),
     ["spec.decode.expertParallel", "expertParallel must divide tensorParallel"]),
    ("attention DP not dividing",
     lambda m: m["spec"]["decode"].update(attentionDataParallel=3),
     ["spec.decode.attentionDataParallel", "must divide tensorParallel"]),
    ("group size on fp8", lambda m: m["spec"]["prefill"]["weights"].update(groupSize=128),
     ["spec.prefill.weights.groupSize", "int4 weights only"]),
    ("unknown uri scheme", lambda m: m["spec"]["decode"]["weights"].update(uri="ftp://m"),
     ["spec.decode.weights.uri", "hf://"]),
    ("format cannot hold dtype",
     lambda m: m["spec"]["prefill"]["weights"].update(format="gptq"),
     ["spec.prefill.weights.format", "cannot hold"]),
    ("tiny GPU", lambda m: m["spec"].update(nodePool={"gpu": {"memoryGiB": 8}}),
     ["spec.nodePool.gpu.memoryGiB", "greater than or equal to 16"]),
    ("engine version not x.y.z", lambda m: m["spec"]["engine"].update(version="latest"),
     ["spec.engine.version", "should match"]),
    ("toleration Exists with value", lambda m: m["spec"].update(nodePool={"tolerations": [
        {"key": "k", "operator": "Exists", "value": "v"}]}),
     ["spec.nodePool.tolerations[0]", "must not set a value"]),
    ("expert parallel not dividing a two-node replica",
     lambda m: m["spec"]["prefill"].update(tensorParallel=16, expertParallel=12),
     ["spec.prefill.expertParallel", "expertParallel must divide tensorParallel"]),
    ("attention DP wider than a two-node replica",
     lambda m: m["spec"]["prefill"].update(tensorParallel=16, attentionDataParallel=32),
     ["spec.prefill.attentionDataParallel", "must divide tensorParallel"]),
    ("tensor parallel 64 (eight nodes)", lambda m: m["spec"]["prefill"].update(tensorParallel=64),
     ["spec.prefill.tensorParallel", "Unsupported value"]),
    ("page size 48", lambda m: m["spec"]["decode"]["kvCache"].update(pageSize=48),
     ["spec.decode.kvCache.pageSize", "Unsupported value"]),
    ("architecture empty", lambda m: m["spec"]["model"].update(architecture={}),
     ["spec.model.architecture", "needs a preset or an inline config"]),
    ("name too long for child names", lambda m: m["metadata"].update(name="x" * 41),
     ["metadata.name", "40"]),
    # Valid names for a custom resource (DNS subdomains), but not for its Services.
    ("name with a dot", lambda m: m["metadata"].update(name="kimi.k2"),
     ["metadata.name", "must be a DNS-1035 label", "e.g. kimi-k2"]),
    ("name starting with a digit", lambda m: m["metadata"].update(name="2kimi"),
     ["metadata.name", "must be a DNS-1035 label", "starting with a letter"]),
    ("unknown router policy", lambda m: m["spec"].update(router={"policy": "fastest"}),
     ["spec.router.policy", "Unsupported value"]),
    ("unknown kernel provider", lambda m: m["spec"]["decode"].update(kernels={"w4a16": "marlin"}),
     ["spec.decode.kernels.w4a16", "Unsupported value"]),
    ("unknown decode attention",
     lambda m: m["spec"]["decode"].update(kernels={"decodeAttention": "fa3"}),
     ["spec.decode.kernels.decodeAttention", "Unsupported value", '"flashmla"']),
    ("flashmla on 32-token pages", lambda m: m["spec"]["decode"].update(
        kernels={"decodeAttention": "flashmla"}, kvCache={"pageSize": 32}),
     ["spec.decode.kvCache.pageSize", "flashmla reads 64-token pages"]),
    ("conversion into a non-pvc output", lambda m: m["spec"]["decode"]["weights"].update(
        convertFrom={"uri": "pvc://ckpt/fp8"}),
     ["spec.decode.weights.convertFrom", "needs dtype int4 and a pvc:// uri"]),
    ("conversion from an unknown scheme", lambda m: m["spec"]["decode"]["weights"].update(
        uri="pvc://ckpt/i4", convertFrom={"uri": "http://m/fp8"}),
     ["spec.decode.weights.convertFrom.uri", "must be pvc://claim/dir, hf://org/repo"]),
    ("cache for weights read in place", lambda m: m["spec"]["decode"]["weights"].update(
        uri="pvc://ckpt/i4", cache={"pvc": "model-cache"}),
     ["spec.decode.weights.cache", "applies to hf://, s3:// and gs:// weights"]),
    ("credentials for weights not fetched", lambda m: m["spec"]["decode"]["weights"].update(
        uri="file:///opt/i4", credentialsSecret="hf-token"),
     ["spec.decode.weights.credentialsSecret", "these weights are not fetched"]),
    ("cache without a claim", lambda m: m["spec"]["decode"]["weights"].update(cache={}),
     ["spec.decode.weights.cache.pvc", "Required value"]),
    ("hf uri without an org", lambda m: m["spec"]["decode"]["weights"].update(
        uri="hf://just-a-name"), ["spec.decode.weights.uri", "hf://org/repo@revision"]),
    ("s3 bucket in capitals", lambda m: m["spec"]["decode"]["weights"].update(
        uri="s3://Weights/kimi"), ["spec.decode.weights.uri", "s3://bucket/dir"]),
    ("conversion from an hf source without an org", lambda m: m["spec"]["decode"][
        "weights"].update(uri="pvc://ckpt/i4", convertFrom={"uri": "hf://just-a-name"}),
     ["spec.decode.weights.convertFrom.uri", "hf://org/repo@revision"]),
    ("conversion from a gs bucket in capitals", lambda m: m["spec"]["decode"][
        "weights"].update(uri="pvc://ckpt/i4", convertFrom={"uri": "gs://Weights/fp8"}),
     ["spec.decode.weights.convertFrom.uri", "gs://bucket/dir"]),
    ("conversion on prefill", lambda m: m["spec"]["prefill"]["weights"].update(
        dtype="int4", uri="pvc://ckpt/i4", convertFrom={"uri": "pvc://ckpt/fp8"}),
     ["spec: Invalid value", "convertFrom applies to the decode or single phase"]),
]


@pytest.mark.parametrize("source", ["pvc://ckpt/fp8", "hf://moonshotai/Kimi-K2-Instruct@a1b2",
                                    "s3://weights/kimi/fp8"])
def test_conversion_into_a_pvc_is_accepted(crd: None, kubectl: Any, namespace: str,
                                           source: str) -> None:
    m = valid()
    m["spec"]["decode"]["weights"].update(uri="pvc://ckpt/i4", convertFrom={"uri": source})
    if not source.startswith("pvc://"):  # the fetch of a remote source may carry credentials
        m["spec"]["decode"]["weights"]["credentialsSecret"] = "hf-token"
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=m)


def test_host_resources_as_numbers_or_quantities_are_accepted(crd: None, kubectl: Any,
                                                              namespace: str) -> None:
    m = valid()
    m["spec"]["prefill"]["resources"] = {"cpu": 48, "memory": "512Gi"}
    m["spec"]["decode"]["resources"] = {"cpu": "31500m", "memory": 200 * 2**30}
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=m)


def test_fetched_weights_with_a_cache_and_credentials_are_accepted(crd: None, kubectl: Any,
                                                                   namespace: str) -> None:
    m = valid()
    m["spec"]["prefill"]["weights"].update(uri="s3://weights.example/kimi/fp8",
                                           cache={"pvc": "model-cache"},
                                           credentialsSecret="s3-reader")
    m["spec"]["decode"]["weights"].update(uri="hf://moonshotai/Kimi-K2-Instruct-w4a16@main",
                                          cache={"pvc": "model-cache"})
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=m)


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "crds" / "modeldeployment.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/modeldeployments.tessera.dev")


def test_the_valid_base_is_accepted(crd: None, kubectl: Any, namespace: str) -> None:
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=valid())


def test_flashmla_on_the_default_page_size_is_accepted(crd: None, kubectl: Any,
                                                      namespace: str) -> None:
    m = valid()
    m["spec"]["decode"]["kernels"] = {"decodeAttention": "flashmla"}
    out = kubectl("apply", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-", input=m)
    stored = json.loads(out.stdout)["spec"]
    assert stored["decode"]["kvCache"]["pageSize"] == 64  # the default, which FlashMLA reads
    # Unset stays unset: the operator chooses, not a schema default.
    assert "decodeAttention" not in stored["prefill"]["kernels"]


# Replicas wider than one node: (tensorParallel, expertParallel, attentionDataParallel, perNode)
MULTI_NODE = [(16, 1, 1, 8), (16, 16, 1, 8), (32, 32, 8, 8), (16, 8, 4, 4), (8, 8, 1, 4)]


@pytest.mark.parametrize("tp, ep, dp, per_node", MULTI_NODE,
                         ids=[f"tp{t}-ep{e}-dp{d}-per-node{n}" for t, e, d, n in MULTI_NODE])
def test_replicas_spanning_whole_nodes_are_accepted(crd: None, kubectl: Any, namespace: str,
                                                    tp: int, ep: int, dp: int,
                                                    per_node: int) -> None:
    m = valid()
    m["spec"]["nodePool"] = {"gpu": {"perNode": per_node}}
    m["spec"]["prefill"].update(tensorParallel=tp, expertParallel=ep, attentionDataParallel=dp)
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=m)


@pytest.mark.parametrize("edit, expected", [(e, x) for _, e, x in CASES],
                         ids=[what.replace(" ", "-") for what, _, _ in CASES])
def test_malformed_manifest_is_refused_naming_the_field(crd: None, kubectl: Any,
                                                        namespace: str, edit: Edit,
                                                        expected: list[str]) -> None:
    manifest = valid()
    edit(manifest)
    result = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=manifest,
                     check=False)
    assert result.returncode != 0, f"accepted: {manifest}"
    for text in expected:
        assert text in result.stderr, result.stderr


def test_switching_mode_of_a_stored_deployment_is_refused(crd: None, kubectl: Any,
                                                          namespace: str) -> None:
    kubectl("create", "-n", namespace, "-f", "-", input=valid())
    single = valid()
    single["spec"]["single"] = single["spec"].pop("decode")
    del single["spec"]["prefill"]
    result = kubectl("replace", "-n", namespace, "-f", "-", input=single, check=False)
    assert result.returncode != 0
    assert "switching between single-pool and disaggregated mode" in result.stderr


def test_defaults_come_from_the_schema(crd: None, kubectl: Any, namespace: str) -> None:
    created = json.loads(kubectl("create", "-n", namespace, "-o", "json", "-f", "-",
                                 input=valid()).stdout)
    spec = created["spec"]
    assert spec["engine"]["version"] == "0.5.23"
    assert spec["nodePool"]["gpu"] == {"product": "H200", "memoryGiB": 141,
                                       "computeCapability": "9.0", "perNode": 8}
    assert spec["decode"]["replicas"] == 1 and spec["decode"]["kvCache"]["pageSize"] == 64
    assert spec["router"] == {"replicas": 1, "policy": "cache_aware", "port": 8000}
    assert spec["integrity"] == {"enabled": False}
