"""Which layout a decode peer's KV pages have, and whether this prefill can hand over to it.

Both sides register their KV pool with the transfer engine as one buffer per layer and a
per-page byte length (``item_len``). The prefill knows its own layout from its KV dtype; a
peer's layout follows from the bytes per token it registered, since both serve the same model
(same latent and rope widths): for an MLA model BF16 is 2 bytes a value and FP8 one; for a DSA
model the FP8 pool is FlashMLA's packed layout (one fp32 scale per 128 values, BF16 rope).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tessera.kernels.mla_kv_handover import DSA_TILE, MLAKVLayout, convertible


class HandoverRefused(RuntimeError):
    """A prefill/decode pairing that cannot work; the message names both sides."""


def _dims_from_values(values: int, dsa: bool) -> tuple[int, int]:
    # DSA rows are 128-value tiles plus 0 or 64 rope values (SGLang's FlashMLA layout).
    if dsa:
        rope = values % DSA_TILE
        if rope not in (0, 64):
            raise HandoverRefused(f"a DSA KV row of {values} values is not tiles of {DSA_TILE}")
        return values - rope, rope
    return values, 0


def own_layout(kv_cache_dtype: str, token_bytes: int, dsa: bool) -> MLAKVLayout:
    """This pool's layout from SGLang's KV dtype string and its bytes per token."""
    if kv_cache_dtype.startswith("fp8"):
        if not dsa:
            return MLAKVLayout("fp8_e4m3", token_bytes, 0)
        for rope in (64, 0):  # 656 = 512 + 4*4 + 2*64
            nope = (token_bytes - 2 * rope) * DSA_TILE // (DSA_TILE + 4)
            layout = MLAKVLayout("fp8_e4m3_dsa", nope, rope) if nope % DSA_TILE == 0 else None
            if layout is not None and layout.token_bytes == token_bytes:
                return layout
        raise HandoverRefused(f"{token_bytes} B/token is no DSA FP8 row")
    if kv_cache_dtype in ("auto", "bf16", "bfloat16") and token_bytes % 2 == 0:
        return MLAKVLayout("bf16", *_dims_from_values(token_bytes // 2, dsa))
    raise HandoverRefused(
        f"KV dtype {kv_cache_dtype!r} at {token_bytes} B/token has no handover conversion"
    )


def peer_candidates(own: MLAKVLayout, dsa: bool) -> list[MLAKVLayout]:
    """The layouts a decode of the same model can have."""
    fp8 = "fp8_e4m3_dsa" if dsa else "fp8_e4m3"
    return [MLAKVLayout(kind, own.nope, own.rope) for kind in ("bf16", fp8)]


def _describe(layouts: Sequence[MLAKVLayout]) -> str:
    return ", ".join(str(x) for x in layouts)


@dataclasses.dataclass(frozen=True)
class HandoverPlan:
    """Per KV entry (layer), the prefill's layout and the peer's; ``converts`` if any differ."""

    src: tuple[MLAKVLayout, ...]
    dst: tuple[MLAKVLayout, ...]

    @property
    def converts(self) -> bool:
        return self.src != self.dst

    def __str__(self) -> str:
        return f"prefill {_describe(sorted(set(self.src), key=str))} -> decode " + _describe(
            sorted(set(self.dst), key=str)
        )


def plan_for_peer(
    *,
    kv_cache_dtype: str,
    item_lens: Sequence[int],
    page_size: int,
    dsa: bool,
    peer_item_lens: Sequence[int],
    peer: str,
) -> HandoverPlan:
    """Pair each of this prefill's KV entries with the peer's, or refuse naming both sides.

    ``item_lens`` and ``peer_item_lens`` are the per-entry page byte lengths both sides
    registered (SGLang's ``kv_item_lens``); a peer list of one length (a decode that sends
    only ``dst_kv_item_len``) means that length for every entry.
    """
    if len(peer_item_lens) not in (1, len(item_lens)):
        raise HandoverRefused(
            f"decode {peer} registered {len(peer_item_lens)} KV entries, this prefill has "
            f"{len(item_lens)}: the two pools are not the same model or pipeline stage"
        )
    src, dst = [], []
    for i, item_len in enumerate(item_lens):
        peer_len = peer_item_lens[i] if len(peer_item_lens) > 1 else peer_item_lens[0]
        mine = own_layout(kv_cache_dtype, item_len // page_size, dsa)
        if peer_len % page_size:
            raise HandoverRefused(
                f"decode {peer} KV page of {peer_len} B is no whole number of this prefill's "
                f"{page_size}-token pages: set the same page size on both pools"
            )
        theirs = [c for c in peer_candidates(mine, dsa) if c.token_bytes == peer_len // page_size]
        if not theirs or not convertible(mine, theirs[0]):
            raise HandoverRefused(
                f"decode {peer} KV entry {i} holds {peer_len // page_size} B/token; this "
                f"prefill ({mine}) can hand over only to "
                f"{_describe(peer_candidates(mine, dsa))}: is it the same model and page size?"
            )
        src.append(mine)
        dst.append(theirs[0])
    return HandoverPlan(tuple(src), tuple(dst))


def staging_bytes(
    *,
    item_lens: Sequence[int],
    page_size: int,
    kv_cache_dtype: str,
    dsa: bool,
    chunk_tokens: int,
    workers: int,
) -> int:
    """Staging a prefill rank needs to convert for any peer: one chunk per transfer worker,
    sized for the largest layout it converts to (a peer with its own layout needs none)."""
    pages = -(-chunk_tokens // page_size)
    per_page = 0
    for item_len in item_lens:
        mine = own_layout(kv_cache_dtype, item_len // page_size, dsa)
        others = [c.token_bytes for c in peer_candidates(mine, dsa) if c != mine]
        per_page += max(others) * page_size
    return workers * pages * per_page
