"""The chart's alert rules and Grafana dashboard, checked by the real promtool (built by
scripts/setup.sh from the Go module proxy, `tessera.devcluster.promtool`).

- `promtool check rules` accepts files/alerts.yaml, and `promtool test rules` sees every alert
  fire and not fire on synthetic series;
- every dashboard query parses (promtool checks a rule file holding each as a recording rule);
- every metric the dashboard and the alerts name exists: SGLang's in SGLang's installed source,
  ours in the registries our code builds.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import re
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from tessera import dashboard
from tessera.devcluster.promtool import promtool_path

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "charts" / "tessera-operator" / "files" / "alerts.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
RUNBOOKS = "https://github.com/tessera-dev/tessera/blob/main/docs/operations.md#"
# Metric names are the only tokens of our queries with these prefixes.
METRIC = re.compile(r"\b(?:sglang:|tessera_)[A-Za-z0-9_:]*")


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def promtool() -> Path:
    path = promtool_path()
    if not path.is_file():
        pytest.skip(f"promtool is not built at {path}: run scripts/setup.sh "
                    "(`python -m tessera dev-cluster build` builds it)")
    return path


def run(promtool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool), *args], capture_output=True, text=True, timeout=120)


# -- the rules --

def test_promtool_checks_the_rules(promtool: Path) -> None:
    result = run(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_every_alert_says_what_and_links_its_runbook() -> None:
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#{2,4} (.+)$", OPERATIONS.read_text(), re.M)}
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)) == 6
    for rule in rules():
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning")
        anchor = notes["runbook_url"].removeprefix(RUNBOOKS)
        assert anchor == rule["alert"].lower(), notes["runbook_url"]
        assert anchor in headings, f"docs/operations.md has no section {rule['alert']}"


@dataclass(frozen=True)
class Case:
    """Synthetic series, and the alerts expected at `at` (labels each, severity aside)."""

    series: dict[str, str]
    at: str
    fires: list[dict[str, str]] = field(default_factory=list)


MD = {"namespace": "llm", "deployment": "kimi-k2"}
DECODE = {**MD, "phase": "decode"}
ENGINE = 'namespace="llm", deployment="kimi-k2", phase="decode", pod="kimi-k2-decode-0"'
OPERATOR = 'job="tessera-operator", instance="10.0.0.5:8080"'
STATUS = f'{OPERATOR}, namespace="llm", deployment="kimi-k2"'

CASES: dict[str, list[Case]] = {
    "TesseraKVIntegrityMismatch": [
        Case({f"tessera_kv_integrity_aborted_requests_total{{{ENGINE}}}": "0 0 0 2 2 2"},
             "4m", [MD]),
        Case({f"tessera_kv_integrity_aborted_requests_total{{{ENGINE}}}": "0x10"}, "8m"),
        Case({f'tessera_modeldeployment_condition{{{STATUS}, type="KVIntegrity", '
              f'status="False", reason="MismatchesDetected"}}': "1x5"}, "1m", [MD]),
        Case({f'tessera_modeldeployment_condition{{{STATUS}, type="KVIntegrity", '
              f'status="True", reason="NoMismatches"}}': "1x5"}, "1m"),
    ],
    "TesseraPhaseReplicasMissing": [
        Case({f'tessera_modeldeployment_replicas{{{STATUS}, phase="decode"}}': "2x10",
              f'tessera_modeldeployment_ready_replicas{{{STATUS}, phase="decode"}}': "1x10"},
             "6m", [{**DECODE, "job": "tessera-operator", "instance": "10.0.0.5:8080"}]),
        # Short of a replica for 3 minutes only (a pod restarting), then whole again.
        Case({f'tessera_modeldeployment_replicas{{{STATUS}, phase="decode"}}': "2x10",
              f'tessera_modeldeployment_ready_replicas{{{STATUS}, phase="decode"}}':
                  "1 1 1 2 2 2 2 2 2"}, "6m"),
    ],
    "TesseraKVCacheFull": [
        Case({f"sglang:token_usage{{{ENGINE}}}": "0.97x15",
              f"sglang:num_queue_reqs{{{ENGINE}}}": "3x15"}, "12m", [DECODE]),
        Case({f"sglang:token_usage{{{ENGINE}}}": "0.97x15",
              f"sglang:num_queue_reqs{{{ENGINE}}}": "0x15"}, "12m"),
        Case({f"sglang:token_usage{{{ENGINE}}}": "0.90x15",
              f"sglang:num_queue_reqs{{{ENGINE}}}": "3x15"}, "12m"),
    ],
    "TesseraOperatorNotReconciling": [
        Case({f"tessera_operator_deployments{{{OPERATOR}}}": "2x30",
              f'tessera_operator_reconciles_total{{{OPERATOR}, result="ok"}}': "40x30"},
             "25m", [{}]),
        Case({"up{job=\"something-else\"}": "1x30"}, "15m", [{}]),  # no operator scraped
        Case({f"tessera_operator_deployments{{{OPERATOR}}}": "2x30",
              f'tessera_operator_reconciles_total{{{OPERATOR}, result="ok"}}': "0+2x30"},
             "25m"),
        Case({f"tessera_operator_deployments{{{OPERATOR}}}": "0x30",
              f'tessera_operator_reconciles_total{{{OPERATOR}, result="ok"}}': "40x30"},
             "25m"),
    ],
    "TesseraOperatorReconcileErrors": [
        Case({f'tessera_operator_reconciles_total{{{OPERATOR}, result="error"}}': "0+1x30"},
             "22m", [{}]),
        Case({f'tessera_operator_reconciles_total{{{OPERATOR}, result="error"}}': "3x30",
              f'tessera_operator_reconciles_total{{{OPERATOR}, result="ok"}}': "0+5x30"},
             "22m"),
    ],
    "TesseraWeightsJobFailed": [
        Case({f'tessera_modeldeployment_condition{{{STATUS}, type="WeightsReady", '
              f'status="False", reason="ConversionFailed"}}': "1x5"}, "1m",
             [{**MD, "reason": "ConversionFailed"}]),
        Case({f'tessera_modeldeployment_condition{{{STATUS}, type="WeightsReady", '
              f'status="False", reason="FetchFailed"}}': "1x5"}, "1m",
             [{**MD, "reason": "FetchFailed"}]),
        Case({f'tessera_modeldeployment_condition{{{STATUS}, type="WeightsReady", '
              f'status="False", reason="Converting"}}': "1x5"}, "1m"),
    ],
}


def expand(template: str, labels: dict[str, str]) -> str:
    """The rules' annotations use only `{{ $labels.NAME }}`; fill them in."""
    out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], template)
    assert "{{" not in out, f"an annotation template this test cannot expand: {template}"
    return out


