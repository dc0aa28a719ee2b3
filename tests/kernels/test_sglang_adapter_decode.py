"""SGLang's own ``decode_attention_fwd`` against the same call routed to tessera's kernel.

Both sides are the real functions: SGLang 0.5.23's Triton decode attention (its module
``sglang.kernels.ops.attention.decode_attention``) and the adapter's replacement of it, called
with the arguments SGLang's Triton backend passes (token-level kv_indptr/kv_indices over shuffled
slots, SGLang's split scratch, per-tensor scales, the page size). Tolerances from BENCHMARKS.md:
atol 1e-2 (plus 1e-2 relative, the bf16 rounding of the output) and rel-L2 <= 5e-3.

On CPU both run under the Triton interpreter. The interpreter stores bf16 as raw uint16 and its
``tl.dot`` multiplies those integers (garbage out), so SGLang's grouped-head kernel, which dots bf16
tiles, only runs after the interpreter's dot is taught to widen bf16 first
(``gpu_like_interpreter`` in conftest.py; a fix to Triton's interpreter,
SGLang's and tessera's kernels are untouched). SGLang's one-head-per-KV-head kernel
(``kv_group_num == 1``) multiplies bf16 element-wise, which the interpreter also does on the raw
integers, so MHA layouts are compared on the GPU only.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from tessera.kernels.paged_decode_bf16 import decode_attention_ref
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable
from tessera.runtime.sglang_kernels import decode_attention as adapter
from tessera.runtime.sglang_kernels.fallback import Fallbacks

sglang_decode = pytest.importorskip("sglang.kernels.ops.attention.decode_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL, REL_L2 = 1e-2, 5e-3


pytestmark = pytest.mark.usefixtures("gpu_like_interpreter")


@pytest.fixture(autouse=True)
def seeded(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def sglang_table(lens: list[int], page_size: int, spare_pages: int = 3):
    """Token-level kv_indptr/kv_indices over shuffled pages, as SGLang's Triton backend builds them
    (int32 indptr, int64 slots), plus the pool's slot count."""
    counts = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(counts) + spare_pages
    perm = torch.randperm(num_pages).tolist()
    slots, at = [], 0
    for n, c in zip(lens, counts, strict=True):
        pages = torch.tensor(perm[at : at + c], dtype=torch.int64)
        at += c
        pos = torch.arange(n)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
    indptr = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    indices = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    return indptr.to(DEVICE), indices.to(DEVICE), num_pages * page_size


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(FP8_DTYPE)


def call(
    fn,
    q,
    k,
    v,
    indptr,
    indices,
    sm_scale,
    k_scale,
    v_scale,
    page_size,
    *,
    splits=4,
    has_mla=False,
    logit_cap=0.0,
    sinks=None,
):
    batch, heads = q.shape[:2]
    dv = v.shape[-1]
    o = torch.full((batch, heads, dv), float("nan"), dtype=q.dtype, device=DEVICE)
    logits = torch.empty(batch, heads, splits, dv, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=DEVICE)
    num_kv_splits = torch.full((batch,), splits, dtype=torch.int32, device=DEVICE)
    fn(
        q,
        k,
        v,
        o,
        indptr,
        indices,
        logits,
        lse,
        num_kv_splits,
        splits,
        sm_scale,
        k_scale,
        v_scale,
        logit_cap=logit_cap,
        sinks=sinks,
        has_mla=has_mla,
        page_size=page_size,
    )
    return o


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.isfinite().all(), "unwritten or non-finite output"
    err = out.float() - ref.float()
    worst = (err.abs() - 1e-2 * ref.float().abs()).max()
    assert worst <= ATOL, f"max |err| - 1e-2 |ref| = {worst:.3g}"
    rel = err.norm() / ref.float().norm()
    assert rel <= REL_L2, f"rel-L2 {rel:.3g}"


def assert_fp8_level(out: torch.Tensor, other: torch.Tensor) -> None:
    a, b = out.float().flatten(), other.float().flatten()
    rel = (a - b).norm() / b.norm()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert rel <= 0.1, f"rel-L2 {rel:.3g}"
    assert 1 - cos <= 5e-3, f"1 - cosine {1 - cos:.3g}"


