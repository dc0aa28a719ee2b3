"""The Helm chart (charts/tessera-operator), rendered by the real `helm` binary.

RBAC is compared with tessera.operator.constants.RBAC_RULES, the table of every API call the
operator makes (tests/unit/test_operator_api.py ties that table to the code); the Deployment's
command line is parsed by the operator's own argument parser.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from tessera.operator import constants as c

from tessera.cli import parse_args
from tessera.devcluster.build import Binaries, cache_root

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tessera-operator"
RELEASE, NAMESPACE = "tessera-operator", "tessera-system"
LEASE_RESOURCE = ("coordination.k8s.io", "leases")


def helm_binary() -> Path:
    helm = Binaries.in_cache(cache_root()).helm
    if not helm.is_file():
        pytest.fail(f"helm is not at {helm}: run scripts/setup.sh (or `tessera dev-cluster build`)")
    return helm


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True,
                            timeout=60)
    if check and result.returncode:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def rule_table(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs; fails if a pair is granted by two rules."""
    table: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in table, f"{group}/{resource} granted twice"
                table[(group, resource)] = set(rule["verbs"])
    return table


# -- CRDs --

def test_chart_crds_are_exact_copies_of_crds_folder() -> None:
    source = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    copies = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert source, "crds/ holds no CRD"
    assert copies.keys() == source.keys(), "run scripts/sync-chart-crds.sh"
    for name, text in source.items():
        assert copies[name] == text, f"charts/tessera-operator/crds/{name} is stale: " \
                                     "run scripts/sync-chart-crds.sh"


def test_sync_script_check_mode_agrees() -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "sync-chart-crds.sh"), "--check"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


# -- lint and values --

def test_helm_lint_strict() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


def _documented_leaves(text: str) -> list[tuple[str, bool]]:
    """Every leaf value of values.yaml as (dotted path, documented), where a key is documented
    by a `# --` comment right above it or above one of its parents (the helm-docs rule)."""
    leaves: list[tuple[str, bool]] = []
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    comment = False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
            continue
        if stripped.startswith("#"):
            continue  # continuation of a comment block
        match = re.match(r"^( *)([A-Za-z_][\w-]*):(.*)$", line)
        if not match:
            comment = False
            continue
        indent, key, rest = len(match[1]), match[2], match[3].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = comment or any(d for _, _, d in stack)
        comment = False
        path = ".".join([k for _, k, _ in stack] + [key])
        nxt = next((ln for ln in lines[i + 1:] if ln.strip() and not ln.strip().startswith("#")),
                   "")
        deeper = len(nxt) - len(nxt.lstrip(" ")) > indent
        if rest or not deeper:
            leaves.append((path, documented))
        else:
            stack.append((indent, key, documented))
    return leaves


def test_every_value_is_documented() -> None:
    leaves = _documented_leaves((CHART / "values.yaml").read_text())
    assert len(leaves) > 20
    undocumented = [path for path, ok in leaves if not ok]
    assert not undocumented, f"values without a `# --` comment: {undocumented}"


def test_documentation_check_catches_an_undocumented_value() -> None:
    leaves = dict(_documented_leaves("# -- doc\na: 1\nb:\n  # -- doc\n  c: 2\n  d: 3\n"))
    assert leaves == {"a": True, "b.c": True, "b.d": False}


# -- RBAC --

def test_rbac_grants_exactly_the_operators_api_calls() -> None:
    docs = render()
    cluster_rules = rule_table(one(docs, "ClusterRole")["rules"])
    role = one(docs, "Role")
    role_rules = rule_table(role["rules"])
    assert not cluster_rules.keys() & role_rules.keys()
    granted = {**cluster_rules, **role_rules}
    wanted = {(group, resource): set(verbs) for group, resource, verbs in c.RBAC_RULES}
    missing = {k: v - granted.get(k, set()) for k, v in wanted.items()
               if v - granted.get(k, set())}
    extra = {k: v - wanted.get(k, set()) for k, v in granted.items() if v - wanted.get(k, set())}
    assert not missing, f"the chart lacks grants the operator needs: {missing}"
    assert not extra, f"the chart grants what the operator never calls: {extra}"


