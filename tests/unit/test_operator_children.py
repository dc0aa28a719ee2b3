"""Desired children of a ModelDeployment: shape, ownership, scheduling, per-phase hashes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from tessera.operator import constants as c
from tessera.operator.children import desired_children, stable_hash
from tessera.operator.reconcile import plan_spec
from tessera.operator.render import checkpoint_path, render_configs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, Any]:
    md = yaml.safe_load((EXAMPLES / name / "modeldeployment.yaml").read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    return md


def children_of(md: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    plan, error = plan_spec(md["spec"])
    assert error is None and plan is not None and plan.ok, plan and plan.findings
    return {(o["kind"], o["metadata"]["name"]): o
            for o in desired_children(md, render_configs(md, plan))}


def single_pool() -> dict[str, Any]:
    md = example("02-glm-5")
    spec = md["spec"]
    spec["single"] = spec.pop("decode")
    del spec["prefill"]
    spec["single"]["tensorParallel"] = 8
    return md


def test_disaggregated_children_are_the_expected_set() -> None:
    kinds = sorted(children_of(example("01-kimi-k2")))
    per_phase = [("ConfigMap", "{}-config"), ("Deployment", "{}"), ("PodDisruptionBudget", "{}"),
                 ("Service", "{}")]
    expected = [(kind, "kimi-k2-" + pattern.format(p)) for p in ("prefill", "decode", "router")
                for kind, pattern in per_phase]
    expected += [(k, f"kimi-k2-{who}") for k in ("Role", "RoleBinding", "ServiceAccount")
                 for who in ("router", "engine")]
    assert kinds == sorted(expected)


def test_single_pool_has_one_engine_phase() -> None:
    names = {name for _, name in children_of(single_pool())}
    assert "glm-5-single" in names
    assert not {"glm-5-prefill", "glm-5-decode"} & names


@pytest.mark.parametrize("md", [example("01-kimi-k2"), single_pool()], ids=["pd", "single"])
def test_every_child_is_owned_labelled_and_hashed(md: dict[str, Any]) -> None:
    for child in children_of(md).values():
        meta = child["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [{
            "apiVersion": "tessera.dev/v1alpha1", "kind": "ModelDeployment",
            "name": md["metadata"]["name"], "uid": "uid-1", "controller": True,
            "blockOwnerDeletion": True}]
        assert meta["labels"][c.LABEL_DEPLOYMENT] == md["metadata"]["name"]
        assert meta["labels"][c.LABEL_MANAGED_BY] == "tessera"
        unhashed = copy.deepcopy(child)
        del unhashed["metadata"]["annotations"]
        assert meta["annotations"][c.ANNOTATION_DESIRED_HASH] == stable_hash(unhashed)


def test_engine_pods_request_host_cpu_and_memory_by_their_gpus_or_as_the_phase_says() -> None:
    md = example("01-kimi-k2")
    md["spec"]["prefill"]["resources"] = {"cpu": 48, "memory": "512Gi"}  # an int: a quantity too
    children = children_of(md)

    def requests(phase: str) -> dict[str, str]:
        name = f"{md['metadata']['name']}-{phase}"
        (engine,) = children[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        assert "cpu" not in engine["resources"]["limits"]  # requested, never limited
        assert "memory" not in engine["resources"]["limits"]
        return engine["resources"]["requests"]

    assert (requests("prefill")["cpu"], requests("prefill")["memory"]) == ("48", "512Gi")
    assert (requests("decode")["cpu"], requests("decode")["memory"]) == ("32", "192Gi")
    md = example("02-glm-5")
    md["spec"]["decode"]["tensorParallel"] = 4  # two pods a node: each half the CPUs
    md["spec"]["decode"]["expertParallel"] = 1
    children = children_of(md)
    assert (requests("decode")["cpu"], requests("decode")["memory"]) == ("16", "128Gi")


def test_engine_pods_get_time_to_drain_their_requests() -> None:
    md = example("01-kimi-k2")
    md["spec"]["decode"]["terminationGracePeriodSeconds"] = 1800
    children = children_of(md)

    def grace(phase: str) -> int:
        pod = children[("Deployment", f"kimi-k2-{phase}")]["spec"]["template"]["spec"]
        return pod["terminationGracePeriodSeconds"]

    assert (grace("prefill"), grace("decode")) == (600, 1800)  # SGLang drains on SIGTERM


def test_every_pod_gets_the_pool_priority_class() -> None:
    md = example("01-kimi-k2")
    assert all("priorityClassName" not in kid["spec"]["template"]["spec"]
               for (kind, _), kid in children_of(md).items() if kind == "Deployment")
    md["spec"]["nodePool"]["priorityClassName"] = "llm-serving"
    deployments = [kid for (kind, _), kid in children_of(md).items() if kind == "Deployment"]
    assert len(deployments) == 3  # both phases and the router
    assert {d["spec"]["template"]["spec"]["priorityClassName"] for d in deployments} == {
        "llm-serving"}


def test_engine_pod_template_schedules_on_the_gpu_pool() -> None:
    decode = children_of(example("01-kimi-k2"))[("Deployment", "kimi-k2-decode")]
    pod = decode["spec"]["template"]
    assert decode["spec"]["replicas"] == 2
    assert pod["metadata"]["labels"] == {c.LABEL_DEPLOYMENT: "kimi-k2", c.LABEL_PHASE: "decode",
                                         c.LABEL_MANAGED_BY: "tessera"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200",
                                           "tessera.dev/pool": "decode"}
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                           "effect": "NoSchedule"}]
    (engine,) = pod["spec"]["containers"]
    assert engine["command"] == ["tessera-runtime", "serve"]
    # GPUs requested and limited; host CPU and memory (4 and 16 GiB a GPU, plus the 64 GiB of
    # /dev/shm) requested only
    assert engine["resources"] == {
        "requests": {"nvidia.com/gpu": "8", "cpu": "32", "memory": "192Gi"},
        "limits": {"nvidia.com/gpu": "8"}}
    assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {
        "http": 30000, "metrics": 9400}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    env = {e["name"]: e for e in engine["env"]}
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env[c.ENV_RUNTIME_CONFIG]["value"] == "/etc/tessera/runtime.json"


def test_prefill_pods_announce_their_bootstrap_port() -> None:
    kids = children_of(example("01-kimi-k2"))
    prefill = kids[("Deployment", "kimi-k2-prefill")]["spec"]["template"]
    decode = kids[("Deployment", "kimi-k2-decode")]["spec"]["template"]
    assert prefill["metadata"]["annotations"][c.ANNOTATION_BOOTSTRAP_PORT] == "8998"
    assert c.ANNOTATION_BOOTSTRAP_PORT not in decode["metadata"]["annotations"]
    service = kids[("Service", "kimi-k2-prefill")]["spec"]
    assert service["clusterIP"] == "None"
    assert [p["port"] for p in service["ports"]] == [30000, 8998]


def pod_template_hashes(md: dict[str, Any]) -> dict[str, str]:
    return {name: stable_hash(obj["spec"]["template"])
            for (kind, name), obj in children_of(md).items() if kind == "Deployment"}


@pytest.mark.parametrize("edit", [
    lambda s: s["decode"].update(weights={"dtype": "fp8", "uri": "hf://x/fp8"}),
    lambda s: s["decode"].update(memFractionStatic=0.8),
    lambda s: s["decode"]["weights"].update(groupSize=128),
    lambda s: s["decode"].update(kernels={"decodeAttention": "tessera"}),
], ids=["weights-dtype", "mem-fraction", "group-size", "kernels"])
def test_a_decode_change_changes_only_the_decode_pod_template(edit: Any) -> None:
    before = example("01-kimi-k2")
    after = copy.deepcopy(before)
    edit(after["spec"])
    old, new = pod_template_hashes(before), pod_template_hashes(after)
    changed = sorted(name for name in old if old[name] != new[name])
    assert changed == ["kimi-k2-decode"]


def test_a_prefill_change_changes_only_the_prefill_pod_template() -> None:
    before = example("01-kimi-k2")
    after = copy.deepcopy(before)
    after["spec"]["prefill"]["weights"]["uri"] = "hf://moonshotai/other"
    old, new = pod_template_hashes(before), pod_template_hashes(after)
    assert sorted(n for n in old if old[n] != new[n]) == ["kimi-k2-prefill"]


def test_router_discovers_each_phase_by_label() -> None:
    kids = children_of(example("01-kimi-k2"))
    config = yaml.safe_load(kids[("ConfigMap", "kimi-k2-router-config")]["data"]["runtime.json"])
    assert config["mode"] == "disaggregated"
    assert config["discovery"]["prefill_selector"] == {c.LABEL_DEPLOYMENT: "kimi-k2",
                                                       c.LABEL_PHASE: "prefill"}
    role = kids[("Role", "kimi-k2-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    pod = kids[("Deployment", "kimi-k2-router")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kimi-k2-router"
    assert pod["containers"][0]["command"] == ["tessera-runtime", "router"]
    # no GPU for the router, and host requests only
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}


def test_engine_pods_may_only_create_events() -> None:
    kids = children_of(example("01-kimi-k2"))
    assert kids[("Role", "kimi-k2-engine")]["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    binding = kids[("RoleBinding", "kimi-k2-engine")]
    assert binding["roleRef"]["name"] == "kimi-k2-engine"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kimi-k2-engine",
                                    "namespace": "llm"}]
    for phase in ("prefill", "decode"):
        pod = kids[("Deployment", f"kimi-k2-{phase}")]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "kimi-k2-engine"


def test_integrity_tags_the_decode_pool_and_checksums_both_roles() -> None:
    kids = children_of(example("01-kimi-k2"))
    configs = {p: yaml.safe_load(kids[("ConfigMap", f"kimi-k2-{p}-config")]["data"]["runtime.json"])
               for p in ("prefill", "decode")}
    assert configs["decode"]["integrity"] == {"enabled": True}
    assert configs["prefill"]["integrity"] == {"enabled": False}
    assert all(cfg["disaggregation"]["kv_checksum"] for cfg in configs.values())


def test_engine_config_carries_the_phase_precision_and_plan() -> None:
    kids = children_of(example("01-kimi-k2"))
    config = yaml.safe_load(kids[("ConfigMap", "kimi-k2-decode-config")]["data"]["runtime.json"])
    assert config["phase"] == "decode"
    assert config["weights"] == {"dtype": "int4", "format": "compressed-tensors", "group_size": 32}
    assert config["kv_cache"]["dtype"] == "fp8_e4m3"
    assert config["integrity"] == {"enabled": True}
    assert config["memory"]["planned_weights_bytes_per_gpu"] > 0
    # Unset: Kimi K2 is MLA with 64-token pages, where FlashMLA measured fastest; only its
    # routed experts are INT4 (the release's scheme), which SGLang's Marlin MoE runs.
    assert config["kernels"] == {"decode_attention": "flashmla", "w4a16": "sglang"}


def test_an_expert_parallel_int4_decode_pool_runs_tesseras_dense_gemms_by_default() -> None:
    md = example("01-kimi-k2")
    md["spec"]["decode"].update(expertParallel=8)
    md["spec"]["decode"]["weights"]["quantize"] = ["attention", "sharedExperts", "routedExperts"]
    kids = children_of(md)
    configs = {p: yaml.safe_load(kids[("ConfigMap", f"kimi-k2-{p}-config")]["data"]["runtime.json"])
               for p in ("prefill", "decode")}
    assert configs["decode"]["kernels"]["w4a16"] == "tessera"
    assert configs["prefill"]["kernels"]["w4a16"] == "sglang"  # FP8 weights


def test_kernel_switches_reach_the_phase_runtime_config() -> None:
    md = example("01-kimi-k2")
    md["spec"]["decode"]["kernels"] = {"decodeAttention": "tessera", "w4a16": "tessera"}
    kids = children_of(md)
    configs = {p: yaml.safe_load(kids[("ConfigMap", f"kimi-k2-{p}-config")]["data"]["runtime.json"])
               for p in ("prefill", "decode")}
    assert configs["decode"]["kernels"] == {"decode_attention": "tessera", "w4a16": "tessera"}
    assert configs["prefill"]["kernels"] == {"decode_attention": "sglang", "w4a16": "sglang"}


@pytest.mark.parametrize("uri, path, volume", [
    ("hf://org/model", "/models", {"emptyDir": {}}),
    ("s3://bucket/dir", "/models", {"emptyDir": {}}),
    ("pvc://claim/glm/w4", "/models/glm/w4",
     {"persistentVolumeClaim": {"claimName": "claim", "readOnly": True}}),
    ("file:///opt/weights", "/opt/weights", None),
])
def test_checkpoint_location_by_uri_scheme(uri: str, path: str, volume: Any) -> None:
    md = example("02-glm-5")
    md["spec"]["decode"]["weights"]["uri"] = uri
    pod = children_of(md)[("Deployment", "glm-5-decode")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert checkpoint_path(uri) == path
    if volume is None:
        assert "models" not in volumes
    else:
        assert {k: v for k, v in volumes["models"].items() if k != "name"} == volume
