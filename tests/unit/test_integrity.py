"""The tracker's own rules, the no-op twin, the counters and the Event reporter (no SGLang)."""

from __future__ import annotations

import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from tessera.runtime.config import ENV_CONFIG, IntegrityConfig, ModelConfig, RuntimeConfig
from tessera.runtime.integrity import (
    IntegrityMetrics,
    MismatchReporter,
    NoopTracker,
    PageTagTracker,
    PodRef,
    TrackerShape,
    build_event,
)
from tessera.runtime.integrity.reporter import Burst
from tessera.runtime.integrity.sglang_adapter import mismatch_message, record_extend, record_write
from tessera.runtime.integrity.sglang_plugin import register, tracker_wanted

PS = 4


def tracker_with_two_requests() -> tuple[PageTagTracker, torch.Tensor]:
    """Rows 0 and 1 hold pages (1, 2) and (3,), written into an SGLang-style page table."""
    t = PageTagTracker(TrackerShape(num_pages=8, page_size=PS, req_slots=3, max_pages_per_req=4))
    table = torch.zeros(3, 4 * PS, dtype=torch.int32)
    a = torch.arange(1 * PS, 3 * PS)  # pages 1 and 2, eight tokens
    b = torch.arange(3 * PS, 3 * PS + 3)  # page 3, three tokens
    t.on_alloc(torch.cat([a, b]))
    for row, slots in ((0, a), (1, b)):
        table[row, : len(slots)] = slots.to(torch.int32)
        record_write(t, (row, slice(0, len(slots))), slots)
    return t, table


def bad(t: PageTagTracker, table: torch.Tensor) -> list[int]:
    return t.verify(table, torch.tensor([0, 1]), torch.tensor([8, 3])).tolist()


def test_fresh_allocations_verify_clean_and_tags_are_odd() -> None:
    t, table = tracker_with_two_requests()
    assert bad(t, table) == [0, 0]
    assert t.tags[1:4].tolist() == [1, 1, 1] and t.tags[4:].tolist() == [0] * 5


def test_free_then_reallocate_flags_the_old_holder_only() -> None:
    t, table = tracker_with_two_requests()
    t.on_free(torch.tensor([2]))
    assert bad(t, table) == [1, 0]
    t.on_alloc(torch.tensor([2 * PS]))  # handed to row 2
    record_write(t, (2, slice(0, 1)), torch.tensor([2 * PS]))
    table[2, 0] = 2 * PS
    assert bad(t, table) == [1, 0]
    assert t.verify(table, torch.tensor([2]), torch.tensor([1])).tolist() == [0]


def test_decode_write_records_only_new_pages() -> None:
    t, table = tracker_with_two_requests()
    # Row 1 grows from 3 to 5 tokens: slot 15 fills page 3, slot 16 opens page 4.
    t.on_alloc(torch.tensor([3 * PS + 3]))
    record_write(t, (torch.tensor([1]), torch.tensor([3])), torch.tensor([3 * PS + 3]))
    t.on_alloc(torch.tensor([4 * PS]))
    record_write(t, (torch.tensor([1]), torch.tensor([4])), torch.tensor([4 * PS]))
    table[1, 3:5] = torch.tensor([3 * PS + 3, 4 * PS], dtype=torch.int32)
    assert t.verify(table, torch.tensor([0, 1]), torch.tensor([8, 5])).tolist() == [0, 0]
    assert t.expected_pages[1, :2].tolist() == [3, 4]


def test_page_handed_out_twice_in_one_call_is_caught() -> None:
    t = PageTagTracker(TrackerShape(num_pages=4, page_size=1, req_slots=2, max_pages_per_req=2))
    t.on_alloc(torch.tensor([2, 2]))
    record_write(t, (0, slice(0, 1)), torch.tensor([2]))
    record_write(t, (1, slice(0, 1)), torch.tensor([2]))
    table = torch.tensor([[2, 0], [2, 0]], dtype=torch.int32)
    assert t.verify(table, torch.tensor([0, 1]), torch.tensor([1, 1])).tolist() == [1, 1]


