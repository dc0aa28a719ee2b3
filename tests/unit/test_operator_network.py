"""The KV-transfer network in the engine pods: RDMA resources, IPC_LOCK, the Multus
annotation, host networking and the runtime config's disaggregation section, per phase."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from tessera.operator import constants as c
from tessera.operator.children import desired_children, stable_hash
from tessera.operator.reconcile import plan_spec
from tessera.operator.render import render_configs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RDMA = {"rdma": {"resource": "rdma/ib", "count": 2}, "ibDevices": ["mlx5_0", "mlx5_1"],
        "attachments": ["rdma-net", "fabric/roce-b@net2"]}


def kimi(**phases_network: Any) -> dict[str, Any]:
    md = yaml.safe_load((EXAMPLES / "01-kimi-k2" / "modeldeployment.yaml").read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    for phase, network in phases_network.items():
        md["spec"][phase]["network"] = copy.deepcopy(network)
    return md


def engine(md: dict[str, Any], phase: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the phase's pod template, its runtime config)."""
    plan, error = plan_spec(md["spec"])
    assert error is None and plan is not None and plan.ok, plan and plan.findings
    configs = render_configs(md, plan)
    kids = {(o["kind"], o["metadata"]["name"]): o for o in desired_children(md, configs)}
    template = kids[("Deployment", f"kimi-k2-{phase}")]["spec"]["template"]
    return template, json.loads(configs[phase])


def test_without_network_the_pods_are_as_before_and_the_transfer_is_tcp() -> None:
    for phase in ("prefill", "decode"):
        template, config = engine(kimi(), phase)
        pod, container = template["spec"], template["spec"]["containers"][0]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        assert "securityContext" not in container
        assert c.ANNOTATION_NETWORKS not in template["metadata"]["annotations"]
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod
        assert config["disaggregation"] == {"transfer_backend": "mooncake", "rdma": False,
                                            "ib_devices": [], "allow_tcp": False,
                                            "kv_checksum": True}


def test_rdma_renders_resources_ipc_lock_attachments_and_the_config() -> None:
    md = kimi(prefill=RDMA, decode=RDMA)
    md["spec"]["transfer"] = {"backend": "nixl", "allowTCP": True}
    for phase in ("prefill", "decode"):
        template, config = engine(md, phase)
        container = template["spec"]["containers"][0]
        want = {"nvidia.com/gpu": "8", "rdma/ib": "2"}
        assert container["resources"]["limits"] == want
        assert want.items() <= container["resources"]["requests"].items()
        # IPC_LOCK is the only capability added; nothing else in the security context.
        assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert template["metadata"]["annotations"][c.ANNOTATION_NETWORKS] == (
            "rdma-net,fabric/roce-b@net2")
        assert "hostNetwork" not in template["spec"]
        assert config["disaggregation"] == {"transfer_backend": "nixl", "rdma": True,
                                            "ib_devices": ["mlx5_0", "mlx5_1"],
                                            "allow_tcp": True, "kv_checksum": True}


def test_auto_devices_leave_the_choice_to_the_engine() -> None:
    network = {"rdma": {"resource": "rdma/rdma_shared_device_a"}, "ibDevices": ["auto"]}
    template, config = engine(kimi(prefill=network, decode=network), "decode")
    assert config["disaggregation"]["rdma"] is True
    assert config["disaggregation"]["ib_devices"] == []
    assert template["spec"]["containers"][0]["resources"]["limits"][
        "rdma/rdma_shared_device_a"] == "1"


def test_host_network_is_an_explicit_opt_in_with_cluster_dns() -> None:
    template, _ = engine(kimi(decode={"hostNetwork": True}), "decode")
    assert template["spec"]["hostNetwork"] is True
    assert template["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    prefill, _ = engine(kimi(decode={"hostNetwork": True}), "prefill")
    assert "hostNetwork" not in prefill["spec"]


def template_hashes(md: dict[str, Any]) -> dict[str, str]:
    plan, _ = plan_spec(md["spec"])
    assert plan is not None
    return {o["metadata"]["name"]: stable_hash(o["spec"]["template"])
            for o in desired_children(md, render_configs(md, plan))
            if o["kind"] == "Deployment"}


@pytest.mark.parametrize("edit", [
    lambda s: s["decode"]["network"].update(attachments=["other-net"]),
    lambda s: s["decode"]["network"].update(ibDevices=["mlx5_3"]),
    lambda s: s["decode"]["network"]["rdma"].update(count=4),
    lambda s: s["decode"]["network"]["rdma"].update(resource="rdma/roce"),
    lambda s: s["decode"]["network"].pop("attachments") and
    s["decode"]["network"].update(hostNetwork=True),
], ids=["attachments", "ib-devices", "rdma-count", "rdma-resource", "host-network"])
def test_a_decode_network_change_rolls_only_decode(edit: Any) -> None:
    before = kimi(prefill=RDMA, decode=RDMA)
    after = copy.deepcopy(before)
    edit(after["spec"])
    old, new = template_hashes(before), template_hashes(after)
    assert sorted(name for name in old if old[name] != new[name]) == ["kimi-k2-decode"]


@pytest.mark.parametrize("transfer", [{"backend": "nixl"}, {"allowTCP": True}])
def test_a_transfer_change_rolls_both_phases_not_the_router(transfer: dict[str, Any]) -> None:
    before = kimi(prefill=RDMA, decode=RDMA)
    after = copy.deepcopy(before)
    after["spec"]["transfer"] = transfer
    old, new = template_hashes(before), template_hashes(after)
    assert sorted(name for name in old if old[name] != new[name]) == [
        "kimi-k2-decode", "kimi-k2-prefill"]


def test_link_speed_is_for_the_plan_only_and_rolls_nothing() -> None:
    before = kimi()
    after = copy.deepcopy(before)
    after["spec"]["transfer"] = {"linkGbps": 100}
    assert template_hashes(before) == template_hashes(after)


def test_a_replica_spanning_nodes_gets_the_network_on_every_pod() -> None:
    md = yaml.safe_load((EXAMPLES / "03-kimi-k2-multinode" / "modeldeployment.yaml").read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    for phase in ("prefill", "decode"):
        md["spec"][phase]["network"] = copy.deepcopy(RDMA)
    plan, error = plan_spec(md["spec"])
    assert error is None and plan is not None and plan.ok, plan and plan.findings
    [group] = [o for o in desired_children(md, render_configs(md, plan))
               if o["kind"] == c.LWS_KIND and o["metadata"]["name"].endswith("-prefill")]
    template = group["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    container = template["spec"]["containers"][0]
    assert container["resources"]["limits"]["rdma/ib"] == "2"
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert template["metadata"]["annotations"][c.ANNOTATION_NETWORKS] == (
        "rdma-net,fabric/roce-b@net2")
