"""Who may take the leader Lease (pure part of leader election)."""

from __future__ import annotations

import datetime

import pytest
from tessera.operator.leader import may_take

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


@pytest.mark.parametrize("spec, expected", [
    ({}, True),  # never held
    ({"holderIdentity": "me", "renewTime": "2026-01-01T11:59:59.000000Z"}, True),  # ours
    ({"holderIdentity": "other", "renewTime": "2026-01-01T11:59:50.000000Z",
      "leaseDurationSeconds": 15}, False),  # held, 10 s ago
    ({"holderIdentity": "other", "renewTime": "2026-01-01T11:59:45.000000Z",
      "leaseDurationSeconds": 15}, True),  # expired just now
    ({"holderIdentity": "other", "renewTime": "2026-01-01T11:59:00.000000Z",
      "leaseDurationSeconds": 120}, False),  # the holder's own duration counts
    ({"holderIdentity": "", "renewTime": "2026-01-01T11:59:59.000000Z"}, True),  # released
], ids=["unheld", "ours", "held", "expired", "long-lease", "released"])
def test_may_take(spec: dict[str, object], expected: bool) -> None:
    assert may_take(spec, "me", NOW) is expected
