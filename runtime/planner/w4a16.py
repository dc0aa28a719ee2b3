"""Which INT4 kernels a phase runs when its spec leaves `kernels.w4a16` unset.

The fastest measured set for the phase. The decode slice (docs/decode-slice.md, "INT4 weights
through our kernels or Marlin") ran one Kimi K2 and one GLM 5 decode GPU at TP 8 / EP 8 with
each set: tessera's dense INT4 GEMMs with SGLang's Marlin MoE for the experts was the fastest
at every concurrency but GLM 5's 64 requests (over FP8 weights at 64 requests: +30% and +19%,
against +18% and +5% with Marlin alone and +18% and +21% with tessera alone). `w4a16: tessera`
on a pool with expert parallelism is exactly that set: the adapter leaves expert-parallel MoE
layers to SGLang's Marlin (runtime/sglang_kernels/w4a16.py). Where nothing was measured
(prefill-sized GEMMs, MoE without expert parallelism, where tessera would also run the
experts) SGLang keeps Marlin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.runtime.config import KernelImpl
from tessera.runtime.planner.weights import Module

if TYPE_CHECKING:
    from tessera.runtime.planner.plan import PhaseSpec

# Modules SGLang runs through the compressed-tensors linear scheme (the embedding is a lookup,
# the routed experts the MoE scheme).
LINEAR_MODULES = frozenset({Module.ATTENTION, Module.DENSE_MLP, Module.SHARED_EXPERTS,
                            Module.LM_HEAD})


@dataclass(frozen=True)
class W4A16Choice:
    impl: KernelImpl
    reason: str


def choose_w4a16(phase: PhaseSpec) -> W4A16Choice:
    """The spec's choice if it made one, else the fastest measured for this phase."""
    if phase.w4a16 is not None:
        return W4A16Choice(phase.w4a16, "set in the spec")
    if phase.weights.dtype != "int4":
        return W4A16Choice("sglang", f"{phase.weights.dtype} weights: no tessera INT4 kernel")
    if phase.checkpoint_format != "compressed-tensors":
        return W4A16Choice("sglang", f"int4 in {phase.checkpoint_format}: SGLang's Marlin path")
    if not phase.weights.quantized & LINEAR_MODULES:
        return W4A16Choice("sglang", "no INT4 linear layers: the INT4 routed experts run "
                                     "SGLang's Marlin MoE")
    if phase.name != "decode":
        return W4A16Choice("sglang", f"a {phase.name} pool runs prefill-sized GEMMs, where "
                                     "Marlin measured faster; docs/sglang-kernels.md")
    if phase.expert_parallel == 1:
        return W4A16Choice("sglang", "no expert parallelism: tessera would also run the experts, "
                                     "where Marlin's MoE measured faster at most decode sizes")
    return W4A16Choice("tessera", "decode with expert parallelism: tessera's dense INT4 GEMMs, "
                                  "SGLang's Marlin MoE for the experts, the fastest set measured; "
                                  "docs/sglang-kernels.md")
