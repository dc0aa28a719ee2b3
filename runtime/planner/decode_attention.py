"""Which decode attention a phase runs when its spec leaves `kernels.decodeAttention` unset.

The fastest measured one for the phase's attention kind, KV dtype and query heads per GPU.
The table rests on docs/sglang-kernels.md ("Against FlashMLA"): tessera's MLA decode against
FlashMLA kernel to kernel on the H200 (bench/results/fp8_kv_flashmla.json), batch 1-256,
context 1k-32k and the decode slice's mixed lengths. FlashMLA was faster at every head count
and both KV dtypes; ours won only single requests of 4k-16k (BF16: 16 heads 1.10-1.19x, 64
heads 1.19-1.57x, 128 heads at 16k 1.22x) and 32 requests of 1k (16 heads, FP8, 1.01x), too
few to route a phase by. Both measured kernels beat SGLang's Triton MLA
decode; SGLang's Hopper default for MLA (FA3) was not measured, so where nothing was measured
SGLang keeps its own choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.runtime.config import FLASHMLA_PAGE_SIZE, DecodeAttentionImpl
from tessera.runtime.planner.architecture import Architecture

if TYPE_CHECKING:
    from tessera.runtime.planner.plan import PhaseSpec

# (KV dtype, query heads per GPU) -> the faster MLA decode, as measured.
MLA_DECODE_WINNER: dict[tuple[str, int], DecodeAttentionImpl] = {
    ("bf16", 8): "flashmla",
    ("fp8_e4m3", 8): "flashmla",
    ("bf16", 16): "flashmla",
    ("fp8_e4m3", 16): "flashmla",
    ("bf16", 64): "flashmla",
    ("fp8_e4m3", 64): "flashmla",
    ("bf16", 128): "flashmla",
    ("fp8_e4m3", 128): "flashmla",
}
MEASURED_MLA_HEADS = tuple(sorted({heads for _, heads in MLA_DECODE_WINNER}))


@dataclass(frozen=True)
class DecodeAttentionChoice:
    impl: DecodeAttentionImpl
    reason: str


def flashmla_problem(arch: Architecture, page_size: int) -> str | None:
    """Why SGLang's FlashMLA backend cannot serve this model and page size, or None."""
    if not arch.is_mla:
        return "FlashMLA is an MLA kernel and this model has GQA/MHA attention"
    if arch.has_indexer:
        return ("this model's sparse attention runs SGLang's dsa backend, which FlashMLA "
                "would replace with dense attention")
    if page_size != FLASHMLA_PAGE_SIZE:
        return (f"FlashMLA reads {FLASHMLA_PAGE_SIZE}-token pages and this phase has "
                f"{page_size} (kvCache.pageSize)")
    return None


def measured_heads(heads_per_gpu: int) -> int:
    """The measured head count that stands for `heads_per_gpu`: the next at or above it
    (a decode tile holds the heads that share a KV tile), else the largest."""
    return next((h for h in MEASURED_MLA_HEADS if h >= heads_per_gpu), MEASURED_MLA_HEADS[-1])


def choose_decode_attention(arch: Architecture, phase: PhaseSpec) -> DecodeAttentionChoice:
    """The spec's choice if it made one, else the fastest measured for this phase."""
    if phase.decode_attention is not None:
        return DecodeAttentionChoice(phase.decode_attention, "set in the spec")
    if phase.name == "prefill":
        return DecodeAttentionChoice("sglang", "a prefill pool does not decode")
    if not arch.is_mla:
        return DecodeAttentionChoice(
            "sglang", "GQA: SGLang's Hopper default (FA3) was not measured against tessera's")
    problem = flashmla_problem(arch, phase.page_size)
    if problem is not None:
        return DecodeAttentionChoice("sglang", f"SGLang's own, not FlashMLA: {problem}")
    heads = arch.num_attention_heads // phase.attention_tp
    measured = measured_heads(heads)
    return DecodeAttentionChoice(
        MLA_DECODE_WINNER[(phase.kv_dtype, measured)],
        f"fastest measured for MLA with {phase.kv_dtype} KV at {measured} query heads per GPU "
        f"(this phase runs {heads}); docs/sglang-kernels.md")
