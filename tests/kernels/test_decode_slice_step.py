"""The decode-slice benchmark's step (bench/decode_slice.py) at tiny shapes: the kernels (under
the Triton interpreter without a GPU) against the same step in pure torch, for every weight and
KV precision, with the integrity check in the step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import decode_slice as ds  # noqa: E402
from decode_slice_plan import SliceShape  # noqa: E402
from tessera.kernels.page_tag_check import page_tag_check  # noqa: E402

# Every dimension a multiple of the FP8 block (128) or the INT4 group where it must be, MLA with
# a 64-wide latent + 64 rope dims, a DSA-style indexer, 2 GPUs' worth of 8 experts, top 2.
TINY = SliceShape(
    hidden=256, heads=2, q_lora=128, kv_lora=64, rope=64, qk_nope=32, v_head=32,
    index_heads=2, index_dim=32, experts=8, local_experts=4, top_k=2, expert_width=128,
    shared_width=64, dense_width=128, vocab_shard=64, dense_layers=1, moe_layers=2,
)  # fmt: skip
LENGTHS = [128, 64, 192]  # full pages, so each request decodes the last slot of a page
POOL_PAGES = 12


pytestmark = pytest.mark.usefixtures("gpu_like_interpreter")


@pytest.fixture(scope="module")
def sglang() -> ds.SglangKernels:
    try:
        kernels = ds.load_sglang_kernels()
    except FileNotFoundError:
        pytest.skip("SGLang's kernel sources are not installed")
    kernels.config = dict(ds.SGLANG_FP8_CONFIGS[1])
    return kernels


def _clone(cache: ds.KVCache) -> ds.KVCache:
    return ds.KVCache(cache.rows.clone(), cache.scale)


# e4m3 activations are re-quantized at every FP8 linear: when the two sides' BF16 inputs differ
# in the last bit, a value can round to the next e4m3 step (6-12% of it), so FP8-weight errors
# grow from layer to layer. A wrong index or scale gives errors near 1.
STEP_TOL = {"fp8": 0.12, "int4": 3e-2}
LAYER_TOL = {"fp8": 4e-2, "int4": 1e-2}


def _pair(weights: str, kv: str, sglang, device: str = "cpu",
          side: torch.cuda.Stream | None = None) -> tuple[ds.SliceStep, ds.SliceStep]:  # fmt: skip
    """The slice step on the kernels (with ``side``, two streams) and on the reference, over
    equal copies of one KV pool."""
    device = torch.device(device)
    gen = ds.Gen(device, seed=5)
    common = ds.build_common(TINY, gen)
    w = ds.build_weights(TINY, weights, 32, moe_layers=2, gen=gen)
    dense = [ds.new_cache(POOL_PAGES, TINY.latent_dim, kv, gen)]
    moe = [ds.new_cache(POOL_PAGES, TINY.latent_dim, kv, gen) for _ in range(2)]
    batch = ds.build_batch(LENGTHS, POOL_PAGES, TINY.vocab_shard, seed=3, device=device)
    routing = ds.layer_routings(TINY, len(LENGTHS), 2, seed=7, device=device)
    step = ds.SliceStep(TINY, common, w, dense, moe, batch, routing, ds.KernelOps(sglang), side)
    ref = ds.SliceStep(
        TINY, common, w, [_clone(c) for c in dense], [_clone(c) for c in moe], batch, routing,
        ds.ReferenceOps(sglang),
    )  # fmt: skip
    return step, ref


def _stored(cache: ds.KVCache, slots: torch.Tensor) -> torch.Tensor:
    rows = cache.rows[slots].float()
    return rows if cache.scale is None else rows * cache.scale


CONFIGS = [("fp8", "bf16"), ("fp8", "fp8_e4m3"), ("int4", "bf16"), ("int4", "fp8_e4m3")]


@pytest.mark.parametrize("weights,kv", CONFIGS)
def test_slice_step_matches_torch_reference(weights: str, kv: str, sglang) -> None:
    step, ref = _pair(weights, kv, sglang)
    slots = step.batch.new_slots
    before = [_stored(c, slots) for c in step.dense_caches + step.moe_caches]
    bad, logits, _ = step.step()
    ref_bad, ref_logits, _ = ref.step()

    assert torch.isfinite(logits.float()).all()
    assert bad.tolist() == ref_bad.tolist() == [0] * len(LENGTHS)
    assert ds.rel_l2(logits, ref_logits) < STEP_TOL[weights]
    # every layer stored the new token's latent in the slot the page table gives it
    mine, theirs = step.dense_caches + step.moe_caches, ref.dense_caches + ref.moe_caches
    caches = zip(mine, theirs, before, strict=True)
    for cache, ref_cache, old in caches:
        new = _stored(cache, slots)
        assert ds.rel_l2(new, _stored(ref_cache, slots)) < STEP_TOL[weights]
        assert ds.rel_l2(new, old) > 0.5


@pytest.mark.parametrize("weights,kv", CONFIGS)
def test_each_layer_matches_torch_reference(weights: str, kv: str, sglang) -> None:
    """One dense and one MoE layer on the same residual and pending output (added in the
    layer's first norm, as SGLang does): the kernels against the reference, for the residual
    the layer passes on (input, pending output and attention output) and for its own output."""
    step, ref = _pair(weights, kv, sglang)
    x = ds.Gen(torch.device("cpu"), seed=9).randn(len(LENGTHS), TINY.hidden)
    delta = ds.Gen(torch.device("cpu"), seed=10).randn(len(LENGTHS), TINY.hidden)
    for layer in ("dense_layer", "moe_layer"):
        res, out = getattr(step, layer)(0, x, delta)
        ref_res, expected = getattr(ref, layer)(0, x, delta)
        assert ds.rel_l2(res, ref_res) < LAYER_TOL[weights], layer
        assert ds.rel_l2(out, expected) < LAYER_TOL[weights], layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights", ["fp8", "int4"])
def test_two_stream_layers_in_a_graph_match_torch_reference(weights: str, sglang) -> None:
    """The MoE layers with SGLang's second stream (the kv_a norm, the DSA q_b projection and
    the shared expert beside the rest), captured in a CUDA graph as the benchmark times them,
    against the reference on one stream. BF16 KV: the streams change no attention kernel, and
    on Hopper the FP8 MLA kernels take only the real 512 + 64 latent, not these tiny dims."""
    kv = "bf16"
    device = torch.device("cuda")
    step, ref = _pair(weights, kv, sglang, "cuda", torch.cuda.Stream())
    x = ds.Gen(device, seed=9).randn(len(LENGTHS), TINY.hidden)
    delta = ds.Gen(device, seed=10).randn(len(LENGTHS), TINY.hidden)
    outs = []
    graph = ds.capture(lambda: outs.append(step.layers(x, delta)))
    graph.replay()
    torch.cuda.synchronize()
    res, out = outs[-1]
    ref_res, expected = ref.layers(x, delta)
    assert ds.rel_l2(res, ref_res) < STEP_TOL[weights]
    assert ds.rel_l2(out, expected) < STEP_TOL[weights]


def test_integrity_state_checks_clean_and_flags_a_reused_page() -> None:
    batch = ds.build_batch(LENGTHS, POOL_PAGES, TINY.vocab_shard, 3, torch.device("cpu"))
    check = batch.integrity
    t = check.tracker
    args = (check.table, t.page_size, check.rows, (check.seq_lens + 63) // 64,
            t.expected_pages[:-1], t.expected_tags[:-1], t.tags)  # fmt: skip
    assert page_tag_check(*args).tolist() == [0, 0, 0]  # the Triton kernel (interpreted)
    assert check.step().tolist() == [0, 0, 0]  # the tracker's own per-step work
    # request 1's only page is freed and handed out again: only request 1 is flagged
    page = int(check.table[1, 0]) // 64
    t.on_free(torch.tensor([page]))
    t.on_alloc(torch.tensor([page * 64]))
    assert check.step().tolist() == [0, 1, 0]


def test_slice_routing_rows_are_the_critical_gpus_pairs() -> None:
    routing = ds.layer_routings(TINY, 16, 3, seed=1, device=torch.device("cpu"))
    for r in routing:
        assert r.ids.shape == r.weights.shape == (r.tokens.numel(), 1)
        assert int(r.ids.max()) < TINY.local_experts
        assert r.distinct_experts == r.ids.unique().numel() >= r.mean_distinct_experts


def test_sglang_router_selects_the_reference_experts_and_weights(sglang) -> None:
    """SGLang's Triton router (the slice's top-k) against torch: sigmoid scores ranked with the
    bias, the weights the unbiased scores renormalized. The bias is large enough to reorder the
    experts, so a kernel that ranked without it (or weighed with it) would fail."""
    g = torch.Generator().manual_seed(4)
    for rows, experts, top_k in [(1, 384, 8), (5, 256, 8), (3, 8, 2)]:
        logits = torch.randn(rows, experts, generator=g)
        bias = torch.randn(experts, generator=g)
        weights, ids = ds.select_experts(sglang, logits, bias, top_k)
        ref_weights, ref_ids = ds.select_experts_ref(logits, bias, top_k)
        assert torch.equal(ids, ref_ids)
        assert torch.allclose(weights, ref_weights, rtol=1e-5, atol=1e-6)
        unbiased = torch.topk(logits, top_k, dim=-1).indices.to(torch.int32)
        assert not torch.equal(ids.sort(-1).values, unbiased.sort(-1).values)


def test_layer_check_reports_the_layer_and_the_router(sglang) -> None:
    """The benchmark's own one-layer check (what each GPU run records) on the tiny step."""
    step, _ = _pair("int4", "bf16", sglang)
    x = ds.Gen(torch.device("cpu"), seed=9).randn(len(LENGTHS), TINY.hidden)
    delta = ds.Gen(torch.device("cpu"), seed=10).randn(len(LENGTHS), TINY.hidden)
    check = ds.check_layer(step, x, delta, len(LENGTHS))
    assert check["moe_layer_rel_l2"] < LAYER_TOL["int4"]
    assert check["router_ids_equal"] is True
    assert check["router_logits_rel_l2"] < 1e-6 and check["router_weights_max_abs_diff"] < 1e-6


def test_summary_of_one_stream_layers_timed_beside_the_two_stream_ones() -> None:
    """``--streams both``: the one-stream layers scale to a step the same way as the others,
    over the same once-per-step samples; without them the row has no such fields."""
    t = {"rest_off": [1e-3, 1e-3], "rest_on": [1.1e-3, 1.1e-3], "layers": [8e-3, 8e-3]}
    plain = ds.summarize(t, 4, slice_layers=8, moe_layers=60)
    assert "step_ms_one_stream" not in plain
    both = ds.summarize(t | {"layers_one_stream": [9.6e-3, 9.6e-3]}, 4, 8, 60)
    assert both["step_ms"] == pytest.approx(1 + 8 * 60 / 8)
    assert both["moe_layer_ms_one_stream"] == pytest.approx(1.2)
    assert both["step_ms_one_stream"] == pytest.approx(1 + 9.6 * 60 / 8)
