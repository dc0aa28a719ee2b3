"""The L2 prefetch (``kernels/l2_prefetch.py``): its table of requests on the CPU, its build for
Hopper without a GPU (a bulk L2 prefetch per thread, nothing else to wait for), and on the GPU
a launch over tensors of awkward sizes that faults nowhere and changes nothing. Whether it
pays is a benchmark's question (``bench/decode_slice.py --l2-prefetch``), not a test's."""

import os
import subprocess
import sys

import pytest
import torch
from tessera.kernels.l2_prefetch import CHUNK, REQUESTS, L2Prefetch


def test_table_holds_each_tensor_rounded_to_whole_16_byte_units():
    a = torch.empty(1000, dtype=torch.uint8)  # 1000 -> 992 bytes
    b = torch.empty(3 * CHUNK * REQUESTS // 2 + 16, dtype=torch.int32)
    c = torch.empty(3, dtype=torch.uint8)  # under 16 bytes: nothing to ask
    p = L2Prefetch([a, b, c])
    assert p.table.tolist() == [[a.data_ptr(), 992], [b.data_ptr(), b.nbytes]]
    assert p.nbytes == 992 + b.nbytes
    assert p.grid == (2, 7)  # b's bytes take 6 programs' chunks and a seventh for its tail


def test_refuses_views_it_cannot_ask_for_in_one_range():
    with pytest.raises(ValueError, match="contiguous, 16-byte aligned"):
        L2Prefetch([torch.empty(64, 64).t()])
    with pytest.raises(ValueError, match="contiguous, 16-byte aligned"):
        L2Prefetch([torch.empty(64, dtype=torch.uint8)[1:]])


def test_builds_to_one_bulk_prefetch_a_thread_for_hopper():
    program = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from tessera.kernels.l2_prefetch import CHUNK, REQUESTS, _l2_prefetch_kernel as k\n"
        "src = ASTSource(k, {'table_ptr': '*i64', 'CHUNK': 'constexpr', 'REQUESTS': "
        "'constexpr'}, constexprs={'CHUNK': CHUNK, 'REQUESTS': REQUESTS})\n"
        "built = triton.compile(src, target=GPUTarget('cuda', 90, 32), options={'num_warps': 4})\n"
        "print(built.asm['ptx'].count('cp.async.bulk.prefetch.L2.global'), built.metadata.shared)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    prefetches, shared = map(int, done.stdout.split()[-2:])
    assert REQUESTS == 4 * 32  # four warps: each thread issues one request
    assert (prefetches, shared) == (1, 0)


@pytest.mark.gpu
def test_prefetch_faults_nowhere_and_changes_nothing():
    torch.manual_seed(0)
    tensors = [torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
               for n in (7, 4, 1000, CHUNK * REQUESTS // 4 + 12, 3 * 2**20 + 4)]  # fmt: skip
    tensors.append(torch.randn(2112, 224, device="cuda").to(torch.bfloat16))
    before = [t.clone() for t in tensors]
    p = L2Prefetch(tensors)
    for _ in range(3):
        p.prefetch()
    torch.cuda.synchronize()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
