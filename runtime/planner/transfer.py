"""The prefill-to-decode KV handover's cost per request: bytes on the wire and the time they
take at the declared link speed (pure).

Each decode GPU receives its own share of each prompt token's KV, every layer, over its own
link (SGLang 0.5.23, disaggregation/common/conn.py: a decode rank pulls an MLA latent from one
prefill rank; GQA heads are split over the ranks), in the decode's layout: the prefill converts
its pages into the decode's KV dtype before sending (so an FP8 decode moves half the bytes of a
BF16 one), and a model with a sparse-attention indexer (DSA: GLM 5, DeepSeek V3.2) also sends
its FP8 indexer keys. That share is exactly what the token occupies on one decode GPU,
`kv_bytes_per_token_per_gpu` at the decode's attention TP; all links work in parallel, so it
sets the handover's time at one link's speed.

The planner has no model of prefill compute speed, so it does not say which is slower; it
gives the prompt tokens per second one link carries (a decode replica with attention data
parallel d takes d times that), to set beside the prefill pool's measured throughput (SGLang's
prompt-tokens metrics): when the pool produces more, the network caps prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.runtime.planner.architecture import Architecture
from tessera.runtime.planner.errors import PlanError
from tessera.runtime.planner.kv import KV_DTYPES, kv_bytes_per_token_per_gpu
from tessera.runtime.planner.plan import DeploymentPlan

DEFAULT_BACKEND = "mooncake"
DEFAULT_LINK_GBPS = 400  # one 400G NIC per GPU, the usual H200 node
# Prompt lengths `tessera plan` shows the handover at (plus the spec's context length).
TRANSFER_PROMPTS = (8192, 32768, 131072)


@dataclass(frozen=True)
class TransferPlan:
    """One KV pairing's handover: prefill KV dtype -> decode KV dtype over one link."""

    prefill_kv: str
    decode_kv: str
    backend: str
    link_gbps: float
    wire_bytes_per_token: int  # per link: what one decode GPU receives per prompt token

    def bytes_for(self, prompt_tokens: int) -> int:
        return self.wire_bytes_per_token * prompt_tokens

    def seconds_for(self, prompt_tokens: int) -> float:
        return self.bytes_for(prompt_tokens) * 8 / (self.link_gbps * 1e9)

    @property
    def tokens_per_second(self) -> float:
        """Prompt tokens per second whose KV one link can hand over."""
        return self.link_gbps * 1e9 / 8 / self.wire_bytes_per_token

    def to_dict(self, prompts: tuple[int, ...]) -> dict[str, Any]:
        return {
            "prefillKV": self.prefill_kv,
            "decodeKV": self.decode_kv,
            "backend": self.backend,
            "linkGbps": self.link_gbps,
            "wireBytesPerToken": self.wire_bytes_per_token,
            "promptTokensPerSecond": round(self.tokens_per_second),
            "perRequest": {str(n): {"bytes": self.bytes_for(n),
                                    "milliseconds": round(self.seconds_for(n) * 1e3, 3)}
                           for n in prompts},
        }


def wire_bytes_per_token(arch: Architecture, decode_kv: str, decode_attention_tp: int) -> int:
    """Bytes one prompt token's KV takes on one decode GPU's link, for a decode that stores
    `decode_kv` with `decode_attention_tp` attention-TP ranks."""
    return kv_bytes_per_token_per_gpu(arch, decode_kv, decode_attention_tp)


def plan_transfers(spec: Mapping[str, Any], plan: DeploymentPlan) -> list[TransferPlan]:
    """The handover of `spec`'s prefill KV dtype to each decode KV dtype, the spec's own
    pairing first; empty for a single pool (nothing is handed over)."""
    if "prefill" not in plan.phases or "decode" not in plan.phases:
        return []
    transfer = spec.get("transfer") or {}
    if not isinstance(transfer, Mapping):
        raise PlanError(f"spec.transfer must be a mapping, got {type(transfer).__name__}")
    link = transfer.get("linkGbps", DEFAULT_LINK_GBPS)
    if isinstance(link, bool) or not isinstance(link, int | float) or link <= 0:
        raise PlanError(f"spec.transfer.linkGbps must be a positive number, got {link!r}")
    backend = str(transfer.get("backend", DEFAULT_BACKEND))
    prefill, decode = plan.phases["prefill"].spec, plan.phases["decode"].spec
    pairings = [decode.kv_dtype] + [d for d in KV_DTYPES if d != decode.kv_dtype]
    return [TransferPlan(prefill.kv_dtype, d, backend, float(link),
                         wire_bytes_per_token(plan.architecture, d, decode.attention_tp))
            for d in pairings]


def transfer_prompts(context_length: int) -> tuple[int, ...]:
    """The prompt lengths to show: the fixed ones and the spec's context length."""
    return tuple(sorted({*TRANSFER_PROMPTS, context_length}))