def test_leases_are_granted_only_in_the_release_namespace() -> None:
    docs = render()
    role = one(docs, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert set(rule_table(role["rules"])) == {LEASE_RESOURCE}
    assert LEASE_RESOURCE not in rule_table(one(docs, "ClusterRole")["rules"])


def test_rbac_has_no_wildcard_and_no_extra_rule_fields() -> None:
    for role in by_kind(render(), "ClusterRole") + by_kind(render(), "Role"):
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
            for field in ("apiGroups", "resources", "verbs"):
                assert all("*" not in item for item in rule[field]), rule


def test_bindings_bind_the_roles_to_the_service_account() -> None:
    docs = render()
    sa = one(docs, "ServiceAccount")["metadata"]
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = one(docs, kind)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                      "name": one(docs, role_kind)["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"],
                                        "namespace": sa["namespace"]}]


def test_rbac_create_false_renders_no_rbac() -> None:
    kinds = {d["kind"] for d in render("rbac.create=false")}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


# -- the Deployment --

def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _operator_args(container: dict[str, Any]) -> Any:
    assert container["command"][0] == "tessera"
    return parse_args(container["command"][1:] + container["args"])


def test_deployment_runs_two_replicas_under_one_lease() -> None:
    docs = render()
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    args = _operator_args(_container(docs))
    assert args.command == "operator" and args.operator_command == "run"
    assert args.leader_election == f"{NAMESPACE}/{deployment['metadata']['name']}"
    env = {e["name"]: e for e in _container(docs)["env"]}
    # leader.py takes the replica's identity from POD_NAME.
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]


def test_operator_values_reach_the_command_line() -> None:
    docs = render("operator.resyncSeconds=7", "operator.verbose=true",
                  "operator.extraArgs={--namespace,llm}")
    args = _operator_args(_container(docs))
    assert (args.resync_seconds, args.verbose, args.namespace) == (7.0, True, ["llm"])


def test_pod_security_is_restricted() -> None:
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = _container(docs)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert _container(docs)["resources"]["limits"]["memory"]
    # The only writable path is an emptyDir.
    mounts = {m["name"]: m["mountPath"] for m in _container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"tmp": "/tmp"} and "emptyDir" in volumes["tmp"]


def test_image_user_matches_the_pods_user() -> None:
    dockerfile = (ROOT / "images" / "operator" / "Dockerfile").read_text()
    users = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert users, "the image must name a numeric USER (runAsNonRoot needs one)"
    ctx = one(render(), "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert users[-1] == (str(ctx["runAsUser"]), str(ctx["runAsGroup"]))
    assert re.search(r'^ENTRYPOINT \["tessera"\]', dockerfile, re.M)


def test_image_tag_defaults_to_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert _container(render())["image"] == f"tessera/operator:{chart['appVersion']}"
    assert _container(render("image.tag=dev"))["image"] == "tessera/operator:dev"


# -- metrics --

def test_metrics_on_by_default_and_off_on_request() -> None:
    docs = render()
    (service,) = by_kind(docs, "Service")
    assert _container(docs)["ports"] == [{"name": "metrics", "containerPort": 8080,
                                          "protocol": "TCP"}]
    assert _operator_args(_container(docs)).metrics_port == 8080
    assert not by_kind(docs, "ServiceMonitor")
    off = render("metrics.enabled=false")
    assert not by_kind(off, "Service") and "ports" not in _container(off)
    assert _operator_args(_container(off)).metrics_port == 0  # the operator serves nothing


def test_metrics_service_and_service_monitor_select_the_operator_port() -> None:
    docs = render("metrics.enabled=true", "metrics.port=9100",
                  "metrics.serviceMonitor.enabled=true")
    service, monitor = one(docs, "Service"), one(docs, "ServiceMonitor")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9100,
                                         "targetPort": "metrics", "protocol": "TCP"}]
    assert _container(docs)["ports"][0]["containerPort"] == 9100
    assert _operator_args(_container(docs)).metrics_port == 9100
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()


def test_service_monitor_without_metrics_is_refused() -> None:
    result = helm("template", RELEASE, str(CHART), "--set", "metrics.enabled=false",
                  "--set", "metrics.serviceMonitor.enabled=true", check=False)
    assert result.returncode != 0 and "needs metrics.enabled=true" in result.stderr