def reference(q, k, v, indptr, indices, sm_scale, k_scale, v_scale):
    """float64 attention over the dequantized cache, read through the same token table."""
    seq_lens = indptr[1:] - indptr[:-1]
    table = PageTable(indptr, indices, seq_lens, page_size=1, entries_per_page=1)
    return decode_attention_ref(q, k.float() * k_scale, v.float() * v_scale, table, sm_scale)


def check(kv_dtype, ours, theirs, q, k, v, indptr, indices, sm_scale, k_scale, v_scale):
    assert_close(ours, reference(q, k, v, indptr, indices, sm_scale, k_scale, v_scale))
    if kv_dtype == "bf16":
        assert_close(ours, theirs)
    else:
        assert_fp8_level(ours, theirs)


def routed(fallbacks: Fallbacks):
    return adapter.make_routed(sglang_decode.decode_attention_fwd, fallbacks)


def gqa_inputs(kv_dtype, lens, page_size, heads, kv_heads, dim, k_scale, v_scale):
    indptr, indices, slots = sglang_table(lens, page_size)
    q = torch.randn(len(lens), heads, dim, device=DEVICE).bfloat16()
    k = torch.randn(slots, kv_heads, dim, device=DEVICE)
    v = torch.randn(slots, kv_heads, dim, device=DEVICE)
    if kv_dtype == "fp8_e4m3":
        k, v = to_fp8(k, k_scale), to_fp8(v, v_scale)
    else:
        k, v = k.bfloat16(), v.bfloat16()
    return q, k, v, indptr, indices


@pytest.mark.parametrize(
    ("kv_dtype", "lens", "page_size", "heads", "kv_heads", "dim", "scales"),
    [
        ("bf16", [1, 37, 70], 1, 4, 2, 32, (1.0, 1.0)),
        ("bf16", [13, 5], 16, 8, 1, 64, (1.0, 1.0)),
        ("fp8_e4m3", [70, 1, 9], 1, 4, 2, 32, (0.02, 0.03)),
        ("fp8_e4m3", [33, 64, 2], 16, 8, 2, 16, (1.0, 1.0)),
        ("fp8_e4m3", [100], 64, 4, 1, 32, (0.5, 0.25)),
    ],
)
def test_gqa_routed_equals_sglang(kv_dtype, lens, page_size, heads, kv_heads, dim, scales):
    q, k, v, indptr, indices = gqa_inputs(kv_dtype, lens, page_size, heads, kv_heads, dim, *scales)
    fallbacks = Fallbacks()
    args = (q, k, v, indptr, indices, dim**-0.5, *scales, page_size)
    ours = call(routed(fallbacks), *args)
    theirs = call(sglang_decode.decode_attention_fwd, *args)
    assert not fallbacks.counts, f"unexpected fallback: {dict(fallbacks.counts)}"
    check(kv_dtype, ours, theirs, *args[:-1])


@pytest.mark.parametrize(
    ("kv_dtype", "lens", "page_size", "scales"),
    [
        ("bf16", [3, 41], 1, (1.0, 1.0)),
        ("fp8_e4m3", [29, 1], 16, (0.03, 0.05)),
        ("bf16", [70, 130], 64, (1.0, 1.0)),  # pages of several tiles, one entry read per tile
    ],
)
def test_mla_routed_equals_sglang(kv_dtype, lens, page_size, scales):
    """MLA as SGLang's MLA pool hands it over: V is a prefix view of the K rows, 512 latent + 64
    rope dims (SGLang's MLA kernel takes 576 or 288 only)."""
    latent, heads = 512, 4
    indptr, indices, slots = sglang_table(lens, page_size)
    q = torch.randn(len(lens), heads, latent + 64, device=DEVICE).bfloat16()
    kv = torch.randn(slots, 1, latent + 64, device=DEVICE)
    kv = to_fp8(kv, scales[1]) if kv_dtype == "fp8_e4m3" else kv.bfloat16()
    fallbacks = Fallbacks()
    args = (q, kv, kv[..., :latent], indptr, indices, (128 + 64) ** -0.5, *scales, page_size)
    ours = call(routed(fallbacks), *args, has_mla=True)
    theirs = call(sglang_decode.decode_attention_fwd, *args, has_mla=True)
    assert not fallbacks.counts, f"unexpected fallback: {dict(fallbacks.counts)}"
    check(kv_dtype, ours, theirs, *args[:-1])


