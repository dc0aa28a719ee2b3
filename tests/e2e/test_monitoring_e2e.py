"""Where admins look, against the real local API server:

- `kubectl explain` prints the CRD's own descriptions, down to md.spec.decode.kvCache.dtype;
- the chart rendered with the alerts and the dashboard on passes a server-side dry run, both
  as a plain rules ConfigMap (no Prometheus Operator) and as a PrometheusRule (with the engines'
  PodMonitor) once monitoring.coreos.com/v1 PrometheusRule and PodMonitor CRDs are served.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "modeldeployment.yaml"
CHART = ROOT / "charts" / "tessera-operator"
RELEASE = "tessera-operator-monitoring"
FIELDS = ("spec.model.contextLength", "spec.nodePool.gpu.memoryGiB", "spec.decode.kvCache",
          "spec.decode.kvCache.dtype", "spec.integrity.enabled", "status.conditions")


def schema_at(path: str) -> dict[str, Any]:
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    node = version["schema"]["openAPIV3Schema"]
    for name in path.split("."):
        node = node["properties"][name]
    return dict(node)


def words(text: str) -> str:
    return " ".join(text.split())


def test_kubectl_explain_prints_the_crds_descriptions(cluster: Any) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/modeldeployments.tessera.dev")
    for field in FIELDS:
        want = words(schema_at(field)["description"])
        deadline = time.monotonic() + 60  # the OpenAPI document is published shortly after
        while True:
            out = cluster.kubectl("explain", f"md.{field}", check=False)
            if want in words(out.stdout):
                break
            assert time.monotonic() < deadline, f"kubectl explain md.{field}:\n{out.stdout}" \
                                                f"{out.stderr}\nwanted: {want}"
            time.sleep(1)
        assert "<no description>" not in out.stdout
    # The parent lists each child field with its description's first words.
    parent = words(cluster.kubectl("explain", "md.spec.decode.kvCache").stdout)
    assert "dtype <string>" in parent and "pageSize <integer>" in parent


def template(cluster: Any, namespace: str, *extra: str) -> str:
    args = [str(cluster.binaries.helm), "template", RELEASE, str(CHART), "-n", namespace,
            "--set", "alerts.enabled=true", "--set", "dashboard.enabled=true",
            "--set", "metrics.serviceMonitor.enabled=false", *extra]
    result = subprocess.run(args, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def dry_run(cluster: Any, manifests: str) -> Any:
    return cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                           "--field-manager=monitoring-e2e", "-f", "-", input=manifests,
                           check=False)


def kinds_named(manifests: str) -> dict[str, str]:
    return {d["metadata"]["name"]: d["kind"] for d in yaml.safe_load_all(manifests) if d}


def test_alerts_and_dashboard_pass_a_server_side_dry_run_as_configmaps(
        cluster: Any, namespace: str) -> None:
    manifests = template(cluster, namespace)
    named = kinds_named(manifests)
    assert named[f"{RELEASE}-alerts"] == "ConfigMap"
    assert named[f"{RELEASE}-dashboard"] == "ConfigMap"
    result = dry_run(cluster, manifests)
    assert result.returncode == 0, result.stderr
    assert f"configmap/{RELEASE}-alerts serverside-applied (server dry run)" in result.stdout
    assert f"configmap/{RELEASE}-dashboard serverside-applied (server dry run)" in result.stdout


# The parts of the Prometheus Operator's PrometheusRule schema our rules use, written here so
# that the API server checks the rendered object's structure (rules need alert or record, an
# expr, and string labels and annotations).
PROMETHEUS_RULE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "prometheusrules.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com", "scope": "Namespaced",
        "names": {"kind": "PrometheusRule", "listKind": "PrometheusRuleList",
                  "plural": "prometheusrules", "singular": "prometheusrule"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
            "openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
                "spec": {"type": "object", "properties": {"groups": {
                    "type": "array", "items": {
                        "type": "object", "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string"},
                            "rules": {"type": "array", "items": {
                                "type": "object", "required": ["expr"],
                                "x-kubernetes-validations": [{
                                    "rule": "has(self.alert) != has(self.record)",
                                    "message": "a rule is an alert or a record"}],
                                "properties": {
                                    "alert": {"type": "string"},
                                    "record": {"type": "string"},
                                    "expr": {"x-kubernetes-int-or-string": True},
                                    "for": {"type": "string",
                                            "pattern": "^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"},
                                    "labels": {"type": "object",
                                               "additionalProperties": {"type": "string"}},
                                    "annotations": {"type": "object",
                                                    "additionalProperties": {"type": "string"}},
                                }}}}}}}}}}}}]}}


# Likewise for the PodMonitor of the engine pods.
PODMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com", "scope": "Namespaced",
        "names": {"kind": "PodMonitor", "listKind": "PodMonitorList", "plural": "podmonitors",
                  "singular": "podmonitor"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
            "openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
                "spec": {"type": "object", "required": ["selector"], "properties": {
                    "namespaceSelector": {"type": "object", "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}}}},
                    "selector": {"type": "object", "properties": {
                        "matchLabels": {"type": "object",
                                        "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array", "items": {
                            "type": "object", "required": ["key", "operator"],
                            "properties": {
                                "key": {"type": "string"},
                                "operator": {"type": "string"},
                                "values": {"type": "array", "items": {"type": "string"}}}}}}},
                    "podMetricsEndpoints": {"type": "array", "items": {
                        "type": "object", "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string",
                                         "pattern": "^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"},
                            "relabelings": {"type": "array", "items": {
                                "type": "object", "properties": {
                                    "sourceLabels": {"type": "array", "items": {
                                        "type": "string",
                                        "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
                                    "targetLabel": {"type": "string"},
                                    "regex": {"type": "string"},
                                    "action": {"type": "string"}}}}}}}}}}}}}]}}


def test_alerts_and_pod_monitor_pass_a_server_side_dry_run_with_the_prometheus_operator(
        cluster: Any, namespace: str) -> None:
    for crd in (PROMETHEUS_RULE_CRD, PODMONITOR_CRD):
        cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(crd))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                        f"crd/{crd['metadata']['name']}")
    manifests = template(cluster, namespace, "--api-versions",
                         "monitoring.coreos.com/v1/PrometheusRule",
                         "--set", "metrics.podMonitor.enabled=true")
    assert kinds_named(manifests)[f"{RELEASE}-alerts"] == "PrometheusRule"
    assert kinds_named(manifests)[f"{RELEASE}-engines"] == "PodMonitor"
    result = dry_run(cluster, manifests)
    assert result.returncode == 0, result.stderr
    assert (f"prometheusrule.monitoring.coreos.com/{RELEASE}-alerts serverside-applied "
            "(server dry run)") in result.stdout
    assert (f"podmonitor.monitoring.coreos.com/{RELEASE}-engines serverside-applied "
            "(server dry run)") in result.stdout
    # The schema above judges the rendered rules: a duration Prometheus cannot read is refused.
    broken = manifests.replace("for: 5m", "for: 5 minutes", 1)
    assert broken != manifests
    refused = dry_run(cluster, broken)
    assert refused.returncode != 0 and "rules[1].for" in refused.stderr, refused.stderr
