"""The Grafana dashboard of tessera, as code: plain dicts in Grafana's dashboard JSON model.

`python -m tessera.dashboard` writes charts/tessera-operator/files/grafana-dashboard.json, which
the chart ships in a ConfigMap for Grafana's dashboard sidecar; `--check` fails when that file
is stale. The tests parse every query with promtool and check that every metric it names exists
(SGLang's in SGLang's source, ours in our code).

Labels it assumes (docs/operations.md, "Dashboard and alerts"): engine pods are scraped on their
`http` port with `namespace`, `deployment` and `phase` target labels from the pod's namespace
and its `tessera.dev/deployment` and `tessera.dev/phase` labels; the operator's
`tessera_modeldeployment_*` gauges carry the same three labels themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUTPUT = (Path(__file__).resolve().parents[1] / "charts" / "tessera-operator" / "files"
          / "grafana-dashboard.json")
UID = "tessera-modeldeployments"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The selector of every per-deployment query: the three template variables.
SELECTOR = 'namespace=~"$namespace", deployment=~"$deployment", phase=~"$phase"'
BY_PHASE = "namespace, deployment, phase"
LEGEND = "{{namespace}}/{{deployment}} {{phase}}"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = LEGEND


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"


def _rate(metric: str, selector: str = SELECTOR) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])" if selector else \
        f"rate({metric}[$__rate_interval])"


def _quantiles(metric: str, by: str, selector: str, legend: str) -> tuple[Query, ...]:
    """p50 and p95 of a Prometheus histogram."""
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({by + ', ' if by else ''}le) "
              f"({_rate(metric + '_bucket', selector)}))",
              f"p{round(q * 100)} {legend}")
        for q in (0.5, 0.95))


def _per_phase(aggregation: str, expr: str) -> str:
    return f"{aggregation} by ({BY_PHASE}) ({expr})"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Replicas", (
        Panel("Replicas ready / desired",
              "Ready and desired replicas per phase and the router (the operator's view of "
              "status).",
              (Query(_per_phase("sum", f"tessera_modeldeployment_ready_replicas{{{SELECTOR}}}"),
                     f"ready {LEGEND}"),
               Query(_per_phase("sum", f"tessera_modeldeployment_replicas{{{SELECTOR}}}"),
                     f"desired {LEGEND}"))),
    )),
    ("Engines (SGLang)", (
        Panel("KV cache usage",
              "Fraction of the KV cache in use, the fullest server of each phase "
              "(sglang:token_usage).",
              (Query(_per_phase("max", f"sglang:token_usage{{{SELECTOR}}}")),),
              unit="percentunit"),
        Panel("Running requests", "Requests in the running batch, summed over the phase's servers.",
              (Query(_per_phase("sum", f"sglang:num_running_reqs{{{SELECTOR}}}")),)),
        Panel("Queued requests", "Requests waiting in the servers' queues.",
              (Query(_per_phase("sum", f"sglang:num_queue_reqs{{{SELECTOR}}}")),)),
        Panel("Generation throughput", "Output tokens per second.",
              (Query(_per_phase("sum", _rate("sglang:generation_tokens_total"))),),
              unit="tokens/s"),
        Panel("Time to first token", "p50 and p95 of the time to the first output token.",
              _quantiles("sglang:time_to_first_token_seconds", BY_PHASE, SELECTOR, LEGEND),
              unit="s"),
        Panel("Inter-token latency", "p50 and p95 of the time between output tokens.",
              _quantiles("sglang:inter_token_latency_seconds", BY_PHASE, SELECTOR, LEGEND),
              unit="s"),
    )),
    ("KV integrity", (
        Panel("KV integrity checks",
              "Decode-batch requests whose KV pages were checked, per second.",
              (Query(_per_phase("sum", _rate("tessera_kv_integrity_checks_total"))),),
              unit="reqps"),
        Panel("KV integrity mismatches",
              "Mismatching KV pages found and requests aborted for them (any is a bug to report).",
              (Query(_per_phase("sum", f"increase(tessera_kv_integrity_mismatched_pages_total"
                                       f"{{{SELECTOR}}}[$__rate_interval])"),
                     f"pages {LEGEND}"),
               Query(_per_phase("sum", f"increase(tessera_kv_integrity_aborted_requests_total"
                                       f"{{{SELECTOR}}}[$__rate_interval])"),
                     f"aborted requests {LEGEND}"))),
    )),
    ("Operator", (
        Panel("Reconcile rate", "Reconciles per second, by result (only the Lease holder's move).",
              (Query("sum by (result) (rate(tessera_operator_reconciles_total[$__rate_interval]))",
                     "{{result}}"),),
              unit="ops"),
        Panel("Reconcile errors", "Reconciles that ended in an error, per second.",
              (Query('sum(rate(tessera_operator_reconciles_total{result="error"}'
                     '[$__rate_interval]))', "errors"),),
              unit="ops"),
        Panel("Reconcile latency", "p50 and p95 of the time to decide and carry out a reconcile.",
              _quantiles("tessera_operator_reconcile_seconds", "", "", "reconcile"),
              unit="s"),
    )),
)

# Template variables: (name, label, query); each narrows the next.
VARIABLES = (
    ("namespace", "Namespace", "label_values(tessera_modeldeployment_replicas, namespace)"),
    ("deployment", "ModelDeployment",
     'label_values(tessera_modeldeployment_replicas{namespace=~"$namespace"}, deployment)'),
    ("phase", "Phase",
     'label_values(tessera_modeldeployment_replicas{namespace=~"$namespace", '
     'deployment=~"$deployment"}, phase)'),
)


def panels() -> list[Panel]:
    return [panel for _, row in ROWS for panel in row]


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": query, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"}, "sort": 1}


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title,
        "description": panel.description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q.expr,
                     "legendFormat": q.legend} for i, q in enumerate(panel.queries)],
    }


def dashboard() -> dict[str, Any]:
    """The dashboard JSON model: one row per area, two panels side by side."""
    out: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for title, row in ROWS:
        out.append({"id": next_id, "type": "row", "title": title, "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        for i, panel in enumerate(row):
            out.append(_panel(panel, next_id, 12 * (i % 2), y + 8 * (i // 2)))
            next_id += 1
        y += 8 * ((len(row) + 1) // 2)
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource",
                  "query": "prometheus", "current": {}}
    return {
        "uid": UID, "title": "tessera: ModelDeployments", "tags": ["tessera", "sglang"],
        "description": "Replicas, SGLang engines, KV integrity and the operator, per "
                       "ModelDeployment and phase. Generated by tessera.dashboard.",
        "editable": False, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timezone": "browser",
        "templating": {"list": [datasource, *(_variable(*v) for v in VARIABLES)]},
        "annotations": {"list": []}, "panels": out,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.dashboard",
                                     description="write the chart's Grafana dashboard JSON")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; fail when the chart's copy is stale")
    args = parser.parse_args(argv)
    wanted = render()
    if OUTPUT.is_file() and OUTPUT.read_text() == wanted:
        return 0
    if args.check:
        print(f"{OUTPUT} is stale: run python -m tessera.dashboard", file=sys.stderr)
        return 1
    OUTPUT.write_text(wanted)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