@pytest.mark.parametrize("case", ["logit_cap", "sinks", "head_dim_48"])
def test_unsupported_calls_run_sglang_kernel_and_log_once(case, caplog):
    dim = 48 if case == "head_dim_48" else 32
    q, k, v, indptr, indices = gqa_inputs("bf16", [9, 17], 1, 4, 2, dim, 1.0, 1.0)
    extra = {}
    if case == "logit_cap":
        extra["logit_cap"] = 5.0
    if case == "sinks":
        extra["sinks"] = torch.randn(4, device=DEVICE)
    fallbacks = Fallbacks()
    args = (q, k, v, indptr, indices, dim**-0.5, 1.0, 1.0, 1)
    with caplog.at_level("WARNING", logger="tessera.sglang_kernels"):
        first = call(routed(fallbacks), *args, **extra)
        second = call(routed(fallbacks), *args, **extra)
    theirs = call(sglang_decode.decode_attention_fwd, *args, **extra)
    # SGLang's kernel ran: bit-identical to calling it directly
    assert torch.equal(first, theirs) and torch.equal(second, theirs)
    assert sum(fallbacks.counts.values()) == 2 and len(fallbacks.counts) == 1
    assert len([r for r in caplog.records if "using SGLang's own kernel" in r.message]) == 1


def test_install_replaces_the_module_function_and_uninstall_restores_it():
    original = sglang_decode.decode_attention_fwd
    try:
        installed = adapter.install()
        assert sglang_decode.decode_attention_fwd is installed is not original
        assert adapter.install() is installed  # idempotent: never wraps twice
    finally:
        adapter.uninstall()
    assert sglang_decode.decode_attention_fwd is original


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lens", "page_size"),
    [
        (32, 8, 128, [4096, 1, 3000, 777] * 4, 64),  # GQA at real shapes
        (8, 8, 128, [2048, 5, 1023], 1),  # MHA: SGLang's one-head kernel (interpreter-unsafe)
    ],
)
def test_gpu_real_shapes_routed_equals_sglang(kv_dtype, heads, kv_heads, dim, lens, page_size):
    scales = (0.05, 0.07) if kv_dtype == "fp8_e4m3" else (1.0, 1.0)
    q, k, v, indptr, indices = gqa_inputs(kv_dtype, lens, page_size, heads, kv_heads, dim, *scales)
    fallbacks = Fallbacks()
    args = (q, k, v, indptr, indices, dim**-0.5, *scales, page_size)
    ours = call(routed(fallbacks), *args, splits=8)
    theirs = call(sglang_decode.decode_attention_fwd, *args, splits=8)
    assert not fallbacks.counts
    check(kv_dtype, ours, theirs, *args[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_gpu_mla_real_shapes_routed_equals_sglang(kv_dtype):
    lens, heads, latent = [4096, 17, 1500, 64] * 8, 16, 512
    indptr, indices, slots = sglang_table(lens, 64)
    q = torch.randn(len(lens), heads, latent + 64, device=DEVICE).bfloat16()
    kv = torch.randn(slots, 1, latent + 64, device=DEVICE)
    scales = (0.05, 0.05) if kv_dtype == "fp8_e4m3" else (1.0, 1.0)
    kv = to_fp8(kv, scales[1]) if kv_dtype == "fp8_e4m3" else kv.bfloat16()
    args = (q, kv, kv[..., :latent], indptr, indices, (128 + 64) ** -0.5, *scales, 64)
    ours = call(routed(Fallbacks()), *args, splits=8, has_mla=True)
    theirs = call(sglang_decode.decode_attention_fwd, *args, splits=8, has_mla=True)
    check(kv_dtype, ours, theirs, *args[:-1])
