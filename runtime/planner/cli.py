"""`tessera plan FILE.yaml`: the capacity plan of a ModelDeployment, precisions side by side."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from tessera.runtime.planner.decode_attention import choose_decode_attention
from tessera.runtime.planner.errors import PlanError
from tessera.runtime.planner.plan import (
    CAPACITY,
    PRECISION,
    TABLE_CONTEXTS,
    DeploymentPlan,
    PhasePlan,
    compare_precisions,
    plan_deployment,
)
from tessera.runtime.planner.transfer import TransferPlan, plan_transfers, transfer_prompts
from tessera.runtime.planner.w4a16 import choose_w4a16


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="print the capacity plan of a ModelDeployment, precisions side by side",
        description=__doc__)
    parser.add_argument("file", type=Path, help="a ModelDeployment manifest (YAML)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every phase plans cleanly, 1 on error findings, 2 on unusable input."""
    try:
        name, spec = load_spec(args.file)
        plan = plan_deployment(spec)
        variants = compare_precisions(spec)
        transfers = plan_transfers(spec, plan)
    except PlanError as e:
        print(f"tessera plan: {args.file}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(plan, variants, transfers), indent=2))
    else:
        print(render(name, spec, plan, variants, transfers))
    return 0 if plan.ok else 1


def load_spec(path: Path) -> tuple[str, dict[str, Any]]:
    """(name, spec) of the one ModelDeployment in the YAML file at `path`."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as e:
        raise PlanError(f"cannot read the file: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise PlanError(f"not valid YAML: {e}") from None
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == "ModelDeployment"]
    if len(found) != 1:
        raise PlanError(f"expected exactly one document of kind ModelDeployment, found "
                        f"{len(found)}")
    doc = found[0]
    if not isinstance(doc.get("spec"), dict):
        raise PlanError("the ModelDeployment has no spec mapping")
    return str((doc.get("metadata") or {}).get("name", "?")), doc["spec"]


def plan_json(plan: DeploymentPlan, variants: dict[str, list[PhasePlan]],
              transfers: Sequence[TransferPlan] = ()) -> dict[str, Any]:
    prompts = transfer_prompts(plan.context_length)
    return {
        "transfer": [t.to_dict(prompts) for t in transfers],
        "ok": plan.ok,
        "status": plan.to_status(),
        "conditions": [vars(plan.condition(c)) for c in (PRECISION, CAPACITY)],
        "findings": [vars(f) for f in plan.findings],
        "comparison": {phase: [p.to_status() for p in plans]
                       for phase, plans in variants.items()},
        "decodeAttention": {phase: vars(choose_decode_attention(plan.architecture, p.spec))
                            for phase, p in plan.phases.items()},
        "w4a16": {phase: vars(choose_w4a16(p.spec)) for phase, p in plan.phases.items()},
    }


_ROWS: tuple[tuple[str, Any], ...] = (
    ("memFractionStatic", lambda p: f"{p.mem_fraction_static:.3f}"),
    ("weights GiB/GPU", lambda p: f"{p.weights_bytes_per_gpu / 2**30:.1f}"),
    ("KV pool GiB/GPU", lambda p: f"{p.kv_pool_bytes_per_gpu / 2**30:.1f}"),
    ("KV bytes/token/GPU", lambda p: f"{p.kv_bytes_per_token_per_gpu:,}"),
    ("KV tokens/replica", lambda p: f"{p.kv_tokens_per_replica:,}"),
    *((f"requests @ {n // 1024}k", lambda p, n=n: f"{p.concurrency_at[n]:,}")
      for n in TABLE_CONTEXTS),
)


def render(name: str, spec: dict[str, Any], plan: DeploymentPlan,
           variants: dict[str, list[PhasePlan]],
           transfers: Sequence[TransferPlan] = ()) -> str:
    arch = spec["model"]["architecture"]
    gpu = (spec.get("nodePool") or {}).get("gpu") or {}
    lines = [f"{name}: {arch.get('preset') or 'custom architecture'}, context "
             f"{plan.context_length:,} tokens, {gpu.get('product', 'H200')} "
             f"{plan.gpu_memory_bytes / 2**30:g} GiB per GPU"]
    for phase, plans in variants.items():
        chosen = plan.phases[phase]
        s = chosen.spec
        over = f" over {s.nodes} nodes" if s.nodes > 1 else ""
        lines += ["", f"{phase}: {s.replicas} replica(s) x {s.tensor_parallel} GPUs{over} (EP "
                      f"{s.expert_parallel}, attention DP {s.attention_data_parallel}), page "
                      f"{s.page_size}; * = this spec"]
        headers = [_label(p, chosen) for p in plans]
        rows = [(label, [cell(p) for p in plans]) for label, cell in _ROWS]
        if plan.context_length not in TABLE_CONTEXTS:
            rows.append((f"requests @ {plan.context_length:,}",
                         [f"{p.max_concurrent_requests:,}" for p in plans]))
        lines += _table(headers, rows)
        attention = choose_decode_attention(plan.architecture, s)
        lines.append(f"decode attention {attention.impl}: {attention.reason}")
        w4a16 = choose_w4a16(s)
        lines.append(f"w4a16 {w4a16.impl}: {w4a16.reason}")
        if chosen.handover_staging_bytes_per_gpu:
            lines.append(f"handover staging {chosen.handover_staging_bytes_per_gpu / 2**30:.2f} "
                         "GiB/GPU: this prefill converts its KV into the decode's KV dtype")
    if transfers:
        lines += ["", *_transfer_table(transfers, plan.context_length)]
    lines.append("")
    for c in (PRECISION, CAPACITY):
        cond = plan.condition(c)
        lines.append(f"{c}: {cond.status} ({cond.reason}) {cond.message}")
    for f in plan.findings:
        lines.append(f"{f.severity}: {f.reason}: {f.message}")
    return "\n".join(lines)


def _table(headers: list[str], rows: list[tuple[str, list[str]]]) -> list[str]:
    width = max(len(label) for label, _ in rows)
    cols = [max(len(h), *(len(r[1][i]) for r in rows)) for i, h in enumerate(headers)]
    return [" " * width + "".join(f"  {h:>{w}}" for h, w in zip(headers, cols, strict=True)),
            *(f"{label:<{width}}" + "".join(f"  {v:>{w}}" for v, w in zip(values, cols,
                                                                         strict=True))
              for label, values in rows)]


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _transfer_table(transfers: Sequence[TransferPlan], context_length: int) -> list[str]:
    """The handover per request beside the capacity tables: bytes and time per prompt
    length, and the prompt tokens per second one link carries."""
    first = transfers[0]
    headers = [f"{'*' if i == 0 else ''}KV {_short(t.prefill_kv)} -> {_short(t.decode_kv)}"
               for i, t in enumerate(transfers)]
    rows: list[tuple[str, list[str]]] = [
        ("wire bytes/token", [f"{t.wire_bytes_per_token:,}" for t in transfers])]
    for n in transfer_prompts(context_length):
        rows.append((f"MB/request @ {_tokens(n)}",
                     [f"{t.bytes_for(n) / 1e6:,.1f}" for t in transfers]))
        rows.append((f"ms/request @ {_tokens(n)}",
                     [f"{t.seconds_for(n) * 1e3:,.2f}" for t in transfers]))
    rows.append(("prompt tokens/s/link", [f"{t.tokens_per_second:,.0f}" for t in transfers]))
    return [f"KV handover, prefill -> decode, per request: {first.backend} over "
            f"{first.link_gbps:g} Gb/s per decode GPU (spec.transfer.linkGbps), in the "
            "decode's KV dtype; * = this spec",
            *_table(headers, rows),
            "the network caps prefill when the prefill pool produces more prompt tokens/s "
            "than the links carry"]


def _short(kv: str) -> str:
    return "fp8" if kv == "fp8_e4m3" else kv


def _label(p: PhasePlan, chosen: PhasePlan) -> str:
    mark = "*" if (p.spec.weights.dtype, p.spec.kv_dtype) == (
        chosen.spec.weights.dtype, chosen.spec.kv_dtype) else ""
    kv = "fp8" if p.spec.kv_dtype == "fp8_e4m3" else p.spec.kv_dtype
    return f"{mark}W {p.spec.weights.dtype} / KV {kv}"