def test_bad_shapes_and_writes_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        TrackerShape(num_pages=4, page_size=0, req_slots=1, max_pages_per_req=1)
    t, _ = tracker_with_two_requests()
    with pytest.raises(ValueError, match="one row, position and slot per token"):
        t.record(torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([4, 5]))
    with pytest.raises(TypeError, match="unsupported indices"):
        record_write(t, 0, torch.tensor([4]))


def test_noop_tracker_holds_no_tensors() -> None:
    noop = NoopTracker()
    assert not noop.enabled and vars(noop) == {}
    noop.on_alloc(torch.arange(4))
    noop.on_free(torch.arange(2))
    noop.record(torch.zeros(1), torch.zeros(1), torch.zeros(1))


def test_metrics_count_checks_mismatches_aborts_and_pages() -> None:
    registry = CollectorRegistry()
    m = IntegrityMetrics(registry)
    m.pages_tracked(4096)
    m.checked(64)
    m.mismatched(requests=2, pages=5)

    def value(name: str) -> float | None:
        return registry.get_sample_value(name)

    assert value("tessera_kv_integrity_checks_total") == 64
    assert value("tessera_kv_integrity_aborted_requests_total") == 2
    assert value("tessera_kv_integrity_mismatched_pages_total") == 5
    assert value("tessera_kv_integrity_pages_tracked") == 4096


def test_abort_message_tells_the_client_what_happened() -> None:
    msg = mismatch_message("req-7", 3)
    assert "req-7" in msg and "3 of its KV pages" in msg and "retrying it is safe" in msg


# -- the Event reporter --------------------------------------------------------------------

POD = PodRef("kimi-decode-0", "llm", "0b7c-uid")


def test_pod_identity_comes_from_the_downward_api() -> None:
    env = {"POD_NAME": "p", "POD_NAMESPACE": "ns", "POD_UID": "u"}
    assert PodRef.from_env(env) == PodRef("p", "ns", "u")
    with pytest.raises(ValueError, match="POD_UID.*downward API"):
        PodRef.from_env({"POD_NAME": "p", "POD_NAMESPACE": "ns"})


def test_event_names_the_pod_deployment_and_counts() -> None:
    t0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
    burst = Burst(1, 2, 5, t0, t0).add(requests=1, pages=1, at=t0.replace(second=9))
    event = build_event(POD, "kimi", burst)
    assert event["type"] == "Warning" and event["reason"] == "KVIntegrityMismatch"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "kimi-decode-0",
        "namespace": "llm",
        "uid": "0b7c-uid",
    }
    assert event["metadata"]["labels"] == {"tessera.dev/deployment": "kimi"}
    assert event["metadata"]["namespace"] == "llm" and event["count"] == 2
    assert event["firstTimestamp"] == "2026-11-29T12:00:00Z"
    assert event["lastTimestamp"] == "2026-11-29T12:00:09Z"
    assert "aborted 3 request(s)" in event["message"] and "6 KV page(s)" in event["message"]


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.posted = threading.Event()

    def __call__(self, event: dict) -> None:
        self.events.append(event)
        self.posted.set()


def test_a_burst_is_one_event_then_the_rest_after_the_interval() -> None:
    rec = Recorder()
    reporter = MismatchReporter(POD, "kimi", rec, min_interval_s=0.5)
    reporter.mismatch(requests=1, pages=1)
    assert rec.posted.wait(5)
    start = time.monotonic()
    for _ in range(20):  # inside the interval: merged, not posted
        reporter.mismatch(requests=1, pages=2)
    time.sleep(0.1)
    assert len(rec.events) == 1
    while len(rec.events) < 2 and time.monotonic() - start < 5:
        time.sleep(0.02)
    assert len(rec.events) == 2 and time.monotonic() - start >= 0.45
    assert rec.events[1]["count"] == 20 and "aborted 20 request(s)" in rec.events[1]["message"]
    reporter.close()
    assert len(rec.events) == 2  # nothing pending, nothing more posted


