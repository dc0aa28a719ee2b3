"""The handover conversion per 8k-token request against the time its BF16 KV takes on the wire.

For Kimi K2 (61 MLA layers, 576 latent+rope values) and GLM 5 (78 DSA layers, the same latent
plus FP8 indexer keys that are sent as they are), one request's pages are scattered over a pool
of separate per-layer buffers, as SGLang's MLA pool holds them. The conversion is timed as the
prefill's transfer worker runs it (``convert_rows`` over every layer into a staging buffer, one
launch): eager wall time per request (the Python launch included: the median of back-to-back
calls between CUDA events) and GPU time (CUDA-graph replay). Before timing, every converted byte
is checked against SGLang's own write: torch's cast (``MLATokenToKVPool.set_kv_buffer``) and
SGLang's Triton ``quantize_k_cache_separate`` / ``dequantize_k_cache``, loaded from their
source files (``--sglang-dir``: a folder holding ``dsa_quant_k_cache.py`` and
``dequant_k_cache.py`` from sglang 0.5.23's ``kernels/ops``).

Transfer time = bytes * 8 / link speed, at 400 and 100 Gb/s (one NIC per GPU).

    python bench/kv_handover.py --sglang-dir DIR [--tokens 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
from pathlib import Path

import torch
import triton
from tessera.kernels.mla_kv_handover import MLAKVLayout, convert_rows, page_rows
from timing import graph_time_us

PAGE = 64
LINKS_GBPS = (400, 100)
MODELS = {
    # name: (layers, DSA, indexer key bytes per token per layer: 128 FP8 + one FP32 scale)
    "kimi-k2": (61, False, 0),
    "glm-5": (78, True, 132),
}


def load(path: Path, name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_bytes(x: torch.Tensor, dst: MLAKVLayout, quant, dequant) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """What SGLang's own write puts in a ``dst`` pool for BF16 token values ``x`` [n, 576]."""
    if dst.kind == "fp8_e4m3":
        return x.to(torch.float8_e4m3fn).view(torch.uint8)
    if dst.kind == "bf16":
        return x.view(torch.uint8)
    q, rope = quant.quantize_k_cache_separate(x[:, : dst.nope], x[:, dst.nope :])
    return torch.cat([q.squeeze(1), rope.squeeze(1)], dim=1)


