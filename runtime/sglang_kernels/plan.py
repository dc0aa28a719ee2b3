"""Which kernel family tessera patches into SGLang for one phase, decided from its config alone.

Per family the config switch says "tessera" or "sglang"; "tessera" takes effect only where tessera
has a kernel for the phase's dtypes. Every CRD combination has an answer here, with the reason,
so a switch that does nothing says so in the log instead of silently doing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.runtime.config import RuntimeConfig

DECODE_ATTENTION = "decode_attention"
W4A16 = "w4a16"
FAMILIES = (DECODE_ATTENTION, W4A16)


@dataclass(frozen=True)
class FamilyPlan:
    family: str
    patch: bool  # True: tessera's kernel is installed for this family
    reason: str


@dataclass(frozen=True)
class KernelPlan:
    families: tuple[FamilyPlan, ...]

    @property
    def patched(self) -> frozenset[str]:
        return frozenset(f.family for f in self.families if f.patch)

    def lines(self) -> list[str]:
        return [
            f"{f.family}: {'tessera' if f.patch else 'sglang'} ({f.reason})" for f in self.families
        ]


def plan_decode_attention(switch: str, kv_dtype: str) -> FamilyPlan:
    if switch == "flashmla":
        return FamilyPlan(DECODE_ATTENTION, False,
                          "SGLang's FlashMLA backend (--decode-attention-backend flashmla)")
    if switch != "tessera":
        return FamilyPlan(DECODE_ATTENTION, False, "switch set to sglang")
    # Both CRD KV dtypes (bf16, fp8_e4m3) have a tessera paged decode kernel.
    return FamilyPlan(
        DECODE_ATTENTION,
        True,
        f"{kv_dtype} KV: SGLang's Triton decode attention routed to tessera's paged decode "
        "(needs --decode-attention-backend triton)",
    )


def plan_w4a16(switch: str, weights_dtype: str, weights_format: str,
               expert_parallel: int) -> FamilyPlan:
    if switch != "tessera":
        return FamilyPlan(W4A16, False, "switch set to sglang")
    if weights_dtype != "int4":
        return FamilyPlan(
            W4A16, False, f"no-op: tessera has no kernel for {weights_dtype} weights, SGLang's run"
        )
    if weights_format != "compressed-tensors":
        return FamilyPlan(
            W4A16,
            False,
            f"no-op: int4 weights in {weights_format} format load through SGLang's Marlin path, "
            "which tessera does not adapt; use compressed-tensors pack-quantized checkpoints",
        )
    if expert_parallel > 1:  # the adapter serves local expert ids only (w4a16.moe_unsupported)
        return FamilyPlan(W4A16, True, "compressed-tensors W4A16 linear layers run tessera's INT4 "
                                       f"GEMM; MoE layers stay on SGLang's Marlin (expert "
                                       f"parallelism {expert_parallel})")
    return FamilyPlan(
        W4A16, True, "compressed-tensors W4A16 linear and MoE layers run tessera's INT4 kernels"
    )


def plan_kernels(config: RuntimeConfig) -> KernelPlan:
    switches = config.kernels
    return KernelPlan(
        (
            plan_decode_attention(switches.decode_attention, config.kv_cache.dtype),
            plan_w4a16(switches.w4a16, config.weights.dtype, config.weights.format,
                       config.parallel.expert),
        )
    )
