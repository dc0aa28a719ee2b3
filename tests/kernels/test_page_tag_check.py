"""The Triton page-tag check against its torch reference: equal counts, bit for bit."""

from __future__ import annotations

import pytest
import torch
from tessera.kernels.page_tag_check import page_tag_check, page_tag_check_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(
    reqs: int, max_pages: int, page_size: int, num_pages: int, seed: int, faults: int
) -> tuple:
    """A consistent state (every request's row and expectations agree with the tags), then
    ``faults`` random corruptions of each kind; returns the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    rows = reqs + 3  # spare rows the batch does not use
    tags = torch.randint(0, 2**30, (num_pages + 1,), generator=g, dtype=torch.int32) * 2 + 1
    pages = torch.randint(1, num_pages + 1, (rows, max_pages), generator=g, dtype=torch.int32)
    expected_tags = tags[pages.long()].clone()
    offsets = torch.randint(0, page_size, (rows, max_pages), generator=g, dtype=torch.int32)
    page_table = torch.randint(0, 10**6, (rows, max_pages * page_size), generator=g)
    page_table = page_table.to(torch.int32)
    page_table[:, ::page_size] = pages * page_size + offsets  # any slot inside the page

    def pick() -> tuple[int, int]:
        return (
            int(torch.randint(0, rows, (1,), generator=g)),
            int(torch.randint(0, max_pages, (1,), generator=g)),
        )

    for _ in range(faults):
        r, j = pick()
        tags[pages[r, j].long()] += 2  # freed and re-allocated
        r, j = pick()
        page_table[r, j * page_size] = int(torch.randint(0, 10**6, (1,), generator=g))  # remapped
        r, j = pick()
        expected_tags[r, j] -= 1  # handed out while in use (even)
        r, j = pick()
        pages[r, j] = -int(torch.randint(1, 5, (1,), generator=g)) if j % 2 else num_pages + 7
        r, j = pick()
        page_table[r, j * page_size] = -1  # negative slot

    req_slots = torch.randperm(rows, generator=g)[:reqs]
    page_counts = torch.randint(-1, max_pages + 3, (reqs,), generator=g)
    args = (page_table, page_size, req_slots, page_counts, pages, expected_tags, tags)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize(
    "reqs,max_pages,page_size,faults",
    [(1, 1, 1, 0), (3, 5, 1, 2), (7, 37, 16, 6), (5, 1500, 4, 40), (16, 64, 64, 20)],
)
def test_kernel_matches_reference(reqs: int, max_pages: int, page_size: int, faults: int) -> None:
    args = make_case(
        reqs, max_pages, page_size, num_pages=997, seed=reqs * max_pages, faults=faults
    )
    got = page_tag_check(*args)
    want = page_tag_check_ref(*args)
    assert got.dtype == want.dtype == torch.int32
    assert torch.equal(got, want)
    if faults:
        assert want.sum() > 0  # the case does exercise the mismatch paths


def test_clean_state_has_no_mismatch() -> None:
    args = make_case(9, 300, 8, num_pages=500, seed=1, faults=0)
    assert page_tag_check(*args).sum() == 0
    assert page_tag_check_ref(*args).sum() == 0


def test_counts_each_bad_page_once() -> None:
    tags = torch.tensor([0, 1, 3, 5, 7], dtype=torch.int32)
    pages = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    page_table = (pages * 2).to(torch.int32).repeat_interleave(2, dim=1)
    expected = tags[pages.long()].clone()
    tags[2] += 2  # page 2 re-allocated
    page_table[0, 6] = 2  # position 3 remapped to page 1
    args = [page_table, 2, torch.tensor([0]), torch.tensor([4]), pages, expected, tags]
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    assert page_tag_check(*args).tolist() == [2]
    assert page_tag_check_ref(*args).tolist() == [2]


def test_empty_batch() -> None:
    args = list(make_case(2, 4, 2, num_pages=10, seed=0, faults=0))
    args[2] = args[2][:0]
    args[3] = args[3][:0]
    assert page_tag_check(*args).shape == (0,)


def test_bad_arguments_say_what_is_wrong() -> None:
    page_table, ps, slots, counts, pages, tags_exp, tags = make_case(2, 4, 2, 10, 0, 0)
    with pytest.raises(TypeError, match="int32"):
        page_tag_check(page_table, ps, slots, counts, pages, tags_exp.long(), tags)
    with pytest.raises(ValueError, match="do not fit"):
        page_tag_check(page_table[:, :4], ps, slots, counts, pages, tags_exp, tags)
    with pytest.raises(ValueError, match="same shape"):
        page_tag_check(page_table, ps, slots, counts, pages[:, :2], tags_exp, tags)
    with pytest.raises(ValueError, match="page_size"):
        page_tag_check(page_table, 0, slots, counts, pages, tags_exp, tags)
