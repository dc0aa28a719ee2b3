"""SGLang 0.5.23's GPU memory accounting, as pure functions.

How SGLang sizes the KV pool (sgl-project/sglang):
- `python/sglang/srt/arg_groups/memory_hook.py` (`handle_gpu_memory_settings`): from the GPU's
  memory it picks `chunked_prefill_size` and the decode CUDA-graph `max_bs`, then, unless
  `--mem-fraction-static` is given, reserves memory for activations and CUDA graphs and sets
  `mem_fraction_static = round((gpu_mem - reserved) / gpu_mem, 3)` (all in MiB):
      reserved = 512                                    # attention-backend metadata
               + 1.5 * activation_tokens                # activations
               + tp_size * pp_size / 8 * 1024           # large-TP slack
               + graph reserve (reserve_for_graph_mb)
      reserved = max(reserved, 10 GiB) when gpu_mem > 60 GiB
  activation_tokens is max(max_bs, 2048) for a disaggregated decode server and
  max(chunked_prefill_size, 2048) otherwise.
- graph reserve: 2 MiB per decode graph batch size up to max_bs (not on a prefill server);
  with attention data parallel another 3 MiB (4.5 MiB past max_bs 300) per batch x DP rank;
  the prefill graph (CUDA's default "breakable" backend; not on a decode server) adds 1.5 GiB
  for MLA models, else 8 MiB per captured prefill size
  (`cuda_graph_hook.generate_prefill_cuda_graph_batch_sizes`).
- `model_executor/model_runner_kv_cache_mixin.py` (`profile_max_num_token`): after the weights
  load, rest = free_after_load - free_before_load * (1 - mem_fraction_static), and the pool holds
  rest // cell_size tokens, rounded down to whole pages. With free_after_load =
  free_before_load - weights this is free_before_load * mem_fraction_static - weights.

Not modelled (a user who turns these on should set memFractionStatic): speculative decoding,
DeepEP all-to-all buffers, pipeline parallelism, post-capture KV sizing
(SGLANG_ENABLE_POST_CAPTURE_KV_SIZING, off by default and never used for MLA).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30

# GPU memory not free when the weights start to load, against the nominal `memoryGiB`; the
# same for every model. Measured on an H200 (nominal 141 GiB; driver 580, torch 2.11): CUDA
# reports 139.80 GiB total (nvidia-smi 143771 MiB), and the CUDA context plus cuBLAS hold
# 0.58 GiB more after the first matmul: 1.78 GiB. NCCL communicators (TP > 1) add an
# unmeasured amount, hence 2 GiB. SGLang measures the real value at start-up (its
# pre_model_load_memory).
UNUSABLE_BEFORE_LOAD_BYTES = 2 * GiB

SERVER_MODES = ("prefill", "decode", "single")

# (GPU memory below, MiB) -> (chunked_prefill_size, decode max_bs at TP < 4, at TP >= 4),
# the table in memory_hook.handle_gpu_memory_settings. The H200 falls in the < 160 GiB row.
_GPU_MEMORY_TIERS: tuple[tuple[float, int, int, int], ...] = (
    (20 * 1024, 2048, 8, 8),
    (35 * 1024, 4096, 48, 160),
    (60 * 1024, 4096, 32, 160),
    (90 * 1024, 8192, 256, 512),
    (160 * 1024, 8192, 256, 512),
    (float("inf"), 16384, 512, 512),
)


@dataclass(frozen=True)
class EngineDefaults:
    chunked_prefill_size: int
    decode_max_bs: int
    reserved_mib: float
    mem_fraction_static: float


def prefill_graph_sizes(max_bs: int) -> list[int]:
    """Token counts SGLang captures prefill CUDA graphs for, up to `max_bs`."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
             + list(range(4608, max_bs + 1, 512)))
    return [s for s in sizes if s <= max_bs]


def engine_defaults(gpu_memory_mib: float, tp: int, attention_dp: int, mode: str,
                    is_mla: bool) -> EngineDefaults:
    """SGLang's default chunked prefill, decode graph size and mem_fraction_static."""
    if mode not in SERVER_MODES:
        raise ValueError(f"server mode {mode!r} is not one of {SERVER_MODES}")
    chunked, small_tp_bs, large_tp_bs = next(
        (c, s, b) for limit, c, s, b in _GPU_MEMORY_TIERS if gpu_memory_mib < limit)
    max_bs = small_tp_bs if tp < 4 else large_tp_bs

    activation_tokens = max(max_bs if mode == "decode" else chunked, 2048)
    graph = 0.0
    if mode != "prefill":
        graph += max_bs * 2
        if attention_dp > 1:
            graph += max_bs * attention_dp * 3
            if max_bs > 300:
                graph += max_bs * attention_dp * 1.5
    if mode != "decode":
        # MLA backends: a flat 1.5 GiB; others: 8 MiB per captured size up to chunked prefill.
        graph += 1.5 * 1024 if is_mla else len(prefill_graph_sizes(chunked)) * 8
    reserved = 512 + activation_tokens * 1.5 + tp / 8 * 1024 + graph
    if gpu_memory_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = round((gpu_memory_mib - reserved) / gpu_memory_mib, 3)
    return EngineDefaults(chunked, max_bs, reserved, fraction)


def static_budget_bytes(gpu_memory_bytes: int, mem_fraction_static: float) -> int:
    """Bytes for weights plus KV pool on one GPU: SGLang's free memory before the weights
    load times mem_fraction_static."""
    return int((gpu_memory_bytes - UNUSABLE_BEFORE_LOAD_BYTES) * mem_fraction_static)


def pool_tokens(pool_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Tokens a pool of `pool_bytes` holds, in whole pages (never negative)."""
    if pool_bytes <= 0:
        return 0
    return pool_bytes // bytes_per_token // page_size * page_size
