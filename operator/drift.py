"""Does an observed child still carry everything we want in it? (pure)

A resync must not write when nothing changed, and server-side apply is a write even when it
changes nothing; so the reconciler applies a child only when this says it differs. The API
server adds defaults and other managers add fields: those are allowed (a superset is fine).
A field we set and someone changed or removed is drift, and is restored.
"""

from __future__ import annotations

from typing import Any

# Kubernetes omits zero values (false, 0, "", empty lists and maps) from what it returns, so a
# desired zero value matches an absent field.
_ZERO: tuple[Any, ...] = (False, 0, "", [], {})


def contains(observed: Any, desired: Any) -> bool:
    """True when `observed` has every field of `desired` with the same value.

    Maps may have extra keys; lists must have the same length and match item by item (we own
    every list we set, e.g. containers, env, ports). A zero value matches an absent field.
    """
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(
            contains(observed[key], value) if key in observed else value in _ZERO
            for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(observed, list) and len(observed) == len(desired)
                and all(contains(o, d) for o, d in zip(observed, desired, strict=True)))
    return observed == desired


def needs_apply(desired: dict[str, Any], observed: dict[str, Any] | None) -> bool:
    """Whether `desired` must be (re)applied over what the cluster holds (None: absent)."""
    if observed is None or observed.get("metadata", {}).get("deletionTimestamp"):
        return True
    return not contains(observed, desired)
