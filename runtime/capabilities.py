"""What this runtime can do, declared in one place so admission and preflight agree.

The planner reads these constants to decide which precision combinations it admits; a
feature is declared here only once the code behind it exists and is tested.
"""

from __future__ import annotations

# KV-cache dtype pairings the handover converts, as (prefill dtype, decode dtype): the prefill
# converts each chunk of MLA latents into the decode's layout before sending
# (tessera.runtime.kv_handover, docs/kv-handover.md). SGLang's own PD transfer copies raw page
# bytes, so any other pairing of different dtypes is refused.
KV_HANDOFF_CONVERSIONS: frozenset[tuple[str, str]] = frozenset(
    {("bf16", "fp8_e4m3"), ("fp8_e4m3", "bf16")})

# FP8 (e4m3) KV-cache kernels need native FP8 tensor support: Ada (8.9) and Hopper (9.0) up.
FP8_KV_MIN_COMPUTE_CAPABILITY: tuple[int, int] = (8, 9)
