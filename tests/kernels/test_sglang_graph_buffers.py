"""FP8 MLA as SGLang's CUDA-graph decode hands it to the adapter: ``kv_indices`` and
``attn_logits`` are the Triton backend's graph buffers, whole (rows x context token slots, more
rows than requests), and the call is captured in a graph and replayed. The adapter's bound on
the longest request is then the context (``longest_bound``), not the buffer's length, and the
e4m3 kernel keeps its token cap within it. Needs no SGLang: the adapter's own call, against
the float64 reference over the dequantized cache."""

from __future__ import annotations

import pytest
import torch
from tessera.kernels.paged_decode_bf16 import decode_attention_ref
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable
from tessera.runtime.sglang_kernels.decode_attention import tessera_decode

REL_L2 = 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [66, 70])
def test_fp8_mla_through_sglang_graph_buffers_matches_reference(batch):
    """64k of context, so 66 requests take 2 splits of up to 32k tokens, each in 4 pieces of 8k
    at most (a 20k request's splits in 2), and 70 requests one split in 8 pieces (one wave
    leaves 62 SMs idle, but under this bound the stream schedule would plan 5 waves)."""
    torch.manual_seed(batch)
    rows, context, heads, latent, page, scale = 80, 65536, 16, 512, 64, 0.05
    lens = ([20000, 17, 9000, 64, 4096] * 14)[:batch]
    pages = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(pages) + 3)
    slots, at = [], 0
    for n, c in zip(lens, pages, strict=True):
        pos = torch.arange(n)
        slots.append(perm[at : at + c][pos // page] * page + pos % page)
        at += c
    indices = torch.cat(slots).cuda()
    indptr = torch.tensor([0, *lens]).cumsum(0).to(torch.int32).cuda()
    buffer = torch.zeros(rows * context, dtype=torch.int64, device="cuda")
    buffer[: indices.numel()] = indices
    kv = (torch.randn((sum(pages) + 3) * page, 1, latent + 64, device="cuda") / scale)
    kv = kv.clamp(-448, 448).to(FP8_DTYPE)
    q = torch.randn(batch, heads, latent + 64, device="cuda").bfloat16()
    o = torch.full((batch, heads, latent), float("nan"), dtype=q.dtype, device="cuda")
    sm_scale = (128 + 64) ** -0.5
    args = (q, kv, kv[..., :latent], o, indptr, buffer, sm_scale, scale, scale, page, rows)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tessera_decode(*args)  # the warm-up run SGLang makes before its capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tessera_decode(*args)
    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    table = PageTable(indptr, indices, indptr[1:] - indptr[:-1], page_size=1, entries_per_page=1)
    flat = kv.float() * scale
    ref = decode_attention_ref(q, flat, flat[..., :latent], table, sm_scale)
    assert o.isfinite().all(), "unwritten or non-finite output"
    rel = (o.float() - ref.float()).norm() / ref.float().norm()
    assert rel <= REL_L2, f"rel-L2 {rel:.3g}"
