"""One PD peer for the Mooncake handover test: SGLang's real MooncakeKVManager on host memory.

Run as ``python kv_handover_peer.py SPEC.json``; SPEC names the role, the attention (an MLA pool,
or a DSA pool with its indexer keys), the KV dtype, the ports and the requests. The KV of every
token is a function of (layer, prefill slot), written into SGLang's own ``MLATokenToKVPool`` /
``DSATokenToKVPool`` by SGLang's own write. A decode writes a JSON report: per request, the
status, the failure reason, whether its pages hold exactly the bytes SGLang's own write would
have put there for the values the prefill holds, and (DSA) whether its indexer keys are the
prefill's.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("TRITON_INTERPRET", "1")  # the prefill's conversion kernel, on the CPU
os.environ.setdefault("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "600")
os.environ.setdefault("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "600")

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYERS = 3
AUX_BYTES = 64
# Pool geometry per attention kind: (page tokens, pool tokens, latent, rope). DSA pools take
# 64-token pages and a 64-value rope (FlashMLA's FP8 layout); MLA is the tiny DeepSeek V3 config.
GEOMETRY = {"mla": (4, 256, 128, 16), "dsa": (64, 64 * 12, 128, 64)}
ATTENTION = "mla"
PAGE, SLOTS, NOPE, ROPE = GEOMETRY["mla"]


class _Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


def token_values(layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The K latent+rope a prefill computed for these slots (BF16, some beyond e4m3's range)."""
    g = torch.Generator().manual_seed(1000 + layer)
    table = torch.randn(SLOTS, 1, NOPE + ROPE, generator=g) * 40
    return table[slots].to(torch.bfloat16)


def make_pool(dtype: str):  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool

    fp8 = dtype == "fp8_e4m3"
    torch_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if ATTENTION == "dsa":
        return DSATokenToKVPool(
            size=SLOTS, page_size=PAGE, kv_lora_rank=NOPE, dtype=torch_dtype,
            qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=NOPE + 4 * (NOPE // 128) + 2 * ROPE if fp8 else NOPE + ROPE,
        )
    return MLATokenToKVPool(
        size=SLOTS, page_size=PAGE, dtype=torch_dtype, kv_lora_rank=NOPE,
        qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
    )


def write_tokens(pool, slots: torch.Tensor, values_of) -> None:  # type: ignore[no-untyped-def]
    """SGLang's own write of the token values: the one its attention backends use per kind."""
    for layer in range(LAYERS):
        k = values_of(layer, slots)
        if ATTENTION == "dsa":
            pool.set_mla_kv_buffer(_Layer(layer), slots, k[..., :NOPE], k[..., NOPE:])
        else:
            pool.set_kv_buffer(_Layer(layer), slots, k, None)


def index_keys(pool, pages: list[int]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A DSA pool's indexer-key bytes of ``pages``, per layer (FP8 in every KV dtype)."""
    return [buf[torch.tensor(pages)] for buf in pool.index_k_with_scale_buffer]


def fill_index_keys(pool) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(77)
    for buf in pool.index_k_with_scale_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))


def held_values(dtype: str):  # type: ignore[no-untyped-def]
    """What a prefill pool of ``dtype`` holds for the token values, as BF16 values."""
    def values(layer: int, slots: torch.Tensor) -> torch.Tensor:
        src = make_pool(dtype)
        write_tokens(src, slots, lambda lyr, s: token_values(lyr, s))
        assert ATTENTION == "mla" or dtype == "bf16", "a DSA FP8 prefill's values: dequantize"
        return src.get_key_buffer(layer)[slots].to(torch.bfloat16)

    return values


def setup(spec: dict):  # type: ignore[no-untyped-def]
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs
    from tessera.runtime.kv_handover import sglang_plugin

    if spec["plugin"]:
        sglang_plugin.install()
    server_args = ServerArgs(
        model_path=spec["model"], device="cpu", host="127.0.0.1", skip_tokenizer_init=True,
        disaggregation_mode=spec["role"], disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=spec["bootstrap_port"], page_size=PAGE,
        kv_cache_dtype=spec["dtype"], chunked_prefill_size=spec.get("chunk_tokens", 16),
        max_prefill_tokens=spec.get("chunk_tokens", 16), tp_size=spec.get("tp_size", 1),
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=spec.get("tp_rank", 0)))
    get_parallel().override_permanently(pp_group=None)  # one stage: no pipeline group built
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    if spec["role"] == "prefill":
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

        MooncakeKVBootstrapServer(host="127.0.0.1", port=spec["bootstrap_port"])
    pool = make_pool(spec["dtype"])
    aux = torch.zeros(SLOTS, AUX_BYTES, dtype=torch.uint8)
    from sglang.srt.disaggregation.mooncake.conn import KVArgs

    args = KVArgs()
    args.engine_rank = spec.get("tp_rank", 0)
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.rust_http_port = None
    args.kv_cache_dtype_str = spec["dtype"]
    args.kv_layout = None
    args.prefill_start_layer = 0
    args.prefill_end_layer = LAYERS
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.num_draft_entries = 0
    args.kv_layer_ids = list(range(LAYERS))
    args.page_size = PAGE
    args.aux_data_ptrs = [aux.data_ptr()]
    args.aux_data_lens = [aux.nbytes]
    args.aux_item_lens = [AUX_BYTES]
    args.ib_device = None
    args.gpu_id = 0
    args.mla_compression_ratios = None
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    setup_state_kv_args(args, pool, None, LAYERS)  # SGLang's own: a DSA pool's indexer keys
    mode = DisaggregationMode.PREFILL if spec["role"] == "prefill" else DisaggregationMode.DECODE
    mgr = MooncakeKVManager(args, mode, server_args, is_mla_backend=True)
    return mgr, pool, aux


