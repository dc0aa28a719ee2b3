"""The PD handover through SGLang's real Mooncake transfer, two pools per KV dtype, on loopback.

Ten processes run SGLang 0.5.23's own ``MooncakeKVManager`` (sender, receiver, bootstrap
server) over Mooncake's TCP transport on host memory: a BF16 and an FP8 prefill, a BF16 and an
FP8 decode, a prefill without the plugin, a DSA pair (BF16 prefill, FP8 decode), the two ranks
of an FP8 decode at TP 2, and a decode on other pages; all but one with the tessera handover
plugin. Each decode takes requests from both prefills (BF16->FP8, FP8->BF16, BF16->BF16,
FP8->FP8), in several chunks, and must hold exactly the bytes SGLang's own ``set_kv_buffer``
writes for the values the prefill holds. A request is aborted halfway; a prefill that does not
convert, and prefills on other pages, are refused with a reason naming both sides; the decode
serves the next request after each. The DSA decode holds SGLang's own packed FP8 latents and the
prefill's indexer keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda")
pytest.importorskip("sglang.srt.disaggregation.mooncake.conn", reason="needs SGLang (no deps)")

from stores import free_port  # noqa: E402
from tessera.runtime.quantize.synthetic import TINY_CONFIGS  # noqa: E402

PEER = Path(__file__).with_name("kv_handover_peer.py")
SUCCESS, FAILED = 4, 0


def _pages(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def _start(tmp: Path, name: str, spec: dict) -> subprocess.Popen:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.Popen([sys.executable, str(PEER), str(path)], stdout=log, stderr=log, env=env)


@pytest.fixture(scope="module")
def handover(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("handover")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({**TINY_CONFIGS["deepseek-v3"], "torch_dtype": "bfloat16"})
    )
    ports = {name: free_port() for name in ("bf16", "fp8", "plain", "dsa")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    # (room, prefill, decode, prefill pages, decode pages, pages per chunk)
    plan = [
        (11, "bf16", "fp8_e4m3", _pages(1, 12), _pages(40, 12), 4),
        (12, "fp8", "bf16", _pages(1, 9), _pages(20, 9), 2),
        (13, "bf16", "bf16", _pages(14, 5), _pages(2, 5), 5),
        (14, "fp8", "fp8_e4m3", _pages(20, 7), _pages(3, 7), 3),
        (15, "bf16", "bf16", _pages(30, 6), _pages(50, 6), 3),  # to the FP8 decode's twin
        (16, "fp8", "fp8_e4m3", _pages(30, 4), _pages(20, 4), 1),
    ]
    decode_requests: dict[str, list] = {"bf16": [], "fp8_e4m3": []}
    prefill_requests: dict[str, list] = {"bf16": [], "fp8": []}
    for room, prefill, decode, ppages, dpages, per_chunk in plan:
        prefill_dtype = "bf16" if prefill == "bf16" else "fp8_e4m3"
        prefill_requests[prefill].append(
            {"room": room, "prefill_pages": ppages, "pages_per_chunk": per_chunk}
        )
        decode_requests[decode].append(
            {"room": room, "bootstrap_addr": addr[prefill], "prefill_pages": ppages,
             "decode_pages": dpages, "prefill_dtype": prefill_dtype}
        )
    # An FP8 decode aborts a long BF16 request halfway, then asks a prefill that does not
    # convert (it registered without the handover plugin), then serves one more request.
    prefill_requests["bf16"].append(
        {"room": 21, "prefill_pages": _pages(40, 16), "pages_per_chunk": 1, "chunk_gap_s": 0.5}
    )
    decode_requests["fp8_e4m3"] += [
        {"room": 21, "bootstrap_addr": addr["bf16"], "prefill_pages": _pages(40, 16),
         "decode_pages": _pages(10, 16), "prefill_dtype": "bf16", "abort_after_s": 2.0},
        {"room": 22, "bootstrap_addr": addr["plain"], "prefill_pages": _pages(1, 2),
         "decode_pages": _pages(30, 2), "prefill_dtype": "bf16"},
        {"room": 23, "bootstrap_addr": addr["bf16"], "prefill_pages": _pages(60, 3),
         "decode_pages": _pages(33, 3), "prefill_dtype": "bf16"},
    ]
    prefill_requests["bf16"].append(
        {"room": 23, "prefill_pages": _pages(60, 3), "pages_per_chunk": 2}
    )
    # A decode at twice the prefill's tensor parallelism: both of its ranks take the request
    # (MLA latents are replicated over the ranks), each converted for itself.
    prefill_requests["bf16"].append(
        {"room": 41, "prefill_pages": _pages(50, 5), "pages_per_chunk": 2}
    )
    tp2_request = {"room": 41, "bootstrap_addr": addr["bf16"], "prefill_pages": _pages(50, 5),
                   "decode_pages": [9, 3, 12, 20, 7], "prefill_dtype": "bf16"}
    procs = []
    try:
        for name, dtype in (("bf16", "bf16"), ("fp8", "fp8_e4m3")):
            procs.append(_start(tmp, f"prefill-{name}", {
                "role": "prefill", "dtype": dtype, "plugin": True, "model": str(model),
                "bootstrap_port": ports[name], "requests": prefill_requests[name],
                "done_file": str(tmp / f"prefill-{name}.done"),
            }))
        procs.append(_start(tmp, "prefill-plain", {
            "role": "prefill", "dtype": "bf16", "plugin": False, "model": str(model),
            "bootstrap_port": ports["plain"], "requests": [],
            "done_file": str(tmp / "prefill-plain.done"),
        }))
        # A DSA model (GLM 5's pool): BF16 latents become FlashMLA's packed FP8, the indexer
        # keys (SGLang's state buffers) go as they are; chunks of one 64-token page.
        procs.append(_start(tmp, "prefill-dsa", {
            "role": "prefill", "attention": "dsa", "dtype": "bf16", "plugin": True,
            "model": str(model), "bootstrap_port": ports["dsa"],
            "requests": [{"room": 31, "prefill_pages": [1, 2, 3], "pages_per_chunk": 1},
                         {"room": 32, "prefill_pages": [5, 9], "pages_per_chunk": 2}],
            "done_file": str(tmp / "prefill-dsa.done"),
        }))
        reports = {}
        decodes = {}
        decode_requests["dsa"] = [
            {"room": 31, "bootstrap_addr": addr["dsa"], "prefill_pages": [1, 2, 3],
             "decode_pages": [4, 8, 2], "prefill_dtype": "bf16"},
            {"room": 32, "bootstrap_addr": addr["dsa"], "prefill_pages": [5, 9],
             "decode_pages": [10, 11], "prefill_dtype": "bf16"},
        ]
        decode_requests["tp2-0"] = decode_requests["tp2-1"] = [tp2_request]
        # A decode on 8-token pages: SGLang's own page-size check refuses both prefills; the
        # plugin turns its raise (in the scheduler loop) into two failed requests.
        decode_requests["page8"] = [
            {"room": 51, "bootstrap_addr": addr["bf16"], "prefill_pages": [1],
             "decode_pages": [1], "prefill_dtype": "bf16"},
            {"room": 52, "bootstrap_addr": addr["fp8"], "prefill_pages": [1],
             "decode_pages": [2], "prefill_dtype": "fp8_e4m3"},
        ]
        tp2_port = free_port()
        for name, dtype, attention in (("bf16", "bf16", "mla"), ("fp8_e4m3", "fp8_e4m3", "mla"),
                                       ("dsa", "fp8_e4m3", "dsa"), ("tp2-0", "fp8_e4m3", "mla"),
                                       ("tp2-1", "fp8_e4m3", "mla"),
                                       ("page8", "fp8_e4m3", "mla")):
            reports[name] = tmp / f"decode-{name}.report"
            tp = {"tp_size": 2, "tp_rank": int(name[-1]), "bootstrap_port": tp2_port} if (
                name.startswith("tp2")) else {"bootstrap_port": free_port()}
            if name == "page8":
                tp["page"] = 8
            decodes[name] = _start(tmp, f"decode-{name}", {
                "role": "decode", "attention": attention, "dtype": dtype, "plugin": True,
                "model": str(model), "requests": decode_requests[name],
                "report": str(reports[name]), **tp,
            })
            procs.append(decodes[name])
        deadline = time.time() + 900
        for proc in decodes.values():
            while proc.poll() is None and time.time() < deadline:
                time.sleep(1)
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log"))
        )
        results = {}
        for name, path in reports.items():
            assert path.exists(), f"decode {name} wrote no report\n{logs}"
            for entry in json.loads(path.read_text()):
                key = f"{entry['room']}@{name}" if name.startswith("tp2") else entry["room"]
                results[key] = entry
        return {"results": results, "logs": logs}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "room", [11, 12, 13, 14, 15, 16, 23],
    ids=["bf16->fp8", "fp8->bf16", "bf16->bf16", "fp8->fp8", "bf16->bf16b", "fp8->fp8b",
         "after-abort-and-refusal"],
)
def test_pages_hold_sglangs_own_bytes(handover: dict, room: int) -> None:
    entry = handover["results"][room]
    assert entry["status"] == SUCCESS, f"{entry}\n{handover['logs']}"
    assert entry["exact"], f"room {room}: decode pages differ from SGLang's own write"
    assert entry["aux"] == room % 251  # the request's metadata came with its last chunk


@pytest.mark.parametrize("room", [31, 32], ids=["3-chunks", "1-chunk"])
def test_dsa_pages_hold_sglangs_packed_fp8_and_the_prefills_indexer_keys(
        handover: dict, room: int) -> None:
    entry = handover["results"][room]
    assert entry["status"] == SUCCESS, f"{entry}\n{handover['logs']}"
    assert entry["exact"], "decode latents differ from SGLang's own FP8 DSA write"
    assert entry["index_keys"], "decode indexer keys differ from the prefill's"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_decode_at_twice_the_prefills_tp_gets_sglangs_bytes_on_every_rank(
        handover: dict, rank: int) -> None:
    entry = handover["results"][f"41@tp2-{rank}"]
    assert entry["status"] == SUCCESS, f"{entry}\n{handover['logs']}"
    assert entry["exact"] and entry["aux"] == 41


def test_aborted_request_fails_and_the_decode_goes_on(handover: dict) -> None:
    entry = handover["results"][21]
    assert entry["status"] == FAILED
    assert "Aborted" in (entry["reason"] or "")
    assert handover["results"][23]["status"] == SUCCESS


@pytest.mark.parametrize("room", [51, 52])
def test_sglangs_own_pairing_errors_fail_the_request_not_the_decode(
        handover: dict, room: int) -> None:
    entry = handover["results"][room]
    assert entry["status"] == FAILED
    reason = entry["reason"] or ""
    assert "PD pairing refused (prefill 127.0.0.1:" in reason and "Page size mismatch" in reason


def test_prefill_without_conversion_is_refused_by_name(handover: dict) -> None:
    entry = handover["results"][22]
    assert entry["status"] == FAILED
    reason = entry["reason"] or ""
    assert "prefill 127.0.0.1:" in reason and "kv_cache_dtype=bf16" in reason
    assert "kv_cache_dtype=fp8_e4m3" in reason and "does not convert" in reason
