"""SGLang plugin: each phase keeps its own KV dtype; the prefill converts at the handover.

Installed into SGLang 0.5.23's PD classes (``sglang.srt.plugins`` entry point, every process):

Prefill (``MooncakeKVManager``):
- Its bootstrap registration carries ``tessera_kv_handover``; the bootstrap server keeps it and
  answers ``GET /tessera/kv_handover``, which is how a decode learns that this prefill converts.
- Each decode peer's registration (``_publish_peer_registration``) is paired entry by entry
  with this pool (``negotiate.plan_for_peer``). A peer with the same layout gets SGLang's raw
  path untouched; a convertible one gets a plan; anything else is rejected through SGLang's own
  ``state_layout_rejections``, so each of its requests fails with the reason and nothing is
  written.
- ``send_kvcache`` for a converting peer converts the chunk's pages, layer by layer, into a
  staging buffer registered with the transfer engine (pages renumbered 0..n-1, as SGLang's DCP
  pack buffers do) and hands that to SGLang's ``_send_kvcache_generic``: the peer's pages get
  the bytes its own write would have made, at its own stride, and the wire carries the peer's
  bytes (half the BF16 bytes for an FP8 decode).
- Ordering: the transfer worker calls ``send_kvcache`` only after SGLang's own wait on the
  forward (``wait_event``, the early send of cached prefixes); the conversion reads the pool at
  the point where the RDMA read would have, on a stream of its own, and is synchronized before
  the engine reads the staging. The engine's transfer is synchronous, so a staging buffer is
  free again when ``send_kvcache`` returns. One buffer per transfer worker; a chunk larger
  than a buffer goes in several rounds.

Decode (``CommonKVManager.try_ensure_parallel_info``, ``CommonKVReceiver.init``):
- A KV dtype that differs from the prefill's is accepted only when that prefill answers that it
  converts to this pool's dtype. SGLang raises inside the scheduler loop on any mismatch it
  finds there (dtype, page size, layout), which kills the decode scheduler; here each such
  refusal is remembered for that prefill instead, and each of its requests fails with the
  reason while the scheduler keeps serving.

Refused with a reason: conversion towards a decode with decode-context parallelism (its pack
path reads the pool directly), and a converting peer's HiSparse device destinations. SGLang's
KV checksum digests the pool bytes on each side: for a converting pair the two layouts differ,
so SGLang's own layout signature differs and the decode admits those requests unverified
(logged once per prefill layout); the operator does not turn the checksum on for such a pair.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import requests
import torch
from tessera.kernels.mla_kv_handover import MLAKVLayout, convert_rows, page_rows

from .negotiate import HandoverPlan, HandoverRefused, plan_for_peer, staging_bytes

log = logging.getLogger(__name__)

PAYLOAD_KEY = "tessera_kv_handover"
ROUTE = "/tessera/kv_handover"
_installed = False


def host_or_device_bytes(ptr: int, nbytes: int, device: str) -> torch.Tensor:
    """A uint8 tensor over memory SGLang registered (a pool layer), without copying."""
    if device == "cpu":
        array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        return torch.from_numpy(array)

    class _Interface:
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }

    return torch.as_tensor(_Interface(), device=device)


class Staging:
    """Registered staging buffers, one per transfer worker, handed out one per send."""

    def __init__(self, nbytes: int, count: int, device: str, register: Any) -> None:
        self.nbytes = nbytes
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
        for buf in self.buffers:
            register(buf.data_ptr(), nbytes)
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for buf in self.buffers:
            self._free.put(buf)
        self.stream = (
            [torch.cuda.Stream(device=device) for _ in range(count)] if device != "cpu" else None
        )

    @contextlib.contextmanager
    def take(self) -> Iterator[torch.Tensor]:
        buf = self._free.get()
        try:
            yield buf
        finally:
            self._free.put(buf)


class Handover:
    """The prefill side's state: its own layout facts, one plan per decode session, staging."""

    def __init__(self, mgr: Any) -> None:
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.runtime_context import get_device, get_schedule, max_prefill_buffer_tokens

        args = mgr.kv_args
        self.mgr = mgr
        self.dsa = StateType.DSA in (getattr(args, "state_types", None) or [])
        self.page_size = args.page_size
        self.dtype = args.kv_cache_dtype_str
        self.device = get_device().device or "cpu"
        chunk = max_prefill_buffer_tokens() or get_schedule().max_prefill_tokens
        self.chunk_tokens = -(-chunk // self.page_size) * self.page_size
        self.plans: dict[str, HandoverPlan] = {}
        self._staging: Staging | None = None
        self._lock = threading.Lock()
        self._pool_rows: list[torch.Tensor] | None = None

    def payload(self) -> dict[str, Any]:
        return {"kv_cache_dtype": self.dtype, "converts_to": ["bf16", "fp8_e4m3"]}

    def plan(self, session: str, registration: Any) -> HandoverPlan:
        peer = f"{registration.endpoint}:{registration.dst_port}"
        if registration.requires_dcp_relayout:
            raise HandoverRefused(
                f"decode {peer} uses decode-context parallelism, whose pack path reads this "
                "prefill's pool directly: give both pools the same KV dtype"
            )
        plan = plan_for_peer(
            kv_cache_dtype=self.dtype,
            item_lens=self.mgr.kv_args.kv_item_lens,
            page_size=self.page_size,
            dsa=self.dsa,
            peer_item_lens=registration.dst_kv_item_lens or [registration.dst_kv_item_len],
            peer=peer,
        )
        if plan.converts and not self.mgr.is_mla_backend:
            raise HandoverRefused(
                f"decode {peer} stores its KV in another dtype, and the handover converts MLA "
                "latents only (this model's K/V heads are split and scaled differently): give "
                "both pools the same KV dtype"
            )
        return plan

    def staging(self) -> Staging:
        with self._lock:
            if self._staging is None:
                args = self.mgr.kv_args
                nbytes = staging_bytes(
                    item_lens=args.kv_item_lens,
                    page_size=self.page_size,
                    kv_cache_dtype=self.dtype,
                    dsa=self.dsa,
                    chunk_tokens=self.chunk_tokens,
                    workers=1,
                )
                workers = len(self.mgr.transfer_queues)
                self._staging = Staging(nbytes, workers, self.device, self.mgr.engine.register)
                log.info("KV handover staging: %d x %d bytes", workers, nbytes)
            return self._staging

    def pool_rows(self, plan: HandoverPlan) -> list[torch.Tensor]:
        if self._pool_rows is None:
            args = self.mgr.kv_args
            self._pool_rows = [
                host_or_device_bytes(ptr, length, self.device).view(-1, layout.token_bytes)
                for ptr, length, layout in zip(
                    args.kv_data_ptrs, args.kv_data_lens, plan.src, strict=True)
            ]
        return self._pool_rows

    def send(
        self,
        plan: HandoverPlan,
        send_generic: Any,
        session: str,
        src_pages: np.ndarray,
        dst_kv_ptrs: list[int],
        dst_pages: np.ndarray,
        executor: Any,
        dst_layer_ids: list[int] | None,
    ) -> int:
        staging = self.staging()
        pool = self.pool_rows(plan)
        token_bytes = [d.token_bytes for d in plan.dst]
        page_bytes = sum(token_bytes) * self.page_size
        per_round = max(1, staging.nbytes // page_bytes)
        with staging.take() as buf:
            index = next(i for i, b in enumerate(staging.buffers) if b is buf)
            stream = staging.stream[index] if staging.stream else None
            for start in range(0, len(src_pages), per_round):
                pages = torch.from_numpy(np.asarray(src_pages[start : start + per_round]))
                ptrs = self._convert(plan, pool, buf, pages, token_bytes, stream)
                ret = send_generic(
                    mooncake_session_id=session,
                    src_data_ptrs=ptrs,
                    dst_data_ptrs=dst_kv_ptrs,
                    item_lens=[t * self.page_size for t in token_bytes],
                    prefill_data_indices=np.arange(len(pages), dtype=np.int32),
                    dst_data_indices=dst_pages[start : start + per_round],
                    executor=executor,
                    src_layer_ids=self.mgr.kv_args.kv_layer_ids,
                    dst_layer_ids=dst_layer_ids,
                )
                if ret != 0:
                    return ret
        return 0

    def _convert(
        self,
        plan: HandoverPlan,
        pool: list[torch.Tensor],
        buf: torch.Tensor,
        pages: torch.Tensor,
        token_bytes: list[int],
        stream: Any,
    ) -> list[int]:
        """Each entry's pages into its region of ``buf``, rows 0..n*page_size-1; the regions'
        addresses, once the conversion has finished. Entries of one layout pair (every
        layer of the model; a draft model's may differ) convert in one launch."""
        rows = page_rows(pages.to(buf.device), self.page_size)
        to = torch.arange(rows.numel(), device=buf.device)
        regions, offset = [], 0
        for width in token_bytes:
            regions.append(buf[offset : offset + rows.numel() * width].view(-1, width))
            offset += rows.numel() * width
        groups: dict[tuple[MLAKVLayout, MLAKVLayout], list[int]] = {}
        for i, pair in enumerate(zip(plan.src, plan.dst, strict=True)):
            groups.setdefault(pair, []).append(i)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for (src, dst), entries in groups.items():
                convert_rows([pool[i] for i in entries], src, [regions[i] for i in entries],
                             dst, rows, to)
        if stream is not None:
            stream.synchronize()
        return [region.data_ptr() for region in regions]


def _peer_converts(bootstrap_addr: str, decode_dtype: str) -> tuple[bool, str]:
    """Ask a prefill's bootstrap server whether it converts to ``decode_dtype``."""
    try:
        response = requests.get(f"http://{bootstrap_addr}{ROUTE}", timeout=5)
    except requests.RequestException as e:
        return False, f"could not ask it whether it converts ({e})"
    if response.status_code != 200:
        return False, "it does not convert KV at the handover (no tessera handover plugin)"
    converts_to = response.json().get("converts_to", [])
    if _dtype_kind(decode_dtype) not in converts_to:
        return False, f"it converts only to {converts_to}"
    return True, ""


def _dtype_kind(dtype: str) -> str:
    return "fp8_e4m3" if dtype.startswith("fp8") else "bf16"


def install() -> None:
    """Patch SGLang's PD classes (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    from aiohttp import web
    from sglang.srt.disaggregation.common import conn as common
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    _install_bootstrap(common.CommonKVBootstrapServer, web)
    _install_prefill(common.CommonKVManager, MooncakeKVManager)
    _install_decode(common.CommonKVManager, common.CommonKVReceiver, common.PrefillServerInfo)


def _install_bootstrap(server_cls: Any, web: Any) -> None:
    setup_routes, route_put = server_cls._setup_routes, server_cls._handle_route_put

    def _setup_routes(self: Any) -> None:
        setup_routes(self)
        self.app.router.add_get(ROUTE, self._tessera_handover_route)

    async def _handle_route_put(self: Any, request: Any) -> Any:
        data = await request.json()
        if data.get(PAYLOAD_KEY) is not None:
            self.tessera_kv_handover = data[PAYLOAD_KEY]
        return await route_put(self, request)

    async def _tessera_handover_route(self: Any, request: Any) -> Any:
        info = getattr(self, "tessera_kv_handover", None)
        if info is None:
            return web.Response(text="this prefill does not convert KV", status=404)
        return web.json_response(info)

    server_cls._setup_routes = _setup_routes
    server_cls._handle_route_put = _handle_route_put
    server_cls._tessera_handover_route = _tessera_handover_route


def _install_prefill(common_cls: Any, mooncake_cls: Any) -> None:
    register_row = common_cls._register_topology_row
    publish, send_kvcache = mooncake_cls._publish_peer_registration, mooncake_cls.send_kvcache

    def handover(self: Any) -> Handover:
        if getattr(self, "_tessera_handover", None) is None:
            self._tessera_handover = Handover(self)
        return self._tessera_handover

    def _register_topology_row(self: Any, url: str, payload: dict[str, Any]) -> None:
        register_row(self, url, {**payload, PAYLOAD_KEY: handover(self).payload()})

    def _publish_peer_registration(self: Any, session: str, registration: Any) -> str | None:
        mismatch = publish(self, session, registration)
        if mismatch is not None:
            return mismatch
        try:
            plan = handover(self).plan(session, registration)
        except HandoverRefused as e:
            reason = f"KV handover refused: {e}"
            log.error("%s", reason)
            with self.session_lock:
                self.state_layout_rejections[session] = reason
            return reason
        handover(self).plans[session] = plan
        if plan.converts:
            log.info("KV handover to %s converts: %s", session, plan)
        return None

    def _send_kvcache(
        self: Any,
        mooncake_session_id: str,
        prefill_kv_indices: np.ndarray,
        dst_kv_ptrs: list[int],
        dst_kv_indices: np.ndarray,
        executor: Any,
        dst_layer_ids: list[int] | None = None,
        dst_device_kv_indices: np.ndarray | None = None,
        **kwargs: Any,
    ) -> int:
        plan = handover(self).plans.get(mooncake_session_id)
        if plan is None or not plan.converts:
            return send_kvcache(
                self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices,
                executor, dst_layer_ids=dst_layer_ids,
                dst_device_kv_indices=dst_device_kv_indices, **kwargs,
            )
        if dst_device_kv_indices is not None:
            log.error("KV handover: HiSparse device destinations cannot take converted pages")
            return -1
        return handover(self).send(
            plan, self._send_kvcache_generic, mooncake_session_id, prefill_kv_indices,
            dst_kv_ptrs, dst_kv_indices, executor, dst_layer_ids,
        )

    common_cls._register_topology_row = _register_topology_row
    mooncake_cls._publish_peer_registration = _publish_peer_registration
    mooncake_cls.send_kvcache = _send_kvcache


def _install_decode(common_cls: Any, receiver_cls: Any, info_cls: Any) -> None:
    ensure, receiver_init = common_cls.try_ensure_parallel_info, receiver_cls.init

    def try_ensure_parallel_info(self: Any, bootstrap_addr: str) -> bool:
        if bootstrap_addr in self.prefill_info_table:
            return True
        url = (
            f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
            "&target_tp_rank=-1&target_pp_rank=-1"
        )
        try:
            response = requests.get(url, timeout=5)
        except requests.RequestException as e:
            log.warning("prefill %s bootstrap not reachable yet: %s", bootstrap_addr, e)
            return False  # the scheduler asks again, as with SGLang's own check
        if response.status_code != 200:
            log.warning("prefill %s not ready: %s %s", bootstrap_addr, response.status_code,
                        response.text)
            return False
        info = info_cls(**response.json())
        mine = self.kv_cache_dtype_str
        prefill_dtype = info.kv_cache_dtype
        differ = prefill_dtype is not None and _dtype_kind(prefill_dtype) != _dtype_kind(mine)
        try:
            if not differ:  # SGLang's own check, as it is (it tells e4m3 from e5m2)
                return ensure(self, bootstrap_addr)
            converts, why = _peer_converts(bootstrap_addr, mine)
            if not converts:
                raise RuntimeError(
                    f"KV cache dtype mismatch: prefill {bootstrap_addr} has "
                    f"kv_cache_dtype={prefill_dtype}, this decode has kv_cache_dtype={mine}, "
                    f"and {why}"
                )
            # The prefill converts to this pool's layout: SGLang's equality check would
            # refuse it, so it sees the prefill's own dtype for that one comparison.
            self.kv_cache_dtype_str = prefill_dtype
            try:
                return ensure(self, bootstrap_addr)
            finally:
                self.kv_cache_dtype_str = mine
        except RuntimeError as e:
            # SGLang raises these inside the scheduler loop; remember the refusal instead and
            # fail that prefill's requests (CommonKVReceiver.init below).
            reason = f"PD pairing refused (prefill {bootstrap_addr}, decode {mine}): {e}"
            log.error("%s", reason)
            info.tessera_refusal = reason
            self.prefill_info_table[bootstrap_addr] = info
            return True

    def init(self: Any, prefill_dp_rank: int) -> None:
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        reason = getattr(info, "tessera_refusal", None)
        if reason is None:
            return receiver_init(self, prefill_dp_rank)
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed
        return None

    common_cls.try_ensure_parallel_info = try_ensure_parallel_info
    receiver_cls.init = init


def register(env: Mapping[str, str] = os.environ) -> None:
    """Entry point: install when tessera runs this engine in a PD pool (both roles: a decode
    must accept a converting prefill, a prefill must convert for its decodes)."""
    from tessera.runtime.config import ENV_CONFIG, RuntimeConfig

    if not env.get(ENV_CONFIG):
        return  # SGLang started without tessera: nothing to do
    if RuntimeConfig.from_env(dict(env)).phase in ("prefill", "decode"):
        install()


def installed() -> bool:
    return _installed