def test_close_posts_what_is_pending_and_post_failures_are_contained() -> None:
    calls = []

    def failing(event: dict) -> None:
        calls.append(event)
        raise RuntimeError("API server unreachable")

    reporter = MismatchReporter(POD, "kimi", failing, min_interval_s=60)
    reporter.mismatch(requests=1, pages=1)
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.02)
    reporter.mismatch(requests=4, pages=4)  # held back by the interval ...
    reporter.close()  # ... and posted on close
    assert [e["count"] for e in calls] == [1, 1] and "aborted 4" in calls[1]["message"]
    with pytest.raises(ValueError, match="min_interval_s"):
        MismatchReporter(POD, "kimi", failing, min_interval_s=0)


def test_extend_batch_records_what_row_writes_would() -> None:
    """record_extend (SGLang's batched extend writer) == the per-request writes it replaces."""
    shape = TrackerShape(num_pages=16, page_size=PS, req_slots=4, max_pages_per_req=4)
    by_batch, by_rows = PageTagTracker(shape), PageTagTracker(shape)
    prefix = [torch.arange(1 * PS, 2 * PS), torch.arange(0)]  # row 2 reuses page 1 from the cache
    out = torch.cat([torch.arange(5 * PS, 5 * PS + 3), torch.arange(7 * PS, 8 * PS + 2)])
    rows, prefix_lens, seq_lens = torch.tensor([2, 3]), torch.tensor([PS, 0]), torch.tensor([7, 6])
    for t in (by_batch, by_rows):
        t.on_alloc(torch.cat([prefix[0], out]))
    record_extend(by_batch, rows, prefix_lens, seq_lens, prefix, out)
    record_write(by_rows, (2, slice(0, PS)), prefix[0])
    record_write(by_rows, (2, slice(PS, 7)), out[:3])
    record_write(by_rows, (3, slice(0, 6)), out[3:])
    assert torch.equal(by_batch.expected_pages[:-1], by_rows.expected_pages[:-1])
    assert torch.equal(by_batch.expected_tags[:-1], by_rows.expected_tags[:-1])
    assert by_batch.expected_pages[2, :2].tolist() == [1, 5]
    assert by_batch.expected_pages[3, :2].tolist() == [7, 8]


# -- the SGLang plugin's decision ------------------------------------------------------------


def runtime_config(phase: str, enabled: bool) -> RuntimeConfig:
    return RuntimeConfig(
        deployment="kimi",
        namespace="llm",
        phase=phase,
        model=ModelConfig(name="moonshotai/Kimi-K2", path="/models/kimi", context_length=8192),
        integrity=IntegrityConfig(enabled=enabled),
    )


@pytest.mark.parametrize(
    "phase,enabled,wanted",
    [
        ("decode", True, True),
        ("single", True, True),
        ("prefill", True, False),
        ("decode", False, False),
    ],
)
def test_tracker_runs_where_decode_runs_and_only_when_enabled(
    phase: str, enabled: bool, wanted: bool
) -> None:
    assert tracker_wanted(runtime_config(phase, enabled)) is wanted


def test_plugin_installs_nothing_when_off(tmp_path: Path) -> None:
    config = tmp_path / "runtime.json"
    config.write_text(runtime_config("decode", enabled=False).to_json())
    register(env={})  # SGLang run without tessera
    register(env={ENV_CONFIG: str(config)})
    config.write_text(runtime_config("prefill", enabled=True).to_json())
    register(env={ENV_CONFIG: str(config)})
    scheduler = sys.modules.get("sglang.srt.managers.scheduler")  # nothing was patched
    assert scheduler is None or scheduler.Scheduler.__init__.__name__ != "init_with_integrity"
