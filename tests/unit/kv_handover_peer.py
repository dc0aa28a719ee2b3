"""One PD peer for the Mooncake handover test: SGLang's real MooncakeKVManager on host memory.

Run as ``python kv_handover_peer.py SPEC.json``; SPEC names the role, the KV dtype, the ports and
the requests. The KV of every token is a function of (layer, prefill slot), written into an
SGLang ``MLATokenToKVPool`` by SGLang's own ``set_kv_buffer``. A decode writes a JSON report:
per request, the status, the failure reason, and whether its pages hold exactly the bytes
SGLang's own write would have put there for the values the prefill holds.
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
os.environ.setdefault("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "120")

import numpy as np  # noqa: E402
import torch  # noqa: E402

PAGE = 4
LAYERS = 3
SLOTS = 256  # pool tokens
NOPE, ROPE = 128, 16  # the tiny DeepSeek V3 config's latent and rope widths
AUX_BYTES = 64


class _Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


def token_values(layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The K latent+rope a prefill computed for these slots (BF16, some beyond e4m3's range)."""
    g = torch.Generator().manual_seed(1000 + layer)
    table = torch.randn(SLOTS, 1, NOPE + ROPE, generator=g) * 40
    return table[slots].to(torch.bfloat16)


def make_pool(dtype: str):  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    torch_dtype = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.bfloat16
    return MLATokenToKVPool(
        size=SLOTS, page_size=PAGE, dtype=torch_dtype, kv_lora_rank=NOPE,
        qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
    )


def write_tokens(pool, slots: torch.Tensor, values_of) -> None:  # type: ignore[no-untyped-def]
    for layer in range(LAYERS):
        pool.set_kv_buffer(_Layer(layer), slots, values_of(layer, slots), None)


def held_values(dtype: str):  # type: ignore[no-untyped-def]
    """What a prefill pool of ``dtype`` holds for the token values, as BF16 values."""
    def values(layer: int, slots: torch.Tensor) -> torch.Tensor:
        src = make_pool(dtype)
        write_tokens(src, slots, lambda lyr, s: token_values(lyr, s))
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
        max_prefill_tokens=spec.get("chunk_tokens", 16),
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
    args.engine_rank = 0
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
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens",
                 "state_dim_per_tensor", "state_slice_outer_counts", "state_layer_ids",
                 "state_conv_shard_groups"):
        setattr(args, name, [])
    args.is_hybrid_mla_backend = False
    args.swa_kv_cache_layout = None
    mode = DisaggregationMode.PREFILL if spec["role"] == "prefill" else DisaggregationMode.DECODE
    mgr = MooncakeKVManager(args, mode, server_args, is_mla_backend=True)
    return mgr, pool, aux


def run_prefill(spec: dict) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    mgr, pool, aux = setup(spec)
    write_tokens(pool, torch.arange(PAGE, SLOTS), token_values)
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
            sender.send(pages[start : start + step])
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
        deadline = time.time() + 60
        receiver.init(0)
        pages = np.array(req["decode_pages"], dtype=np.int32)
        aux_index = req["room"] % SLOTS
        if receiver.poll() != KVPoll.Failed:
            receiver.send_metadata(pages, aux_index, None)
        status = receiver.poll()
        while status not in (KVPoll.Success, KVPoll.Failed) and time.time() < deadline:
            if req.get("abort_after_s") is not None and time.time() > deadline - 60 + req[
                "abort_after_s"
            ]:
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
            write_tokens(expected, decode_slots, lambda layer, s: held(layer, prefill_slots))
            entry["exact"] = all(
                torch.equal(pool.kv_buffer[layer][decode_slots],
                            expected.kv_buffer[layer][decode_slots])
                for layer in range(LAYERS)
            )
            entry["aux"] = int(aux[aux_index, 0])
        report.append(entry)
    Path(spec["report"]).write_text(json.dumps(report))
    print("DECODE DONE", flush=True)


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    (run_prefill if spec["role"] == "prefill" else run_decode)(spec)