def held_values(rows: torch.Tensor, layout: MLAKVLayout, dequant) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The BF16 values a pool of ``layout`` holds in ``rows`` (SGLang's own read)."""
    if layout.kind == "bf16":
        return rows.view(torch.bfloat16)
    if layout.kind == "fp8_e4m3":
        return rows.view(torch.float8_e4m3fn).to(torch.bfloat16)
    n = rows.shape[0]
    return dequant.dequantize_k_cache(rows.view(torch.float8_e4m3fn).view(n, 1, -1)).view(n, -1)


def run_case(model: str, src_kind: str, dst_kind: str, tokens: int, quant, dequant) -> dict:  # type: ignore[no-untyped-def]
    layers, dsa, index_bytes = MODELS[model]
    src, dst = MLAKVLayout(src_kind), MLAKVLayout(dst_kind)
    pool_pages = 4 * tokens // PAGE
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = MLAKVLayout("bf16")
    pool = []
    for _ in range(layers):
        values = (torch.randn(pool_pages * PAGE, 576, generator=g, device="cuda") * 4).to(
            torch.bfloat16)
        if src == bf16:
            pool.append(values.view(torch.uint8))
        else:
            pool.append(sglang_bytes(values, src, quant, dequant).contiguous())
        del values
    pages = [torch.randperm(pool_pages, generator=g, device="cuda")[: tokens // PAGE]
             for _ in range(2)]
    rows = [page_rows(p, PAGE) for p in pages]
    to = torch.arange(tokens, device="cuda")
    staging = torch.empty(layers * tokens * dst.token_bytes, dtype=torch.uint8, device="cuda")
    regions = list(staging.view(layers, tokens, dst.token_bytes).unbind(0))

    # Every byte against SGLang's own write of the values the prefill pool holds.
    convert_rows(pool, src, regions, dst, rows[0], to)
    exact = all(
        torch.equal(region, sglang_bytes(held_values(layer[rows[0]], src, dequant), dst,
                                         quant, dequant))
        for layer, region in zip(pool, regions, strict=True)
    )

    def call(i: int) -> None:
        convert_rows(pool, src, regions, dst, rows[i % 2], to)

    gpu_us = graph_time_us(call, sets=2)
    eager = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        call(i)
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1e3)
    eager_us = statistics.median(eager[5:])

    per_layer_bf16 = bf16.token_bytes + index_bytes
    per_layer_wire = dst.token_bytes + index_bytes
    moved = tokens * layers * (src.token_bytes + dst.token_bytes)
    row = {
        "model": model, "layers": layers, "tokens": tokens, "src": src_kind, "dst": dst_kind,
        "exact_vs_sglang": exact, "convert_gpu_us": round(gpu_us, 1),
        "convert_eager_us": round(eager_us, 1),
        "convert_gbps_read_write": round(moved / gpu_us / 1e3, 1),
        "bf16_wire_bytes": tokens * layers * per_layer_bf16,
        "wire_bytes": tokens * layers * per_layer_wire,
    }
    row["wire_bytes_saved"] = row["bf16_wire_bytes"] - row["wire_bytes"]
    for link in LINKS_GBPS:
        bf16_us = row["bf16_wire_bytes"] * 8 / (link * 1e9) * 1e6
        row[f"bf16_transfer_us_{link}g"] = round(bf16_us, 1)
        row[f"transfer_us_{link}g"] = round(row["wire_bytes"] * 8 / (link * 1e9) * 1e6, 1)
        row[f"convert_eager_vs_bf16_transfer_{link}g"] = round(eager_us / bf16_us, 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    quant = load(args.sglang_dir / "dsa_quant_k_cache.py", "sglang_dsa_quant_k_cache")
    dequant = load(args.sglang_dir / "dequant_k_cache.py", "sglang_dsa_dequant_k_cache")
    cases = [("kimi-k2", "bf16", "fp8_e4m3"), ("kimi-k2", "fp8_e4m3", "bf16"),
             ("glm-5", "bf16", "fp8_e4m3_dsa"), ("glm-5", "fp8_e4m3_dsa", "bf16")]
    rows = [run_case(m, s, d, args.tokens, quant, dequant) for m, s, d in cases]
    result = {
        "benchmark": "kv_handover",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python bench/kv_handover.py --sglang-dir SGLANG_SOURCES "
                   f"--tokens {args.tokens}",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_handover.json").write_text(json.dumps(result, indent=2) + "\n")
    head = (f"{'model':8} {'src->dst':22} {'exact':5} {'gpu us':>8} {'eager us':>9} "
            f"{'GB/s':>7} {'bf16 wire MB':>12} {'wire MB':>8} {'@400G us':>9} "
            f"{'conv/400G':>9} {'conv/100G':>9}")
    print(head)
    for r in rows:
        print(f"{r['model']:8} {r['src'] + '->' + r['dst']:22} {str(r['exact_vs_sglang']):5} "
              f"{r['convert_gpu_us']:8.1f} {r['convert_eager_us']:9.1f} "
              f"{r['convert_gbps_read_write']:7.1f} {r['bf16_wire_bytes'] / 1e6:12.1f} "
              f"{r['wire_bytes'] / 1e6:8.1f} {r['bf16_transfer_us_400g']:9.1f} "
              f"{r['convert_eager_vs_bf16_transfer_400g']:9.2%} "
              f"{r['convert_eager_vs_bf16_transfer_100g']:9.2%}")


if __name__ == "__main__":
    main()
