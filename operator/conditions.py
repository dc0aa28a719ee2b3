"""Status conditions: build one, merge one into a list (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.operator import constants as c

Condition = dict[str, Any]

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

# The status of each condition type that is bad news; its transitions become Warning events.
_BAD = {c.READY: FALSE, c.PROGRESSING: None, c.DEGRADED: TRUE, c.PRECISION_VALID: FALSE,
        c.CAPACITY_PLANNED: FALSE, c.KV_INTEGRITY: FALSE, c.WEIGHTS_READY: FALSE}


def make_condition(type_: str, status: str, reason: str, message: str,
                   generation: int) -> Condition:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation}


def merge_conditions(old: Sequence[Condition], new: Sequence[Condition],
                     now: str) -> tuple[list[Condition], list[Condition]]:
    """The new conditions with lastTransitionTime carried over where the status did not change,
    and the conditions whose (status, reason) changed: the ones worth an event."""
    previous = {cond["type"]: cond for cond in old}
    merged: list[Condition] = []
    changed: list[Condition] = []
    for cond in new:
        before = previous.get(cond["type"])
        same_status = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime") if same_status and before else None
        merged.append({**cond, "lastTransitionTime": stamp or now})
        if before is None or not same_status or before.get("reason") != cond["reason"]:
            changed.append(cond)
    return merged, changed


def event_type(cond: Condition) -> str:
    return "Warning" if _BAD.get(cond["type"]) == cond["status"] else "Normal"
