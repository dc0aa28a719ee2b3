"""The SGLang general plugin: installs the planned patches in each SGLang process.

SGLang 0.5.23 starts its schedulers (and tokenizer, detokenizer) with the ``spawn`` method, so
patches made in the launching process would not reach them. Instead SGLang calls every entry
point of the ``sglang.srt.plugins`` group early in each of its processes (``load_plugins()``);
tessera registers :func:`load` there. It reads the phase's runtime config from
``$TESSERA_RUNTIME_CONFIG`` (which ``tessera-runtime serve`` sets for SGLang); without it, it
does nothing, so the plugin is inert in any other SGLang.

SGLang's loader logs and swallows exceptions from plugins, so a failed contract check leaves by
``SystemExit``, which it does not catch: the process (and with it the server) stops at start.
"""

from __future__ import annotations

import logging
import os

from tessera.runtime.config import ENV_CONFIG, RuntimeConfig

from .contract import PINNED, Contract, ContractError, verify
from .plan import DECODE_ATTENTION, W4A16, KernelPlan, plan_kernels

log = logging.getLogger("tessera.sglang_kernels")


def kernel_problem(config: RuntimeConfig, contract: Contract = PINNED) -> str | None:
    """Why the planned patches cannot be applied to the installed SGLang (None: they can).
    For ``tessera-runtime`` to check before it starts SGLang."""
    plan = plan_kernels(config)
    if not plan.patched:
        return None
    try:
        verify(contract.for_families(plan.patched))
    except ContractError as e:
        return str(e)
    return None


def apply(config: RuntimeConfig, contract: Contract = PINNED) -> KernelPlan:
    """Check the contract for the planned families, then patch them; returns the plan."""
    plan = plan_kernels(config)
    for line in plan.lines():
        log.info("kernels: %s", line)
    if plan.patched:
        verify(contract.for_families(plan.patched))
    # imported here: they pull in torch and the Triton kernels, which the check does not need
    if DECODE_ATTENTION in plan.patched:
        from . import decode_attention

        decode_attention.install()
    if W4A16 in plan.patched:
        from . import w4a16

        w4a16.install()
    return plan


def load(contract: Contract = PINNED) -> None:
    """SGLang's plugin entry point (SGLang calls it without arguments)."""
    path = os.environ.get(ENV_CONFIG)
    if not path:
        log.debug("$%s is not set: tessera's kernels are not installed", ENV_CONFIG)
        return
    try:
        apply(RuntimeConfig.from_file(path), contract)
    except ContractError as e:
        log.critical(str(e))
        raise SystemExit(str(e)) from e
