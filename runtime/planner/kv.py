"""KV-cache bytes per token per GPU, laid out as SGLang 0.5.23's KV pools store them.

Sources (sgl-project/sglang, python/sglang/srt/mem_cache/memory_pool.py and
model_executor/model_runner's profile_max_num_token "cell size"):
- GQA/MHA (MHATokenToKVPool): K and V, each kv_heads_per_rank x head_dim per layer; KV heads
  are split over the attention-TP ranks and replicated when there are fewer heads than ranks.
- MLA (MLATokenToKVPool): one latent of kv_lora_rank + qk_rope_head_dim per layer, the same on
  every attention-TP rank (it is not split by heads).
- FP8 e4m3 for GQA and MLA: one byte per element with a per-layer scalar scale, so no
  per-token scale bytes.
- DSA models (DeepSeek V3.2, GLM-5; the NSA pool): FP8 stores each token's latent as 656 bytes
  (512 e4m3 latent + 4 FP32 scales, one per 128 values, + 64 BF16 rope values). The indexer's
  keys are always FP8 with one FP32 scale per 128 values: index_head_dim + index_head_dim/128*4
  bytes per layer, whatever the KV dtype.

SGLang sizes the pool (model_runner_kv_cache_mixin.get_cell_size_per_token) with
(kv_lora_rank + qk_rope_head_dim) x element size + the indexer keys, so for an FP8 DSA pool it
counts 576-byte latents while storing 656-byte ones: `kv_sizing_bytes_per_token` is the cell it
divides the budget by, `kv_bytes_per_token_per_gpu` what each token really occupies.
"""

from __future__ import annotations

from tessera.runtime.planner.architecture import Architecture
from tessera.runtime.planner.errors import PlanError

KV_DTYPES = ("bf16", "fp8_e4m3")
_ELEMENT_BYTES = {"bf16": 2, "fp8_e4m3": 1}
FP8_SCALE_BLOCK = 128
FP8_SCALE_BYTES = 4
ROPE_BF16_BYTES = 2


def kv_bytes_per_token_per_gpu(arch: Architecture, kv_dtype: str, attention_tp: int) -> int:
    """Bytes one token's KV occupies on each GPU of an attention-TP group of `attention_tp`."""
    if kv_dtype not in _ELEMENT_BYTES:
        raise PlanError(f"kvCache.dtype {kv_dtype!r} is not one of {list(KV_DTYPES)}")
    element = _ELEMENT_BYTES[kv_dtype]
    layers = arch.num_hidden_layers
    if not arch.is_mla:
        heads_per_rank = -(-arch.kv_heads // attention_tp)
        return layers * 2 * heads_per_rank * arch.gqa_head_dim * element
    assert arch.kv_lora_rank is not None
    latent, rope = arch.kv_lora_rank, arch.qk_rope_head_dim
    if not arch.has_indexer:
        return layers * (latent + rope) * element
    if kv_dtype == "fp8_e4m3":
        scales = -(-latent // FP8_SCALE_BLOCK) * FP8_SCALE_BYTES
        per_layer = latent + scales + rope * ROPE_BF16_BYTES
    else:
        per_layer = (latent + rope) * element
    return layers * (per_layer + _index_key_bytes(arch))


def kv_sizing_bytes_per_token(arch: Architecture, kv_dtype: str, attention_tp: int) -> int:
    """The per-token cell SGLang divides the KV budget by to count tokens."""
    if not (arch.is_mla and arch.has_indexer and kv_dtype == "fp8_e4m3"):
        return kv_bytes_per_token_per_gpu(arch, kv_dtype, attention_tp)
    assert arch.kv_lora_rank is not None
    latent = (arch.kv_lora_rank + arch.qk_rope_head_dim) * _ELEMENT_BYTES[kv_dtype]
    return arch.num_hidden_layers * (latent + _index_key_bytes(arch))


def _index_key_bytes(arch: Architecture) -> int:
    """One token's indexer key in one layer: FP8 values plus an FP32 scale per 128."""
    return arch.index_head_dim + -(-arch.index_head_dim // FP8_SCALE_BLOCK) * FP8_SCALE_BYTES


# The prefill converts each chunk into the decode's layout in a staging buffer before sending
# (docs/kv-handover.md): one buffer per transfer worker, each one chunk of converted latents.
HANDOVER_CHUNK_TOKENS = 8192  # SGLang's chunked-prefill size on an H200: tokens per chunk sent
HANDOVER_TRANSFER_WORKERS = 4  # SGLang's transfer queues (SGLANG_DISAGGREGATION_QUEUE_SIZE)


def handover_staging_bytes_per_gpu(arch: Architecture, prefill_kv: str, decode_kv: str) -> int:
    """Staging memory a prefill GPU holds to convert its KV into the decode's dtype: none when
    the dtypes match (SGLang sends the pool's pages as they are). The indexer keys of a DSA
    model are the same bytes in both pools and go straight from the pool, so only the
    latents are staged."""
    if prefill_kv == decode_kv:
        return 0
    latents = kv_bytes_per_token_per_gpu(arch, decode_kv, attention_tp=1)
    if arch.has_indexer:
        latents -= arch.num_hidden_layers * _index_key_bytes(arch)
    return HANDOVER_TRANSFER_WORKERS * HANDOVER_CHUNK_TOKENS * latents
