"""Make SGLang run tessera's kernels: FP8/BF16 paged decode attention and INT4 W4A16 GEMM/MoE.

Applied inside every SGLang process by :func:`tessera.runtime.sglang_kernels.plugin.load`, the
entry point SGLang's general-plugin loader calls at each process start. Per kernel family the
runtime config's switch (``kernels.decode_attention``, ``kernels.w4a16``) selects tessera's kernel
or SGLang's own; calls and layers tessera cannot serve keep SGLang's kernel (logged once).
Before patching, the installed SGLang is checked against the pinned contract (signatures of every
SGLang callable the patches replace or call); a mismatch stops the start.
"""

from .contract import PINNED, Contract, ContractError, contract_problems, verify
from .plan import DECODE_ATTENTION, W4A16, KernelPlan, plan_kernels
from .plugin import apply, kernel_problem, load

__all__ = [
    "DECODE_ATTENTION",
    "PINNED",
    "W4A16",
    "Contract",
    "ContractError",
    "KernelPlan",
    "apply",
    "contract_problems",
    "kernel_problem",
    "load",
    "plan_kernels",
    "verify",
]