def run_prefill(spec: dict) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    mgr, pool, aux = setup(spec)
    write_tokens(pool, torch.arange(PAGE, SLOTS), token_values)
    if ATTENTION == "dsa":
        fill_index_keys(pool)
    addr = f"127.0.0.1:{spec['bootstrap_port']}"

    def serve(req: dict) -> None:
        pages = np.array(req["prefill_pages"], dtype=np.int32)
        aux_index = req["room"] % SLOTS
        aux[aux_index] = req["room"] % 251
        sender = MooncakeKVSender(mgr, addr, req["room"])
        sender.init(len(pages), aux_index)
        deadline = time.time() + 600  # until its decode has started and asked for it
        while sender.poll() == KVPoll.Bootstrapping and time.time() < deadline:
            time.sleep(0.05)
        step = req["pages_per_chunk"]
        for start in range(0, len(pages), step):
            if sender.poll() == KVPoll.Failed:
                break
            state = [pages] if ATTENTION == "dsa" else None  # the indexer keys' pages
            sender.send(pages[start : start + step], state_indices=state)
            time.sleep(req.get("chunk_gap_s", 0.0))  # a prefill computes between chunks

    threads = [threading.Thread(target=serve, args=(r,)) for r in spec["requests"]]
    for t in threads:
        t.start()
    print("PREFILL READY", flush=True)
    for t in threads:
        t.join()
    Path(spec["done_file"]).touch()
    while True:  # keep serving the bootstrap and the transfer until the test ends
        time.sleep(1)


def run_decode(spec: dict) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    mgr, pool, aux = setup(spec)
    report = []
    for req in spec["requests"]:  # one after another, as one decode scheduler would
        addr = req["bootstrap_addr"]
        receiver = MooncakeKVReceiver(mgr, addr, req["room"])
        deadline = time.time() + 300  # the prefills may still be starting
        while not mgr.try_ensure_parallel_info(addr) and time.time() < deadline:
            time.sleep(0.5)
        receiver.init(0)
        pages = np.array(req["decode_pages"], dtype=np.int32)
        aux_index = req["room"] % SLOTS
        if receiver.poll() != KVPoll.Failed:
            receiver.send_metadata(pages, aux_index, [pages] if ATTENTION == "dsa" else None)
        status = receiver.poll()
        sent = time.time()  # a loaded CI machine converts slowly under the Triton interpreter
        while status not in (KVPoll.Success, KVPoll.Failed) and time.time() < sent + 300:
            if req.get("abort_after_s") is not None and time.time() > sent + req["abort_after_s"]:
                receiver.abort()
            time.sleep(0.05)
            status = receiver.poll()
        reason = None
        if status == KVPoll.Failed:
            try:
                receiver.failure_exception()
            except Exception as e:  # KVTransferError carries the reason
                reason = str(e)
        entry = {"room": req["room"], "status": int(status), "reason": reason}
        if status == KVPoll.Success:
            prefill_slots = torch.tensor(
                [p * PAGE + i for p in req["prefill_pages"] for i in range(PAGE)]
            )
            decode_slots = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
            expected = make_pool(spec["dtype"])
            held = held_values(req["prefill_dtype"])
            write_tokens(expected, decode_slots,
                         lambda layer, _, h=held, src=prefill_slots: h(layer, src))
            entry["exact"] = all(
                torch.equal(pool.kv_buffer[layer][decode_slots],
                            expected.kv_buffer[layer][decode_slots])
                for layer in range(LAYERS)
            )
            entry["aux"] = int(aux[aux_index, 0])
            if ATTENTION == "dsa":
                prefill = make_pool(req["prefill_dtype"])
                fill_index_keys(prefill)
                entry["index_keys"] = all(
                    torch.equal(a, b) for a, b in zip(
                        index_keys(pool, list(pages)),
                        index_keys(prefill, req["prefill_pages"]), strict=True)
                )
        report.append(entry)
    Path(spec["report"]).write_text(json.dumps(report))
    print("DECODE DONE", flush=True)


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    ATTENTION = spec.get("attention", "mla")
    PAGE, SLOTS, NOPE, ROPE = GEOMETRY[ATTENTION]
    PAGE = spec.get("page", PAGE)
    (run_prefill if spec["role"] == "prefill" else run_decode)(spec)
