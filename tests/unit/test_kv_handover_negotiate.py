"""Pairing a prefill's KV entries with a decode peer's registration (pure)."""

from __future__ import annotations

import pytest
from tessera.kernels.mla_kv_handover import MLAKVLayout
from tessera.runtime.kv_handover.negotiate import (
    HandoverRefused,
    own_layout,
    plan_for_peer,
    staging_bytes,
)

PAGE = 64
BF16, FP8, DSA_FP8 = 1152 * PAGE, 576 * PAGE, 656 * PAGE


@pytest.mark.parametrize(
    "dtype,token_bytes,dsa,expected",
    [
        ("bf16", 1152, False, MLAKVLayout("bf16", 576, 0)),
        ("auto", 1152, True, MLAKVLayout("bf16", 512, 64)),
        ("fp8_e4m3", 576, False, MLAKVLayout("fp8_e4m3", 576, 0)),
        ("fp8_e4m3", 656, True, MLAKVLayout("fp8_e4m3_dsa", 512, 64)),
    ],
)
def test_own_layout(dtype: str, token_bytes: int, dsa: bool, expected: MLAKVLayout) -> None:
    assert own_layout(dtype, token_bytes, dsa) == expected


@pytest.mark.parametrize(
    "dtype,mine,theirs,dsa,converts,dst_kind",
    [
        ("bf16", BF16, FP8, False, True, "fp8_e4m3"),
        ("fp8_e4m3", FP8, BF16, False, True, "bf16"),
        ("bf16", BF16, BF16, False, False, "bf16"),
        ("fp8_e4m3", FP8, FP8, False, False, "fp8_e4m3"),
        ("bf16", BF16, DSA_FP8, True, True, "fp8_e4m3_dsa"),
        ("fp8_e4m3", DSA_FP8, BF16, True, True, "bf16"),
    ],
)
def test_every_pairing_of_bf16_and_fp8_has_a_plan(
    dtype: str, mine: int, theirs: int, dsa: bool, converts: bool, dst_kind: str
) -> None:
    plan = plan_for_peer(
        kv_cache_dtype=dtype, item_lens=[mine] * 3, page_size=PAGE, dsa=dsa,
        peer_item_lens=[theirs] * 3, peer="10.0.0.2:17000",
    )
    assert plan.converts is converts
    assert {d.kind for d in plan.dst} == {dst_kind}


@pytest.mark.parametrize(
    "peer_lens,match",
    [
        ([FP8 // 2] * 3, r"decode 10.0.0.2:17000 KV entry 0 holds 288 B/token; this prefill "
                         r"\(bf16\[576\+0\] \(1152 B/token\)\) can hand over only to"),
        ([FP8] * 2, "registered 2 KV entries, this prefill has 3"),
        ([FP8 + 3] * 3, "no whole number of this prefill's 64-token pages"),
        ([DSA_FP8] * 3, "656 B/token"),  # a DSA decode for an MLA prefill: not the same model
    ],
)
def test_a_pairing_that_cannot_work_names_both_sides(peer_lens: list[int], match: str) -> None:
    with pytest.raises(HandoverRefused, match=match):
        plan_for_peer(
            kv_cache_dtype="bf16", item_lens=[BF16] * 3, page_size=PAGE, dsa=False,
            peer_item_lens=peer_lens, peer="10.0.0.2:17000",
        )


def test_a_decode_that_registers_one_item_length_pairs_every_layer_with_it() -> None:
    """SGLang's decode sends ``dst_kv_item_lens`` per entry, or only ``dst_kv_item_len``: the
    plugin passes that one length, which then holds for every layer."""
    plan = plan_for_peer(
        kv_cache_dtype="bf16", item_lens=[BF16] * 61, page_size=PAGE, dsa=False,
        peer_item_lens=[FP8], peer="10.0.0.2:17000",
    )
    assert plan.converts and len(plan.dst) == 61
    assert {d.kind for d in plan.dst} == {"fp8_e4m3"}


def test_staging_holds_one_chunk_per_worker_in_the_largest_peer_layout() -> None:
    # A BF16 prefill converts only to FP8: 61 layers x 576 B x 8192 tokens per worker.
    assert staging_bytes(
        item_lens=[BF16] * 61, page_size=PAGE, kv_cache_dtype="bf16", dsa=False,
        chunk_tokens=8192, workers=4,
    ) == 4 * 61 * 576 * 8192
    assert staging_bytes(
        item_lens=[BF16] * 78, page_size=PAGE, kv_cache_dtype="bf16", dsa=True,
        chunk_tokens=8192, workers=1,
    ) == 78 * 656 * 8192
    # An FP8 prefill sends BF16 (twice its own bytes) to a BF16 decode.
    assert staging_bytes(
        item_lens=[FP8] * 61, page_size=PAGE, kv_cache_dtype="fp8_e4m3", dsa=False,
        chunk_tokens=100, workers=1,
    ) == 61 * 1152 * 128
