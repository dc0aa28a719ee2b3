"""Kernel tests: without a CUDA device, run Triton kernels under the interpreter.

This must happen before any Triton kernel is compiled, so it lives here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
