"""The CRD agrees with the planner and the runtime config on every enum they share, and the
RBAC table covers every call the operator makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import kopf
import pytest
import yaml
from tessera.operator import constants as c
from tessera.operator.kube import CHILD_KINDS
from tessera.runtime import config as runtime_config
from tessera.runtime.planner import PRESETS
from tessera.runtime.planner.kv import KV_DTYPES
from tessera.runtime.planner.weights import INT4_GROUP_SIZES, WEIGHT_DTYPES

CRD = Path(__file__).resolve().parents[2] / "crds" / "modeldeployment.yaml"


@pytest.fixture(scope="module")
def version() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["group"] == "tessera.dev" and crd["spec"]["names"]["shortNames"] == ["md"]
    (v,) = crd["spec"]["versions"]
    return v


def phase_schema(version: dict[str, Any], phase: str) -> dict[str, Any]:
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][phase]


@pytest.mark.parametrize("phase", ["prefill", "decode", "single"])
def test_phase_enums_match_planner_and_runtime(version: dict[str, Any], phase: str) -> None:
    props = phase_schema(version, phase)["properties"]
    weights, kv = props["weights"]["properties"], props["kvCache"]["properties"]
    assert tuple(weights["dtype"]["enum"]) == WEIGHT_DTYPES
    assert tuple(kv["dtype"]["enum"]) == tuple(KV_DTYPES)
    assert tuple(kv["pageSize"]["enum"]) == runtime_config.PAGE_SIZES
    assert set(weights["groupSize"]["enum"]) <= set(INT4_GROUP_SIZES)
    assert set(weights["groupSize"]["enum"]) <= set(runtime_config.INT4_GROUP_SIZES)
    assert set(weights["format"]["enum"]) == set(
        runtime_config.CheckpointFormat.__args__)  # type: ignore[attr-defined]
    kernels = props["kernels"]["properties"]
    assert set(kernels) == {"decodeAttention", "w4a16"}
    assert set(kernels["w4a16"]["enum"]) == set(get_args(runtime_config.KernelImpl))
    # Unset decodeAttention and w4a16: the operator picks the measured winner, so no schema
    # default.
    assert "default" not in kernels["w4a16"]
    assert set(kernels["decodeAttention"]["enum"]) == set(
        get_args(runtime_config.DecodeAttentionImpl))
    assert "default" not in kernels["decodeAttention"]


def test_presets_match_planner(version: dict[str, Any]) -> None:
    model = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert set(model["properties"]["architecture"]["properties"]["preset"]["enum"]) == set(PRESETS)


def test_status_subresource_and_printer_columns(version: dict[str, Any]) -> None:
    assert version["subresources"] == {"status": {}}
    columns = {col["name"]: col["jsonPath"] for col in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Phases"] == ".status.summary.replicas"
    assert columns["KV"] == ".status.summary.kvCache"
    assert columns["Age"] == ".metadata.creationTimestamp"


def rbac() -> dict[tuple[str, str], set[str]]:
    return {(group, resource): set(verbs) for group, resource, verbs in c.RBAC_RULES}


def test_rbac_covers_child_writes_and_watches() -> None:
    rules = rbac()
    for (api_version, _), plural in CHILD_KINDS.items():
        group = api_version.rpartition("/")[0]
        assert {"list", "watch", "patch", "delete"} <= rules[(group, plural)], plural


def test_rbac_covers_every_resource_kopf_watches() -> None:
    import tessera.operator.handlers  # noqa: F401  (registers the handlers)

    rules = rbac()
    registry = kopf.get_default_registry()
    watched = {(h.selector.group or "", h.selector.any_name)
               for h in registry._watching.get_all_handlers()}
    assert watched
    for group, plural in watched:
        assert {"list", "watch"} <= rules[(group, plural)], (group, plural)


def test_rbac_grants_what_the_router_role_grants() -> None:
    # RBAC forbids granting permissions one does not hold.
    assert {"get", "list", "watch"} <= rbac()[("", "pods")]
