"""What this runtime can do, declared in one place so admission and preflight agree.

The planner reads these constants to decide which precision combinations it admits; a
feature is declared here only once the code behind it exists and is tested.
"""

from __future__ import annotations

# KV-cache dtype conversions applied to pages when the decode pool receives them from the
# prefill pool, as (prefill dtype, decode dtype). SGLang's PD transfer copies raw page bytes,
# so a pairing of different dtypes without a conversion here corrupts output. Empty until the
# BF16 -> FP8 page conversion kernel is wired into the decode side.
KV_HANDOFF_CONVERSIONS: frozenset[tuple[str, str]] = frozenset()

# FP8 (e4m3) KV-cache kernels need native FP8 tensor support: Ada (8.9) and Hopper (9.0) up.
FP8_KV_MIN_COMPUTE_CAPABILITY: tuple[int, int] = (8, 9)
