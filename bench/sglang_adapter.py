"""SGLang's own kernels against tessera's, both called through SGLang's interfaces, on one GPU.

Decode attention: SGLang 0.5.23's ``decode_attention_fwd`` (its Triton backend's kernel, 8 KV
splits, the default of ``--triton-attention-num-kv-splits``) against the same call routed by
tessera's adapter (``tessera.runtime.sglang_kernels.decode_attention``), with SGLang's
token-level ``kv_indptr``/``kv_indices`` over shuffled 64-token pages; and the adapter against
tessera's kernel called directly with a page-level table, as ``bench/fp8_kv_decode.py`` calls it
(the adapter's overhead).

W4A16: SGLang's ``CompressedTensorsWNA16`` linear and ``CompressedTensorsWNA16MoE`` schemes, whose
weights SGLang creates and repacks; SGLang's path (Marlin, JIT-compiled by SGLang on first use)
against the same scheme patched by tessera's adapter, and the adapter against ``w4a16_matmul`` /
``fused_moe`` called directly on the same converted weights.

With ``--flashmla`` the MLA rows also time FlashMLA (the ``sgl-flash-mla`` wheel's kernels as
SGLang's ``flashmla`` backend calls them, ``flashmla_peer.py``) on the same pages, through a
block table of the same pages: what SGLang would run instead of the routed call.

Every time is the median of CUDA-graph replays (``bench/timing.py``); every output is checked
against the other side. Prints a table last; writes sglang_adapter.json.

    python bench/sglang_adapter.py [--quick] [--flashmla] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import platform
import sys
import traceback
import types
from pathlib import Path

import torch
import triton
from accuracy import rel_l2
from flashmla_peer import flashmla_decode
from tessera.kernels.paged_decode_bf16 import paged_decode_bf16, paged_decode_mla_bf16
from tessera.kernels.paged_decode_fp8 import paged_decode_fp8, paged_decode_mla_fp8
from tessera.kernels.paged_kv import FP8_DTYPE, PageTable
from tessera.kernels.w4a16_gemm import w4a16_matmul
from tessera.kernels.w4a16_moe import fused_moe
from tessera.runtime.sglang_kernels import decode_attention as attn_adapter
from tessera.runtime.sglang_kernels import w4a16 as w4_adapter
from timing import graph_time_us

SGLANG_SPLITS = 8
PAGE = 64
MLA_LATENT, MLA_ROPE = 512, 64


def sgl_kernel_status() -> str:
    """Import ``sgl_kernel`` (SGLang's prebuilt CUDA ops, which SGLang's quantization package
    imports at load time). Where its ops library is absent or does not load against this torch,
    its Python modules are kept and each op raises when called, so any SGLang path that really
    needs one fails loudly in its row instead of running something else. Decode attention and
    Marlin (JIT-built by SGLang itself) need none."""
    try:
        import sgl_kernel

        return f"sgl_kernel {sgl_kernel.__version__}"
    except Exception as e:  # noqa: BLE001 - any load failure leaves the same choice
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"  # its first line: no paths
        spec = importlib.util.find_spec("sgl_kernel")
        if spec is None or spec.submodule_search_locations is None:
            return f"sgl_kernel absent ({why})"
        module = types.ModuleType("sgl_kernel")
        module.__path__ = list(spec.submodule_search_locations)

        def op(name: str):
            if name.startswith("__"):  # module protocol lookups (inspect reads __file__)
                raise AttributeError(name)

            def missing(*_args, **_kwargs):
                raise RuntimeError(f"sgl_kernel.{name} is not loaded ({why})")

            return missing

        module.__getattr__ = op  # type: ignore[attr-defined]
        sys.modules["sgl_kernel"] = module
        return f"sgl_kernel Python modules only, ops not loaded: {why}"


# ---------------------------------------------------------------- decode attention


class Tables:
    """One batch's pages, shuffled over a pool: SGLang's token-level table and the page table."""

    def __init__(self, batch: int, ctx: int) -> None:
        lens = [ctx] * batch
        pages_per = math.ceil(ctx / PAGE)
        perm = torch.randperm(batch * pages_per + 7)
        pages = perm[: batch * pages_per].view(batch, pages_per)
        pos = torch.arange(ctx)
        slots = pages[:, pos // PAGE] * PAGE + pos % PAGE  # [batch, ctx]
        self.num_slots = (batch * pages_per + 7) * PAGE
        self.kv_indptr = (torch.arange(batch + 1) * ctx).to(torch.int32).cuda()
        self.kv_indices = slots.flatten().cuda()
        self.page_table = PageTable.from_page_lists(pages.tolist(), lens, PAGE, "cuda")
        self.block_table = pages.to(torch.int32).cuda()  # FlashMLA's form of the same pages
        self.lens = torch.tensor(lens, dtype=torch.int32).cuda()
        self.ctx = ctx


def sglang_call(fn, q, k, v, o, t: Tables, sm_scale, k_scale, v_scale, mla: bool):
    batch, heads = q.shape[:2]
    logits = torch.empty(batch, heads, SGLANG_SPLITS, v.shape[-1], device="cuda")
    lse = torch.empty(batch, heads, SGLANG_SPLITS, device="cuda")
    splits = torch.full((batch,), SGLANG_SPLITS, dtype=torch.int32, device="cuda")

    def run(_i: int) -> None:
        fn(q, k, v, o, t.kv_indptr, t.kv_indices, logits, lse, splits, SGLANG_SPLITS,
           sm_scale, k_scale, v_scale, has_mla=mla, page_size=PAGE)  # fmt: skip

    return run


def bench_decode(kind: str, kv: str, batch: int, ctx: int, heads: int, kv_heads: int, dim: int,
                 flashmla=None):  # fmt: skip
    from sglang.kernels.ops.attention import decode_attention as sglang_module

    original = sglang_module.decode_attention_fwd
    routed = attn_adapter.make_routed(original)
    t = Tables(batch, ctx)
    mla = kind == "mla"
    scales = (0.05, 0.05) if kv == "fp8" else (1.0, 1.0)
    qk_dim = MLA_LATENT + MLA_ROPE if mla else dim
    v_dim = MLA_LATENT if mla else dim
    q = torch.randn(batch, heads, qk_dim, device="cuda").bfloat16()
    if mla:
        k = torch.randn(t.num_slots, 1, qk_dim, device="cuda")
        k = (k / scales[0]).clamp(-448, 448).to(FP8_DTYPE) if kv == "fp8" else k.bfloat16()
        v = k[..., :MLA_LATENT]
        sm_scale = (128 + 64) ** -0.5
    else:
        k, v = (torch.randn(t.num_slots, kv_heads, dim, device="cuda") for _ in range(2))
        if kv == "fp8":
            k = (k / scales[0]).clamp(-448, 448).to(FP8_DTYPE)
            v = (v / scales[1]).clamp(-448, 448).to(FP8_DTYPE)
        else:
            k, v = k.bfloat16(), v.bfloat16()
        sm_scale = dim**-0.5
    outs = {n: torch.full((batch, heads, v_dim), float("nan"), device="cuda").bfloat16()
            for n in ("sglang", "adapter", "direct")}  # fmt: skip
    ks, vs = (torch.full((), s, device="cuda") for s in scales)

    def direct(_i: int) -> None:
        o = outs["direct"]
        if mla and kv == "fp8":
            paged_decode_mla_fp8(q, k, vs, t.page_table, sm_scale * scales[0] / scales[1],
                                 max_seq_len=ctx, out=o)  # fmt: skip
        elif mla:
            paged_decode_mla_bf16(q, k, t.page_table, sm_scale, max_seq_len=ctx, out=o)
        elif kv == "fp8":
            paged_decode_fp8(q, k, v, ks, vs, t.page_table, sm_scale, max_seq_len=ctx, out=o)
        else:
            paged_decode_bf16(q, k, v, t.page_table, sm_scale, max_seq_len=ctx, out=o)

    sglang_table = PageTable.from_sglang(t.kv_indptr, t.kv_indices, t.page_table.seq_lens, PAGE)

    def direct_sglang_table(_i: int) -> None:  # where the adapter's overhead comes from
        o = outs["direct_sglang_table"]
        if mla and kv == "fp8":
            paged_decode_mla_fp8(q, k, vs, sglang_table, sm_scale * scales[0] / scales[1],
                                 max_seq_len=ctx, out=o)  # fmt: skip
        elif mla:
            paged_decode_mla_bf16(q, k, sglang_table, sm_scale, max_seq_len=ctx, out=o)
        elif kv == "fp8":
            paged_decode_fp8(q, k, v, ks, vs, sglang_table, sm_scale, max_seq_len=ctx, out=o)
        else:
            paged_decode_bf16(q, k, v, sglang_table, sm_scale, max_seq_len=ctx, out=o)

    outs["direct_sglang_table"] = torch.empty_like(outs["direct"])
    calls = {
        "sglang": sglang_call(original, q, k, v, outs["sglang"], t, sm_scale, *scales, mla),
        "adapter": sglang_call(routed, q, k, v, outs["adapter"], t, sm_scale, *scales, mla),
        "direct": direct,
        "direct_sglang_table": direct_sglang_table,
    }
    if mla and flashmla is not None:  # the same slots as pages of PAGE tokens
        pages = k.view(t.num_slots // PAGE, PAGE, 1, qk_dim)
        descale = ks if kv == "fp8" else None
        fm = flashmla_decode(flashmla, q, pages, t.block_table, t.lens, MLA_LATENT, sm_scale,
                             descale)  # fmt: skip
        outs["flashmla"] = torch.empty_like(outs["direct"])

        def flashmla_call(_i: int) -> None:
            outs["flashmla"].copy_(fm())

        calls["flashmla"] = flashmla_call
    for c in calls.values():
        c(0)
    torch.cuda.synchronize()
    row = {"kind": kind, "kv": kv, "batch": batch, "ctx": ctx, "heads": heads,
           "kv_heads": 1 if mla else kv_heads, "dim": qk_dim}  # fmt: skip
    for n, o in outs.items():
        assert o.isfinite().all(), f"{n}: unwritten or non-finite output"
    row["rel_l2_adapter_vs_sglang"] = rel_l2(outs["adapter"], outs["sglang"])
    row["rel_l2_adapter_vs_direct"] = rel_l2(outs["adapter"], outs["direct"])
    for n, c in calls.items():
        row[f"{n}_us"] = graph_time_us(c, 1)
    row["speedup_vs_sglang"] = row["sglang_us"] / row["adapter_us"]
    row["adapter_overhead"] = row["adapter_us"] / row["direct_us"] - 1
    if "flashmla" in calls:  # its own error (e4m3 q for FP8) against the adapter's
        row["rel_l2_flashmla_vs_adapter"] = rel_l2(outs["flashmla"], outs["adapter"])
        row["adapter_vs_flashmla"] = row["flashmla_us"] / row["adapter_us"]
    kv_bytes = t.kv_indices.numel() * (k.shape[1] * k.shape[2] * k.element_size())
    if not mla:
        kv_bytes *= 2
    row["adapter_tb_s"] = kv_bytes / row["adapter_us"] / 1e6
    return row


# ---------------------------------------------------------------- W4A16


def _modules():
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16 as linear_mod,
    )
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16_moe as moe_mod,
    )

    return linear_mod, moe_mod


def _fill_int4(param: torch.Tensor) -> None:
    """Random packed 4-bit codes (every int32 bit pattern is 8 valid codes)."""
    param.data.copy_(torch.randint(-(2**31), 2**31 - 1, param.shape, dtype=torch.int32))


def _fill_scale(param: torch.Tensor) -> None:
    param.data.copy_((torch.rand(param.shape) * 0.02 + 0.005).to(param.dtype))


def linear_layers(scheme, n: int, k: int, copies: int):
    """``copies`` pairs of identical layers (SGLang's, ours), weights made by SGLang's scheme."""
    pairs = []
    for _ in range(copies):
        made = []
        for _side in range(2):
            layer = torch.nn.Module()
            scheme.create_weights(layer, output_size=n, input_size=k, output_partition_sizes=[n],
                                  input_size_per_partition=k, params_dtype=torch.bfloat16,
                                  weight_loader=None)  # fmt: skip
            made.append(layer)
        torch.manual_seed(len(pairs))
        _fill_int4(made[0].weight_packed)
        _fill_scale(made[0].weight_scale)
        for name in ("weight_packed", "weight_scale"):
            getattr(made[1], name).data.copy_(getattr(made[0], name).data)
        for layer in made:
            layer.weight_shape.data.copy_(torch.tensor([n, k]))
        pairs.append([layer.cuda() for layer in made])
    return pairs


def bench_linear(n: int, k: int, group: int, m_values) -> list[dict]:
    linear_mod, _ = _modules()
    cls = linear_mod.CompressedTensorsWNA16
    scheme = cls(strategy="group", num_bits=4, group_size=group, symmetric=True, actorder=None)
    process, apply = w4_adapter.make_linear_methods(
        cls.process_weights_after_loading, cls.apply_weights
    )
    copies = max(2, math.ceil(3 * 60e6 / (n * k / 2)))  # working set over the 60 MB L2
    pairs = linear_layers(scheme, n, k, copies)
    for theirs, ours in pairs:
        cls.process_weights_after_loading(scheme, theirs)
        process(scheme, ours)
    weights = [getattr(ours, w4_adapter.WEIGHT_ATTR) for _, ours in pairs]
    rows = []
    for m in m_values:
        xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(4)]
        out_s = cls.apply_weights(scheme, pairs[0][0], xs[0], None)
        out_a = apply(scheme, pairs[0][1], xs[0], None)
        out_d = w4a16_matmul(xs[0], weights[0])
        row = {"n": n, "k": k, "group": group, "m": m,
               "rel_l2_adapter_vs_sglang": rel_l2(out_a, out_s),
               "rel_l2_adapter_vs_direct": rel_l2(out_a, out_d)}  # fmt: skip
        row["sglang_us"] = graph_time_us(
            lambda i, xs=xs: cls.apply_weights(scheme, pairs[i][0], xs[i % 4], None), copies
        )
        row["adapter_us"] = graph_time_us(
            lambda i, xs=xs: apply(scheme, pairs[i][1], xs[i % 4], None), copies
        )
        row["direct_us"] = graph_time_us(
            lambda i, xs=xs: w4a16_matmul(xs[i % 4], weights[i]), copies
        )
        row["speedup_vs_sglang"] = row["sglang_us"] / row["adapter_us"]
        row["adapter_overhead"] = row["adapter_us"] / row["direct_us"] - 1
        rows.append(row)
    return rows


def bench_moe(
    experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    group: int,
    token_values,
    with_sglang: bool = True,
):
    from compressed_tensors.quantization import QuantizationArgs
    from sglang.srt.layers.moe import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput

    _, moe_mod = _modules()
    cls = moe_mod.CompressedTensorsWNA16MoE
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, group_size=group,
                            strategy="group")  # fmt: skip

    class Config:  # the one field of CompressedTensorsConfig the scheme reads
        quant_format = "pack-quantized"

    process, apply = w4_adapter.make_moe_methods(
        cls.process_weights_after_loading, cls.apply_weights
    )
    scheme = cls(Config(), args)
    scheme.moe_runner_config = MoeRunnerConfig(num_experts=experts, top_k=top_k)
    made = []
    for _side in range(2):
        layer = torch.nn.Module()
        layer.moe_tp_size = 1
        scheme.create_weights(layer, num_experts=experts, hidden_size=hidden,
                              intermediate_size_per_partition=inter,
                              params_dtype=torch.bfloat16)  # fmt: skip
        made.append(layer)
    torch.manual_seed(1)
    for name in ("w13_weight_packed", "w2_weight_packed"):
        _fill_int4(getattr(made[0], name))
    for name in ("w13_weight_scale", "w2_weight_scale"):
        _fill_scale(getattr(made[0], name))
    for name, p in made[0].named_parameters():
        getattr(made[1], name).data.copy_(p.data)
    theirs, ours = (layer.cuda() for layer in made)
    if with_sglang:  # SGLang JIT-builds its Marlin repack and MoE kernels here (minutes)
        cls.process_weights_after_loading(scheme, theirs)
    process(scheme, ours)
    w13, w2 = getattr(ours, w4_adapter.W13_ATTR), getattr(ours, w4_adapter.W2_ATTR)
    rows = []
    for tokens in token_values:
        inputs = []
        for _ in range(4):
            x = torch.randn(tokens, hidden, device="cuda").bfloat16()
            ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, top_k).softmax(-1)
            logits = torch.randn(tokens, experts, device="cuda")
            topk = (weights.cuda(), ids.int().cuda(), logits)
            inputs.append(StandardDispatchOutput(x, None, topk))
        ours_out = apply(scheme, ours, inputs[0]).hidden_states
        direct_out = fused_moe(inputs[0].hidden_states, w13, w2, *inputs[0].topk_output[:2])
        row = {"experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
               "group": group, "tokens": tokens,
               "rel_l2_adapter_vs_direct": rel_l2(ours_out, direct_out)}  # fmt: skip
        if with_sglang:
            theirs_out = cls.apply_weights(scheme, theirs, inputs[0]).hidden_states
            row["rel_l2_adapter_vs_sglang"] = rel_l2(ours_out, theirs_out)
            row["sglang_us"] = graph_time_us(
                lambda i, d=inputs: cls.apply_weights(scheme, theirs, d[i]), 4
            )
        row["adapter_us"] = graph_time_us(lambda i, d=inputs: apply(scheme, ours, d[i]), 4)
        row["direct_us"] = graph_time_us(
            lambda i, d=inputs: fused_moe(d[i].hidden_states, w13, w2, *d[i].topk_output[:2]), 4
        )
        if with_sglang:
            row["speedup_vs_sglang"] = row["sglang_us"] / row["adapter_us"]
        row["adapter_overhead"] = row["adapter_us"] / row["direct_us"] - 1
        rows.append(row)
    return rows


# ---------------------------------------------------------------- driver


def meta(args: argparse.Namespace) -> dict:
    import sglang

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sglang": sglang.__version__,
        "python": platform.python_version(),
        "commit": args.commit or None,
        "command": f"python bench/sglang_adapter.py --sections {args.sections}"
        + (" --quick" if args.quick else "")
        + (" --flashmla" if args.flashmla else "")
        + (" --no-sglang-moe" if args.no_sglang_moe else ""),
        "timing": "median of CUDA-graph replays (bench/timing.py)",
    }


def attempt(results: dict, name: str, fn, *args) -> None:
    """Run one section; a failure is recorded with its error, the others still run."""
    try:
        rows = fn(*args)
        results.setdefault(name, []).extend(rows if isinstance(rows, list) else [rows])
    except Exception as e:  # noqa: BLE001 - the benchmark reports, it does not stop
        traceback.print_exc()
        frames = traceback.extract_tb(e.__traceback__)[-4:]  # where, without machine paths
        where = " <- ".join(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}"
                            for f in reversed(frames))  # fmt: skip
        results.setdefault("errors", []).append(
            f"{name}{args}: {type(e).__name__}: {e} (at {where})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="decode,linear,moe", help="comma-separated subset")
    ap.add_argument(
        "--no-sglang-moe",
        action="store_true",
        help="MoE: time the adapter and the direct call only (skips Marlin's JIT build)",
    )
    ap.add_argument("--flashmla", action="store_true",
                    help="time FlashMLA beside the adapter on the MLA decode rows")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--commit", default="", help="the tree's commit, recorded in the results")
    a = ap.parse_args()
    torch.manual_seed(0)
    results: dict = {"meta": {**meta(a), "sgl_kernel": sgl_kernel_status()}}
    decode = [("gqa", 32, 4096, 32, 8, 128), ("gqa", 8, 16384, 32, 8, 128),
              ("mla", 32, 4096, 16, 1, 512), ("mla", 8, 16384, 16, 1, 512),
              ("mla", 64, 2048, 16, 1, 512), ("mla", 32, 4096, 64, 1, 512),
              ("mla", 32, 4096, 128, 1, 512)]  # fmt: skip
    if a.quick:
        decode = decode[::2]
    flashmla = importlib.import_module("flash_mla") if a.flashmla else None
    sections = set(a.sections.split(","))
    for kind, batch, ctx, heads, kv_heads, dim in decode if "decode" in sections else ():
        for kv in ("bf16", "fp8"):
            attempt(results, "decode", bench_decode, kind, kv, batch, ctx, heads, kv_heads, dim,
                    flashmla)  # fmt: skip
            print(results.get("decode", [{}])[-1], flush=True)
    m_values = (1, 16) if a.quick else (1, 16, 64)
    linear = [(16384, 7168, 128), (4608, 7168, 32), (7168, 2304, 32)]
    for n, k, group in linear if "linear" in sections else ():
        attempt(results, "linear", bench_linear, n, k, group, m_values)
    tokens = (1, 16) if a.quick else (1, 16, 64)
    if "moe" in sections:
        attempt(results, "moe", bench_moe, 384 // 8, 7168, 2048, 8, 32, tokens, not a.no_sglang_moe)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sglang_adapter.json").write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    print(f"\n{'section':8s} {'case':35s} sglang_us adapter_us direct_us  x_sglang "
          "overhead rel(a,s)")  # fmt: skip
    for r in results.get("decode", []):
        case = f"{r['kind']} {r['kv']} b{r['batch']} ctx{r['ctx']} h{r['heads']}"
        _line("decode", case, r)
        if "flashmla_us" in r:  # what SGLang's flashmla backend would run instead
            print(f"{'':8s} {'  FlashMLA':35s} {r['flashmla_us']:9.1f} us: adapter "
                  f"{r['adapter_vs_flashmla']:.2f}x its speed, rel "
                  f"{r['rel_l2_flashmla_vs_adapter']:.1e}")  # fmt: skip
    for r in results.get("linear", []):
        _line("linear", f"{r['n']}x{r['k']} g{r['group']} m{r['m']}", r)
    for r in results.get("moe", []):
        _line("moe", f"{r['experts']}x{r['hidden']}x{r['inter']} top{r['top_k']} t{r['tokens']}", r)
    for e in results.get("errors", []):
        print("ERROR", e)


def _line(section: str, case: str, r: dict) -> None:
    overhead = 100 * r["adapter_overhead"]
    if "sglang_us" not in r:  # SGLang's side skipped (--no-sglang-moe)
        print(f"{section:8s} {case:35s} {'-':>9s} {r['adapter_us']:10.1f} {r['direct_us']:9.1f} "
              f"{'-':>9s} {overhead:+7.1f}% {'-':>7s}")  # fmt: skip
        return
    print(f"{section:8s} {case:35s} {r['sglang_us']:9.1f} {r['adapter_us']:10.1f} "
          f"{r['direct_us']:9.1f} {r['speedup_vs_sglang']:8.2f}x {overhead:+7.1f}% "
          f"{r['rel_l2_adapter_vs_sglang']:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