def promtool_tests() -> dict[str, Any]:
    by_name = {r["alert"]: r for r in rules()}
    tests = []
    for name, cases in CASES.items():
        rule = by_name[name]
        for case in cases:
            alerts = [{"exp_labels": {**labels, **rule["labels"]},
                       "exp_annotations": {k: expand(v, labels)
                                           for k, v in rule["annotations"].items()}}
                      for labels in case.fires]
            tests.append({"interval": "1m",
                          "input_series": [{"series": s, "values": v}
                                           for s, v in case.series.items()],
                          "alert_rule_test": [{"eval_time": case.at, "alertname": name,
                                               "exp_alerts": alerts}]})
    return {"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests}


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    assert set(CASES) == {r["alert"] for r in rules()}
    for name, cases in CASES.items():
        assert any(c.fires for c in cases) and any(not c.fires for c in cases), name


def test_promtool_unit_tests_every_alert(promtool: Path, tmp_path: Path) -> None:
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(promtool_tests(), sort_keys=False))
    result = run(promtool, "test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(promtool: Path, tmp_path: Path) -> None:
    """The check above can fail: the same tests expecting a firing alert to stay quiet."""
    spec = promtool_tests()
    first = spec["tests"][0]["alert_rule_test"][0]
    assert first["exp_alerts"]
    first["exp_alerts"] = []
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = run(promtool, "test", "rules", str(path))
    assert result.returncode != 0 and "TesseraKVIntegrityMismatch" in result.stdout + \
        result.stderr


# -- the dashboard --

def test_the_charts_dashboard_is_generated_from_code() -> None:
    assert dashboard.OUTPUT.read_text() == dashboard.render(), \
        "run python -m tessera.dashboard"


def dashboard_queries() -> list[str]:
    model = json.loads(dashboard.render())
    exprs = [t["expr"] for p in model["panels"] for t in p.get("targets", [])]
    variables = [v["query"] for v in model["templating"]["list"]
                 if v["type"] == "query"]
    # label_values(SELECTOR, label): the selector is the part Prometheus evaluates.
    selectors = [re.fullmatch(r"label_values\((.+), *\w+\)", q)[1] for q in variables]
    return exprs + selectors


def as_promql(query: str) -> str:
    """A Grafana query with its variables filled in as Grafana would."""
    return (query.replace("$__rate_interval", "2m").replace("$namespace", ".*")
            .replace("$deployment", ".*").replace("$phase", ".*"))


def check_queries(promtool: Path, queries: Iterable[str], tmp_path: Path
                  ) -> subprocess.CompletedProcess[str]:
    records = [{"record": f"tessera:dashboard_query:{i}", "expr": as_promql(q)}
               for i, q in enumerate(queries)]
    path = tmp_path / "dashboard_queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    return run(promtool, "check", "rules", str(path))


def test_every_dashboard_query_parses(promtool: Path, tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    result = check_queries(promtool, queries, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_a_broken_query_does_not_parse(promtool: Path, tmp_path: Path) -> None:
    result = check_queries(promtool, ["sum by (phase (sglang:num_queue_reqs)"], tmp_path)
    assert result.returncode != 0 and "parse error" in result.stdout + result.stderr


def test_the_dashboard_has_the_panels_and_variables_admins_need() -> None:
    model = dashboard.dashboard()
    names = [v["name"] for v in model["templating"]["list"]]
    assert names == ["datasource", "namespace", "deployment", "phase"]
    text = json.dumps(model)
    for metric in ("tessera_modeldeployment_ready_replicas", "sglang:token_usage",
                   "sglang:num_running_reqs", "sglang:num_queue_reqs",
                   "sglang:generation_tokens_total", "sglang:time_to_first_token_seconds_bucket",
                   "sglang:inter_token_latency_seconds_bucket",
                   "tessera_kv_integrity_checks_total",
                   "tessera_kv_integrity_mismatched_pages_total",
                   "tessera_operator_reconciles_total",
                   "tessera_operator_reconcile_seconds_bucket"):
        assert metric in text, metric
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))


# -- every metric named exists --

def exposed(name: str, kind: str) -> set[str]:
    """The sample names prometheus-client exposes for a metric of this kind."""
    if kind == "counter":
        return {name if name.endswith("_total") else f"{name}_total"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "summary":
        return {f"{name}_sum", f"{name}_count"}
    return {name}


@functools.cache
def sglang_metrics() -> frozenset[str]:
    """Every `sglang:` metric SGLang defines, read from its installed source: each
    Counter/Gauge/Histogram/Summary(name="sglang:...") call under sglang/srt."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.fail("SGLang is not installed: run scripts/setup.sh (it installs it --no-deps)")
    names: set[str] = set()
    for path in (Path(spec.origin).parent / "srt").rglob("*.py"):
        text = path.read_text(errors="replace")
        if '"sglang:' not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            callee = (node.func.id if isinstance(node.func, ast.Name)
                      else node.func.attr if isinstance(node.func, ast.Attribute) else "")
            kind = next((k for k in ("counter", "gauge", "histogram", "summary")
                         if k in callee.lower()), None)
            arg = next((k.value for k in node.keywords if k.arg == "name"), None)
            if kind and isinstance(arg, ast.Constant) and str(arg.value).startswith("sglang:"):
                names |= exposed(arg.value, kind)
    return frozenset(names)


def _samples(families: Iterable[Metric]) -> Iterator[str]:
    for family in families:
        yield from exposed(family.name, family.type)


@functools.cache
def our_metrics() -> frozenset[str]:
    """Every `tessera_` metric our code registers: the runtime's, the KV check's (both in
    registries of their own) and the operator's (in the process registry)."""
    from prometheus_client import REGISTRY
    from tessera.operator import metrics as _operator_metrics  # noqa: F401  (registers them)
    from tessera.runtime.integrity.metrics import IntegrityMetrics
    from tessera.runtime.metrics import RuntimeMetrics

    integrity = CollectorRegistry()
    IntegrityMetrics(registry=integrity)
    registries = (integrity, RuntimeMetrics().registry, REGISTRY)
    return frozenset(n for r in registries for n in _samples(r.collect())
                     if n.startswith("tessera_"))


def unknown_metrics(queries: Iterable[str]) -> list[tuple[str, str]]:
    known = sglang_metrics() | our_metrics()
    return [(name, q) for q in queries for name in METRIC.findall(q) if name not in known]


def test_sources_of_metric_names_are_read() -> None:
    assert {"sglang:token_usage", "sglang:num_queue_reqs",
            "sglang:time_to_first_token_seconds_bucket"} <= sglang_metrics()
    assert {"tessera_kv_integrity_aborted_requests_total", "tessera_operator_deployments",
            "tessera_modeldeployment_condition"} <= our_metrics()


def test_every_metric_the_dashboard_and_alerts_name_exists() -> None:
    queries = [*dashboard_queries(), *(r["expr"] for r in rules())]
    for q in queries:
        assert METRIC.search(q), f"a query that names no metric: {q}"
    assert not unknown_metrics(queries)


def test_a_misspelled_metric_is_caught() -> None:
    assert unknown_metrics(["sum(sglang:num_queued_reqs)", "tessera_kv_checks_total"]) == [
        ("sglang:num_queued_reqs", "sum(sglang:num_queued_reqs)"),
        ("tessera_kv_checks_total", "tessera_kv_checks_total")]


def test_operations_doc_lists_every_panel_and_alert_with_its_query() -> None:
    lines = OPERATIONS.read_text().splitlines()

    def row(start: str) -> str:
        found = [line for line in lines if line.startswith(start)]
        assert len(found) == 1, f"docs/operations.md needs one table row starting {start!r}"
        return found[0]

    # A `|` would split a table cell, even inside a code span.
    assert not [q for q in dashboard_queries() + [r["expr"] for r in rules()] if "|" in q]
    for panel in dashboard.panels():
        line = row(f"| {panel.title} |")
        for query in panel.queries:
            assert f"`{query.expr}`" in line, f"docs/operations.md: {panel.title} is stale"
    for rule in rules():
        line = row(f"| [{rule['alert']}](#{rule['alert'].lower()}) |")
        assert f"`{' '.join(rule['expr'].split())}`" in line, f"{rule['alert']} is stale"


# -- the chart ships them --

CHART = ROOT / "charts" / "tessera-operator"


def helm(*args: str) -> str:
    from tessera.devcluster.build import Binaries, cache_root
    binary = Binaries.in_cache(cache_root()).helm
    if not binary.is_file():
        pytest.fail(f"helm is not at {binary}: run scripts/setup.sh")
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def render(*args: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = helm("template", "tessera-operator", str(CHART), "-n", "tessera-system", *args)
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}


def test_alerts_and_dashboard_are_off_by_default() -> None:
    names = {name for _, name in render()}
    assert not names & {"tessera-operator-alerts", "tessera-operator-dashboard"}


def test_alerts_are_a_plain_rule_file_without_the_prometheus_operator() -> None:
    docs = render("--set", "alerts.enabled=true", "--set", "alerts.labels.team=llm")
    config = docs[("ConfigMap", "tessera-operator-alerts")]
    assert config["metadata"]["labels"]["team"] == "llm"
    assert yaml.safe_load(config["data"]["tessera-alerts.yaml"]) == \
        yaml.safe_load(ALERTS.read_text())


def test_alerts_are_a_prometheus_rule_where_its_crd_is_served() -> None:
    docs = render("--set", "alerts.enabled=true",
                  "--api-versions", "monitoring.coreos.com/v1/PrometheusRule")
    rule = docs[("PrometheusRule", "tessera-operator-alerts")]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    assert ("ConfigMap", "tessera-operator-alerts") not in docs


def test_dashboard_configmap_carries_the_sidecar_label_and_the_generated_json() -> None:
    docs = render("--set", "dashboard.enabled=true",
                  "--set", "dashboard.annotations.grafana_folder=LLM")
    config = docs[("ConfigMap", "tessera-operator-dashboard")]
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(config["data"]["tessera-modeldeployments.json"]) == dashboard.dashboard()


def test_service_monitor_keeps_the_deployments_namespace_label() -> None:
    docs = render("--set", "metrics.serviceMonitor.enabled=true")
    (endpoint,) = docs[("ServiceMonitor", "tessera-operator")]["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True


def test_helm_lint_strict_with_everything_on() -> None:
    out = helm("lint", "--strict", str(CHART), "--set", "alerts.enabled=true",
               "--set", "dashboard.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
               "--set", "metrics.podMonitor.enabled=true")
    assert "0 chart(s) failed" in out


def _selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    in_sets = all(labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]
                  if e["operator"] == "In")
    return in_sets and selector["matchLabels"].items() <= labels.items()


def test_pod_monitor_scrapes_the_engine_pods_the_operator_makes_with_their_labels() -> None:
    from tessera.operator import constants as c
    from tessera.operator.children import desired_children
    from tessera.operator.reconcile import plan_spec
    from tessera.operator.render import render_configs

    monitor = render("--set", "metrics.podMonitor.enabled=true")[
        ("PodMonitor", "tessera-operator-engines")]["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    # Prometheus turns a pod label into __meta_kubernetes_pod_label_<name, non-word chars as _>.
    def meta(label: str) -> str:
        return f"__meta_kubernetes_pod_label_{re.sub(r'[^A-Za-z0-9_]', '_', label)}"

    copied = {meta(c.LABEL_DEPLOYMENT): "deployment", meta(c.LABEL_PHASE): "phase"}
    assert {r["sourceLabels"][0]: r["targetLabel"] for r in endpoint["relabelings"]
            if "targetLabel" in r} == copied
    # LWS workers (index 1 and up) serve no metrics; leaders and one-node pods are kept.
    (drop,) = [r for r in endpoint["relabelings"] if r.get("action") == "drop"]
    assert drop["sourceLabels"] == [meta(c.LWS_LABEL_WORKER_INDEX)]
    dropped = re.compile(drop["regex"])
    assert [bool(dropped.fullmatch(v)) for v in ("", "0", "1", "3", "12")] == [
        False, False, True, True, True]
    assert monitor["namespaceSelector"] == {"any": True}

    md = yaml.safe_load((ROOT / "examples" / "01-kimi-k2" / "modeldeployment.yaml").read_text())
    md["metadata"].update(namespace="llm", uid="uid-1", generation=1)
    plan, error = plan_spec(md["spec"])
    assert error is None and plan is not None
    pods = {o["metadata"]["labels"][c.LABEL_PHASE]: o["spec"]["template"]
            for o in desired_children(md, render_configs(md, plan)) if o["kind"] == "Deployment"}
    assert set(pods) == {c.PREFILL, c.DECODE, c.ROUTER}
    for phase, pod in pods.items():
        selected = _selected(monitor["selector"], pod["metadata"]["labels"])
        assert selected == (phase != c.ROUTER), phase
        if selected:
            (container,) = pod["spec"]["containers"]
            assert endpoint["port"] in {p["name"] for p in container["ports"]}
