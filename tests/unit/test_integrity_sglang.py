"""The tracker hooked into SGLang 0.5.23's real paged allocator and request-to-token pool (CPU).

A random workload admits, forks (shares a prefix, as the radix cache does), decodes and finishes
requests through SGLang's own classes, and injects the four faults: use-after-free, double
allocation, a stale page-table row and a corrupted tag. A model of the workload knows which
requests each fault touched; every check must flag exactly those (100% detection, no false
positives), and the flagged requests are aborted like the scheduler does.

CI runs 1e5 per-request operations (TESSERA_INTEGRITY_OPS overrides that for a quick local run);
`pytest -m slow` runs 1e6.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang 0.5.23 (pip install --no-deps, see scripts/)")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    rule,
    run_state_machine_as_test,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from tessera.runtime.integrity.sglang_adapter import (  # noqa: E402
    install_allocator_hooks,
    install_page_table_hooks,
    tracker_shape,
)
from tessera.runtime.integrity.tracker import TAG_MASK, PageTagTracker  # noqa: E402

PAGE_SIZE = 4
NUM_PAGES = 48
ROWS = 12
MAX_CONTEXT = 64


@dataclass
class Request:
    row: int
    seq_len: int
    pages: list[int]  # page per page position, as the request was handed them
    bad: bool = False  # a fault touched it: the next check must flag it
    shared_prefix: int = 0  # leading pages it shares with the request it was forked from
    lost: set[int] = field(default_factory=set)  # pages freed under it: no longer its to free


@dataclass
class World:
    """SGLang's allocator and page table with the tracker installed, and the model beside them."""

    allocator: PagedTokenToKVPoolAllocator
    pool: ReqToTokenPool
    tracker: PageTagTracker
    live: dict[int, Request] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)  # page -> holders
    next_id: int = 0
    # Per-request operations: one request's allocation, page-table write, check or free.
    ops: int = 0
    detected: int = 0
    faults: int = 0

    @classmethod
    def create(cls, need_sort: bool = False) -> World:
        allocator = PagedTokenToKVPoolAllocator(
            size=NUM_PAGES * PAGE_SIZE,
            page_size=PAGE_SIZE,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=None,
            need_sort=need_sort,
        )
        pool = ReqToTokenPool(
            size=ROWS, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
        )
        tracker = PageTagTracker(tracker_shape(allocator, pool))
        install_allocator_hooks(allocator, tracker)
        install_page_table_hooks(pool, tracker)
        return cls(allocator, pool, tracker)

    # -- the workload, through SGLang's API ---------------------------------------------------

    def admit(self, prompt_len: int, prefix: Request | None = None) -> Request | None:
        shared = [] if prefix is None else prefix.pages[: prefix.seq_len // PAGE_SIZE]
        if len(shared) * PAGE_SIZE + prompt_len > MAX_CONTEXT:
            return None
        rows = self.pool.alloc_rows(1)
        if rows is None:
            return None
        row = rows[0]
        start = len(shared) * PAGE_SIZE
        total = start + prompt_len
        last_loc = shared[-1] * PAGE_SIZE + PAGE_SIZE - 1 if shared else -1
        out = self.allocator.alloc_extend(
            prefix_lens=torch.tensor([start]),
            prefix_lens_cpu=torch.tensor([start]),
            seq_lens=torch.tensor([total]),
            seq_lens_cpu=torch.tensor([total]),
            last_loc=torch.tensor([last_loc]),
            extend_num_tokens=prompt_len,
        )
        self.ops += 1
        if out is None:
            self.pool.free_rows([row])
            return None
        if shared:  # the prefix cache hands the request its pages, as SGLang writes them
            slots = torch.tensor([p * PAGE_SIZE + k for p in shared for k in range(PAGE_SIZE)])
            self.pool.write((row, slice(0, start)), slots.to(torch.int32))
        self.pool.write((row, slice(start, total)), out.to(torch.int32))
        self.ops += 2
        new_pages = (out[::PAGE_SIZE] // PAGE_SIZE).tolist()  # starts on a page boundary
        req = Request(row, total, shared + new_pages, shared_prefix=len(shared))
        for page in req.pages:
            self.refs[page] = self.refs.get(page, 0) + 1
        self.live[self.next_id] = req
        self.next_id += 1
        return req

    def decode(self) -> None:
        """One scheduler step: check the batch, abort what it flags, allocate the next token."""
        self.check_and_abort()
        batch = [r for r in self.live.values() if r.seq_len < MAX_CONTEXT]
        if not batch:
            return
        rows = torch.tensor([r.row for r in batch])
        seq_lens = torch.tensor([r.seq_len + 1 for r in batch])
        last_loc = self.pool.req_to_token[rows, seq_lens - 2].long()
        out = self.allocator.alloc_decode(seq_lens, seq_lens.clone(), last_loc)
        self.ops += len(batch)
        if out is None:
            return
        self.pool.write((rows, seq_lens - 1), out.to(torch.int32))
        self.ops += len(batch)
        for req, slot in zip(batch, out.tolist(), strict=True):
            if slot % PAGE_SIZE == 0:
                req.pages.append(slot // PAGE_SIZE)
                self.refs[slot // PAGE_SIZE] = 1
            req.seq_len += 1

    def check_and_abort(self) -> None:
        ids = list(self.live)
        if not ids:
            return
        reqs = [self.live[i] for i in ids]
        counts = self.tracker.verify(
            self.pool.req_to_token,
            torch.tensor([r.row for r in reqs]),
            torch.tensor([r.seq_len for r in reqs]),
        )
        self.ops += len(reqs)
        flagged = [bool(n) for n in counts.tolist()]
        expected = [r.bad for r in reqs]
        assert flagged == expected, f"flagged {flagged}, expected {expected}"
        clean_pages = [p for r in reqs if not r.bad for p in r.pages]
        assert bool((self.tracker.tags[clean_pages] & 1).all()), "a page in use has an even tag"
        for i, bad in zip(ids, flagged, strict=True):
            if bad:
                self.detected += 1
                self.finish(i)

    def finish(self, rid: int) -> None:
        req = self.live.pop(rid)
        freed = []
        for page in req.pages:
            if page not in req.lost:
                self.refs[page] -= 1
                if self.refs[page] == 0:
                    del self.refs[page]
                    freed.append(page)
        if freed:
            grouped = rid % 3 == 0  # SGLang batches frees in groups at the end of a step
            if grouped:
                self.allocator.free_group_begin()
            self.allocator.free(torch.tensor([p * PAGE_SIZE for p in freed]))
            if grouped:
                self.allocator.free_group_end()
            self.ops += 1
        self.pool.free_rows([req.row])

    def holders(self, page: int) -> list[Request]:
        return [r for r in self.live.values() if page in r.pages]

    def untouched(self, page: int) -> bool:
        """No earlier fault touched this page (two faults on one page can cancel out)."""
        return not any(r.bad for r in self.holders(page))

    # -- faults -------------------------------------------------------------------------------

    def use_after_free(self, victim: Request, k: int) -> None:
        """A page is freed (and may be re-allocated to another request) while still in use."""
        page = victim.pages[k % len(victim.pages)]
        if not self.untouched(page):
            return
        for holder in self.holders(page):
            holder.bad = True
            holder.lost.add(page)
        del self.refs[page]
        self.allocator.free_page_ids(torch.tensor([page]))
        self.faults += 1

    def double_allocation(self, victim: Request, prompt_len: int) -> None:
        """The allocator hands a page out again while it is still in use."""
        page = victim.pages[-1]
        if not self.untouched(page):
            return
        self.allocator.free_pages = torch.cat((torch.tensor([page]), self.allocator.free_pages))
        self.faults += 1
        newcomer = self.admit(prompt_len)
        assert newcomer is not None and page in newcomer.pages
        for holder in self.holders(page):
            holder.bad = True

    def stale_row(self, victim: Request, k: int, other_page: int) -> None:
        """The request's page-table row points at a page it was not handed."""
        pos = k % len(victim.pages)
        if other_page == victim.pages[pos]:
            other_page = other_page % NUM_PAGES + 1
        self.pool.req_to_token[victim.row, pos * PAGE_SIZE] = other_page * PAGE_SIZE
        victim.bad = True
        self.faults += 1

    def corrupt_tag(self, victim: Request, k: int, bit: int) -> None:
        """One tag in the tag array flips a bit (not the lowest: that one is the page state)."""
        page = victim.pages[k % len(victim.pages)]
        if not self.untouched(page):
            return
        self.tracker.tags[page] ^= 1 << bit
        for holder in self.holders(page):
            holder.bad = True
        self.faults += 1


FAULTS = ("use_after_free", "double_allocation", "stale_row", "corrupt_tag")


class Workload(RuleBasedStateMachine):
    """Few draws per rule and many SGLang operations per draw: 1e5 operations fit in CI."""

    def __init__(self) -> None:
        super().__init__()
        self.world = World.create()

    def _clean(self, pick: int) -> Request | None:
        clean = [r for r in self.world.live.values() if not r.bad]
        return clean[pick % len(clean)] if clean else None

    @rule(prompt_len=st.integers(1, 24), forked=st.integers(0, 10**6))
    def admit(self, prompt_len: int, forked: int) -> None:
        prefix = self._clean(forked) if forked % 3 == 0 else None  # a third share a prefix
        self.world.admit(prompt_len, prefix=prefix)

    @rule(steps=st.integers(1, 12))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self.world.decode()

    @rule(pick=st.integers(0, 10**6))
    def finish(self, pick: int) -> None:
        req = self._clean(pick)
        if req is not None:
            self.world.finish(next(i for i, r in self.world.live.items() if r is req))

    @rule(fault=st.sampled_from(FAULTS), pick=st.integers(0, 10**6))
    def inject(self, fault: str, pick: int) -> None:
        victim = self._clean(pick)
        if victim is None:
            return
        k, other = pick % 16, pick % NUM_PAGES + 1
        w = self.world
        if fault == "use_after_free":
            w.use_after_free(victim, k)
        elif fault == "double_allocation":
            if len(w.allocator.free_pages) > 8 and w.pool.available_size() > 0:
                w.double_allocation(victim, prompt_len=k % 8 + 1)
        elif fault == "stale_row":
            w.stale_row(victim, k, other)
        else:
            w.corrupt_tag(victim, k, bit=pick % 30 + 1)

    def teardown(self) -> None:
        self.world.decode()  # a last check: every fault still pending is caught now
        assert not any(r.bad for r in self.world.live.values())
        for key in Workload.totals:
            Workload.totals[key] += getattr(self.world, key)

    totals = {"ops": 0, "faults": 0, "detected": 0}


def run_workload(min_ops: int, examples: int, steps: int) -> dict[str, int]:
    Workload.totals = {"ops": 0, "faults": 0, "detected": 0}
    while Workload.totals["ops"] < min_ops:
        run_state_machine_as_test(
            Workload,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                deadline=None,
                derandomize=False,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    return Workload.totals


def test_random_workload_detects_every_fault_and_nothing_else() -> None:
    ops = int(os.environ.get("TESSERA_INTEGRITY_OPS", 100_000))
    totals = run_workload(min_ops=ops, examples=100, steps=200)
    assert totals["ops"] >= ops
    # every fault flags at least one request that was clean, and each is aborted once
    assert totals["faults"] > 0 and totals["detected"] >= totals["faults"]


@pytest.mark.slow
def test_random_workload_one_million_operations(request: pytest.FixtureRequest) -> None:
    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("minutes of CPU: run it with pytest -m slow")
    totals = run_workload(min_ops=1_000_000, examples=500, steps=400)
    assert totals["ops"] >= 1_000_000


# -- targeted cases, each fault alone -------------------------------------------------------


@pytest.fixture
def world() -> World:
    w = World.create()
    for n in (9, 5, 14):
        assert w.admit(n) is not None
    for _ in range(3):
        w.decode()
    return w


def flagged(w: World) -> list[bool]:
    reqs = list(w.live.values())
    counts = w.tracker.verify(
        w.pool.req_to_token,
        torch.tensor([r.row for r in reqs]),
        torch.tensor([r.seq_len for r in reqs]),
    )
    return [bool(n) for n in counts.tolist()]


def test_clean_workload_flags_nothing(world: World) -> None:
    fork = world.admit(3, prefix=world.live[0])
    assert fork is not None and fork.shared_prefix == 3
    for _ in range(6):
        world.decode()
    assert flagged(world) == [False] * len(world.live)


def test_use_after_free_reallocated_to_another_request(world: World) -> None:
    victim = world.live[1]
    world.use_after_free(victim, k=0)
    thief = world.admit(4)  # LIFO free list: it receives the freed page
    assert thief is not None and victim.pages[0] in thief.pages
    assert flagged(world) == [False, True, False, False]


def test_double_allocation_flags_both_holders(world: World) -> None:
    world.double_allocation(world.live[2], prompt_len=2)
    assert flagged(world) == [False, False, True, True]


def test_stale_row_flags_only_its_request(world: World) -> None:
    world.stale_row(world.live[0], k=1, other_page=world.live[2].pages[0])
    assert flagged(world) == [True, False, False]


def test_corrupted_tag_flags_every_holder(world: World) -> None:
    fork = world.admit(2, prefix=world.live[2])
    assert fork is not None
    world.corrupt_tag(world.live[2], k=0, bit=random.randint(1, 30))
    assert flagged(world) == [False, False, True, True]


def test_need_sort_allocator_too() -> None:
    w = World.create(need_sort=True)
    a, b = w.admit(7), w.admit(6)
    assert a is not None and b is not None
    w.use_after_free(a, k=1)  # staged, not yet reused: the free alone changes the tag
    w.decode()  # checks first: the victim is flagged and aborted, the other is clean
    assert w.detected == 1 and list(w.live.values()) == [b]


def test_clear_frees_every_page(world: World) -> None:
    world.allocator.clear()
    in_use = torch.tensor(sorted(world.refs))
    assert not bool((world.tracker.tags[in_use] & 1).any())


def test_tags_wrap_around_and_keep_parity() -> None:
    w = World.create()
    w.tracker.tags.fill_(TAG_MASK - 3)  # even: every page free, three bumps from the wrap
    for _ in range(3):
        req = w.admit(PAGE_SIZE * 2)
        assert req is not None
        assert flagged(w) == [False]
        w.finish(next(iter(w.live)))
    assert int(w.tracker.tags.min()) >= 0
    wrapped = int((w.tracker.tags < TAG_MASK - 3).sum())
    assert wrapped >= 2  # the pages that went round are back at small even tags
    assert not bool((w.tracker.tags & 1).any())


def test_page_size_one_allocator() -> None:
    """SGLang's TokenToKVPoolAllocator (page size 1) frees in free() and in free groups."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    allocator = TokenToKVPoolAllocator(
        size=32, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
    )
    pool = ReqToTokenPool(size=2, max_context_len=8, device="cpu", enable_memory_saver=False)
    tracker = PageTagTracker(tracker_shape(allocator, pool))
    install_allocator_hooks(allocator, tracker)
    install_page_table_hooks(pool, tracker)
    rows, seq_lens = torch.tensor([1, 2]), torch.tensor([3, 3])
    for row in (1, 2):
        pool.write((row, slice(0, 3)), allocator.alloc(3).to(torch.int32))

    def flagged() -> list[int]:
        return tracker.verify(pool.req_to_token, rows, seq_lens).tolist()

    assert flagged() == [0, 0]
    allocator.free_group_begin()
    allocator.free(pool.req_to_token[2, 1:2].long())
    assert flagged() == [0, 0]  # held in the group, not free yet
    allocator.free_group_end()
    assert flagged() == [0, 1]
    allocator.free(pool.req_to_token[1, :1].long())
    assert flagged() == [1, 1]
