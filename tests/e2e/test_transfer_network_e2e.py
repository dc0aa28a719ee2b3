"""The KV-transfer network on the real control plane: RDMA requests schedule only onto nodes
that advertise the devices, the pods carry the Multus annotation and IPC_LOCK (and nothing
else), a pool without RDMA leaves the phase unready quoting the scheduler, Pod Security
`baseline` refuses the capability, and a decode network change rolls only decode. The API
server itself refuses malformed network settings (CEL)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tessera.operator import constants as c
from test_operator_e2e import ROOT, Operator, apply, conditions, get_md, pod_uids, poll, tiny
from test_operator_e2e import operator as operator  # noqa: F401  (the module's operator fixture)

from tessera.devcluster.nodes import POOL_LABEL, NodePool, node_manifests

pytestmark = pytest.mark.e2e

RDMA_RESOURCE = "rdma/ib"
FABRIC = NodePool("fabric", nodes=2, rdma={RDMA_RESOURCE: 8})
# The fabric nodes are tainted so only this module's pods, which tolerate it, land there.
TAINT = {"key": "tessera.dev/fabric", "value": "rdma", "effect": "NoSchedule"}
NETWORK = {"rdma": {"resource": RDMA_RESOURCE, "count": 1}, "ibDevices": ["mlx5_0"],
           "attachments": ["roce-a"]}


@pytest.fixture(scope="module")
def fabric(cluster: Any) -> Iterator[list[str]]:
    """Two simulated H200 nodes that advertise 8 RDMA devices each; removed afterwards."""
    nodes = node_manifests((FABRIC,))
    for node in nodes:
        node["spec"] = {"taints": [TAINT]}
    cluster.kubectl("apply", "-f", "-", input={"apiVersion": "v1", "kind": "List",
                                               "items": nodes})
    names = [n["metadata"]["name"] for n in nodes]
    cluster.kubectl("wait", "--for=condition=Ready", "--timeout=60s",
                    *(f"node/{n}" for n in names))
    yield names
    cluster.kubectl("delete", "node", *names, "--wait=false", check=False)


def rdma_deployment(name: str, decode_pool: str = FABRIC.name) -> dict[str, Any]:
    md = tiny(name)
    spec = md["spec"]
    spec["nodePool"]["tolerations"] = [{**TAINT, "operator": "Equal"}]
    spec["transfer"] = {"backend": "mooncake"}
    for phase, pool in (("prefill", FABRIC.name), ("decode", decode_pool)):
        spec[phase]["network"] = copy.deepcopy(NETWORK)
        spec[phase]["nodeSelector"] = {POOL_LABEL: pool}
    return md


def pods(kubectl: Callable[..., Any], namespace: str, phase: str) -> list[dict[str, Any]]:
    items = json.loads(kubectl("get", "pods", "-n", namespace, "-l", f"{c.LABEL_PHASE}={phase}",
                               "-o", "json").stdout)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def runtime_config(kubectl: Callable[..., Any], namespace: str, name: str,
                   phase: str) -> dict[str, Any]:
    cm = json.loads(kubectl("get", "configmap", f"{name}-{phase}-config", "-n", namespace,
                            "-o", "json").stdout)
    return json.loads(cm["data"][c.CONFIG_KEY])


def wait_ready(kubectl: Callable[..., Any], namespace: str, name: str) -> None:
    poll(f"{name} Ready", lambda: conditions(get_md(kubectl, namespace, name)).get(
        "Ready", {}).get("status") == "True", timeout=90)


def privileged(kubectl: Callable[..., Any], namespace: str) -> None:
    """IPC_LOCK is outside Pod Security `baseline`: RDMA pods need `privileged`."""
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=privileged")


def test_rdma_pods_land_on_rdma_nodes_with_the_attachment_and_ipc_lock(
        operator: Operator, kubectl: Any, namespace: str, fabric: list[str]) -> None:
    privileged(kubectl, namespace)
    apply(kubectl, namespace, rdma_deployment("rdma"))
    wait_ready(kubectl, namespace, "rdma")
    engine = pods(kubectl, namespace, "prefill") + pods(kubectl, namespace, "decode")
    assert len(engine) == 3
    for pod in engine:
        assert pod["spec"]["nodeName"] in fabric
        assert pod["metadata"]["annotations"][c.ANNOTATION_NETWORKS] == "roce-a"
        [container] = pod["spec"]["containers"]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "1", RDMA_RESOURCE: "1"}
        assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert "hostNetwork" not in pod["spec"]
    # The router moves no KV: no RDMA, no capability.
    [router] = pods(kubectl, namespace, "router")
    assert "securityContext" not in router["spec"]["containers"][0]
    assert RDMA_RESOURCE not in router["spec"]["containers"][0].get("resources", {}).get(
        "limits", {})
    for phase in ("prefill", "decode"):
        assert runtime_config(kubectl, namespace, "rdma", phase)["disaggregation"] == {
            "transfer_backend": "mooncake", "rdma": True, "ib_devices": ["mlx5_0"],
            "allow_tcp": False, "kv_checksum": True}


def test_changing_the_decode_network_rolls_only_decode(
        operator: Operator, kubectl: Any, namespace: str, fabric: list[str]) -> None:
    privileged(kubectl, namespace)
    md = rdma_deployment("reroll")
    apply(kubectl, namespace, md)
    wait_ready(kubectl, namespace, "reroll")
    prefill, decode = pod_uids(kubectl, namespace, "prefill"), pod_uids(kubectl, namespace,
                                                                        "decode")
    prefill_generation = json.loads(kubectl("get", "deployment", "reroll-prefill", "-n",
                                            namespace, "-o", "json").stdout)["metadata"][
        "generation"]

    md["spec"]["decode"]["network"].update(attachments=["roce-b"], ibDevices=["mlx5_1"])
    apply(kubectl, namespace, md)

    def rolled() -> bool:
        now = pods(kubectl, namespace, "decode")
        return (len(now) == 2 and not {p["metadata"]["uid"] for p in now} & decode
                and all(p["metadata"]["annotations"][c.ANNOTATION_NETWORKS] == "roce-b"
                        for p in now)
                and conditions(get_md(kubectl, namespace, "reroll"))["Ready"]["status"] == "True")

    poll("decode pods replaced with the new network, and Ready", rolled, timeout=90)
    assert pod_uids(kubectl, namespace, "prefill") == prefill
    assert json.loads(kubectl("get", "deployment", "reroll-prefill", "-n", namespace, "-o",
                              "json").stdout)["metadata"]["generation"] == prefill_generation
    assert runtime_config(kubectl, namespace, "reroll", "decode")["disaggregation"][
        "ib_devices"] == ["mlx5_1"]
    assert runtime_config(kubectl, namespace, "reroll", "prefill")["disaggregation"][
        "ib_devices"] == ["mlx5_0"]


def test_a_pool_without_rdma_leaves_the_phase_unready_quoting_the_scheduler(
        operator: Operator, kubectl: Any, namespace: str, fabric: list[str]) -> None:
    privileged(kubectl, namespace)
    # Decode asks for RDMA on the default decode pool, whose nodes advertise none.
    apply(kubectl, namespace, rdma_deployment("nordma", decode_pool="decode"))

    def unschedulable() -> list[dict[str, Any]] | None:
        pending = pods(kubectl, namespace, "decode")
        conds = [next((x for x in p["status"].get("conditions", [])
                       if x["type"] == "PodScheduled"), None) for p in pending]
        ok = len(pending) == 2 and all(x and x["status"] == "False" for x in conds)
        return conds if ok else None  # type: ignore[return-value]

    for cond in poll("both decode pods unschedulable", unschedulable):
        assert cond["reason"] == "Unschedulable"
        assert f"Insufficient {RDMA_RESOURCE}" in cond["message"], cond

    def ready_says_why() -> dict[str, Any] | None:
        ready = conditions(get_md(kubectl, namespace, "nordma")).get("Ready", {})
        return ready if f"Insufficient {RDMA_RESOURCE}" in ready.get("message", "") else None

    ready = poll("Ready to quote the scheduler", ready_says_why)
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable")
    assert re.search(r"decode 0/2 ready: pods? nordma-decode-\S+ .*unschedulable: 0/\d+ nodes "
                     r"are available: \d+ Insufficient rdma/ib", ready["message"]), ready
    # The prefill, on the RDMA nodes, is placed and runs.
    assert all(p["spec"].get("nodeName") in fabric for p in pods(kubectl, namespace, "prefill"))


def test_pod_security_baseline_refuses_ipc_lock_and_says_so(
        operator: Operator, kubectl: Any, namespace: str, fabric: list[str]) -> None:
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline")
    apply(kubectl, namespace, rdma_deployment("baseline"))

    def refused() -> dict[str, Any] | None:
        degraded = conditions(get_md(kubectl, namespace, "baseline")).get("Degraded", {})
        return degraded if degraded.get("reason") == "PodSecurityRejected" else None

    degraded = poll("Degraded PodSecurityRejected", refused)
    assert 'violates PodSecurity "baseline:latest"' in degraded["message"]
    assert '"IPC_LOCK"' in degraded["message"]


# --- The API server refuses malformed network settings (dry run: nothing is stored). ---

Edit = Callable[[dict[str, Any]], Any]
CASES: list[tuple[str, Edit, list[str]]] = [
    ("devices without rdma", lambda s: s["decode"].update(network={"ibDevices": ["mlx5_0"]}),
     ["spec.decode.network.ibDevices", "set network.rdma too"]),
    ("auto mixed with names", lambda s: s["decode"]["network"].update(
        ibDevices=["auto", "mlx5_0"]), ["spec.decode.network.ibDevices", "[auto] or a list"]),
    ("rdma on one end only", lambda s: s["prefill"].pop("network"),
     ["spec: Invalid value", "RDMA on both ends or on neither"]),
    ("attachments with host networking", lambda s: s["decode"]["network"].update(
        hostNetwork=True), ["spec.decode.network.attachments", "not both"]),
    ("GPUs as the RDMA resource", lambda s: s["decode"]["network"]["rdma"].update(
        resource="nvidia.com/gpu"), ["spec.decode.network.rdma.resource",
                                     "GPUs are requested from tensorParallel"]),
    ("resource without a domain", lambda s: s["decode"]["network"]["rdma"].update(
        resource="ib"), ["spec.decode.network.rdma.resource", "should match"]),
    ("zero devices", lambda s: s["decode"]["network"]["rdma"].update(count=0),
     ["spec.decode.network.rdma.count", "greater than or equal to 1"]),
    ("attachment not a name", lambda s: s["decode"]["network"].update(
        attachments=["Roce A"]), ["spec.decode.network.attachments[0]", "should match"]),
    ("device with a port suffix", lambda s: s["decode"]["network"].update(
        ibDevices=["mlx5_0:1"]), ["spec.decode.network.ibDevices[0]", "should match"]),
    ("unknown backend", lambda s: s["transfer"].update(backend="ucx"),
     ["spec.transfer.backend", "Unsupported value"]),
    ("link speed 0", lambda s: s["transfer"].update(linkGbps=0),
     ["spec.transfer.linkGbps", "greater than or equal to 1"]),
]


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "crds" / "modeldeployment.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/modeldeployments.tessera.dev")


@pytest.mark.parametrize("edit, expected", [(e, x) for _, e, x in CASES],
                         ids=[w for w, _, _ in CASES])
def test_malformed_network_is_refused_naming_the_field(crd: None, kubectl: Any, namespace: str,
                                                       edit: Edit, expected: list[str]) -> None:
    md = rdma_deployment("bad")
    edit(md["spec"])
    result = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=md,
                     check=False)
    assert result.returncode != 0, "the API server accepted it"
    for text in expected:
        assert text in result.stderr, result.stderr


def test_a_single_pool_takes_no_transfer_settings(crd: None, kubectl: Any,
                                                  namespace: str) -> None:
    md = tiny("single")
    md["spec"]["single"] = md["spec"].pop("decode")
    del md["spec"]["prefill"]
    md["spec"]["single"]["network"] = {"hostNetwork": True}
    result = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=md,
                     check=False)
    assert result.returncode != 0 and "a single pool has none" in result.stderr, result.stderr


def test_defaults_keep_the_transfer_on_tcp_and_are_filled_in(crd: None, kubectl: Any,
                                                             namespace: str) -> None:
    md = tiny("defaults")
    md["spec"]["transfer"] = {}
    md["spec"]["decode"]["network"] = md["spec"]["prefill"]["network"] = {
        "rdma": {"resource": RDMA_RESOURCE}, "ibDevices": ["auto"]}
    created = json.loads(kubectl("create", "-n", namespace, "-o", "json", "-f", "-",
                                 input=md).stdout)["spec"]
    assert created["transfer"] == {"backend": "mooncake", "allowTCP": False, "linkGbps": 400}
    assert created["decode"]["network"] == {"rdma": {"resource": RDMA_RESOURCE, "count": 1},
                                            "ibDevices": ["auto"], "hostNetwork": False}
    # Without any network or transfer field (today's manifests) the spec stays valid.
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=tiny("plain"))
