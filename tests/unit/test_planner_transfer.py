"""The KV handover's cost per request: wire bytes per KV pairing, time at the link speed, and
the table `tessera plan` prints beside the capacity tables, for the examples too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tessera.runtime.planner import PlanError, plan_deployment, resolve_architecture
from tessera.runtime.planner.transfer import (
    TRANSFER_PROMPTS,
    plan_transfers,
    transfer_prompts,
    wire_bytes_per_token,
)

from tessera.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*/modeldeployment.yaml"))
KIMI = resolve_architecture("kimi-k2", {})
GLM = resolve_architecture("glm-5", {})


def spec(prefill_kv: str = "bf16", decode_kv: str = "bf16", **transfer) -> dict:
    return {"model": {"name": "m", "architecture": {"preset": "kimi-k2"}, "contextLength": 8192},
            "prefill": {"weights": {"dtype": "fp8"}, "kvCache": {"dtype": prefill_kv}},
            "decode": {"weights": {"dtype": "int4"}, "kvCache": {"dtype": decode_kv}},
            **({"transfer": transfer} if transfer else {})}


def transfers(spec_: dict):
    return plan_transfers(spec_, plan_deployment(spec_))


def test_kimi_bf16_at_8k_by_hand():
    # 61 layers x (512 latent + 64 rope) x 2 bytes: each decode GPU pulls the whole MLA latent
    # (replicated over attention TP) over its own link.
    assert wire_bytes_per_token(KIMI, "bf16", 8) == wire_bytes_per_token(KIMI, "bf16", 1)
    assert wire_bytes_per_token(KIMI, "bf16", 8) == 61 * 576 * 2 == 70_272
    [bf16, fp8] = transfers(spec())
    assert bf16.bytes_for(8192) == 61 * 576 * 2 * 8192 == 575_668_224  # ~576 MB
    assert bf16.seconds_for(8192) == pytest.approx(11.513e-3, rel=1e-3)  # at 400 Gb/s
    assert bf16.tokens_per_second == pytest.approx(400e9 / 8 / 70_272)
    # The prefill converts to the decode's FP8 before sending: half the bytes and the time.
    assert (fp8.prefill_kv, fp8.decode_kv) == ("bf16", "fp8_e4m3")
    assert fp8.bytes_for(8192) * 2 == bf16.bytes_for(8192)


def test_dsa_models_send_their_indexer_keys():
    # GLM 5: per layer the latent (BF16 576 x 2, or FP8's 656-byte layout) plus the FP8
    # indexer key (128 values + one FP32 scale), 78 layers.
    assert wire_bytes_per_token(GLM, "bf16", 8) == 78 * (576 * 2 + 128 + 4) == 100_152
    assert wire_bytes_per_token(GLM, "fp8_e4m3", 8) == 78 * (656 + 128 + 4) == 61_464


def test_gqa_heads_split_over_the_decode_links():
    # 8 KV heads of 128 over 4 attention-TP ranks (TP 8, attention DP 2): 2 heads a link.
    gqa = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    s = spec()
    s["model"]["architecture"] = {"config": gqa}
    s["decode"].update(tensorParallel=8, attentionDataParallel=2)
    [bf16, _] = transfers(s)
    assert bf16.wire_bytes_per_token == 32 * 2 * 2 * 128 * 2  # layers x K,V x heads x dim x 2 B


def test_the_spec_pairing_comes_first_and_the_link_is_declared():
    planned = transfers(spec("bf16", "fp8_e4m3", linkGbps=100, backend="nixl"))
    assert [(t.prefill_kv, t.decode_kv) for t in planned] == [("bf16", "fp8_e4m3"),
                                                              ("bf16", "bf16")]
    assert {(t.link_gbps, t.backend) for t in planned} == {(100.0, "nixl")}
    assert planned[0].seconds_for(8192) == pytest.approx(4 * 11.513e-3 / 2, rel=1e-3)


def test_a_single_pool_hands_nothing_over():
    single = {"model": {"name": "m", "architecture": {"preset": "kimi-k2"}},
              "single": {"weights": {"dtype": "fp8"}}}
    assert transfers(single) == []


@pytest.mark.parametrize("link", [0, -5, "fast", True])
def test_a_bad_link_speed_is_a_plan_error(link):
    with pytest.raises(PlanError, match="spec.transfer.linkGbps must be a positive number"):
        transfers(spec(linkGbps=link))


def test_prompt_lengths_include_the_context_length():
    assert transfer_prompts(65536) == (8192, 32768, 65536, 131072)
    assert transfer_prompts(8192) == TRANSFER_PROMPTS


def write(tmp_path: Path, spec_: dict) -> Path:
    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump({"kind": "ModelDeployment", "metadata": {"name": "k"},
                                    "spec": spec_}))
    return path


def test_plan_prints_the_handover_beside_the_capacity_tables(tmp_path, capsys):
    assert main(["plan", str(write(tmp_path, spec()))]) == 0
    out = capsys.readouterr().out
    handover = out[out.index("KV handover"):].splitlines()
    assert "mooncake over 400 Gb/s" in handover[0]
    assert handover[1].split() == ["*KV", "bf16", "->", "bf16", "KV", "bf16", "->", "fp8"]
    rows = {line[:22].strip(): line[22:].split() for line in handover[2:]}
    assert rows["wire bytes/token"] == ["70,272", "35,136"]
    assert rows["MB/request @ 8k"] == ["575.7", "287.8"]
    assert rows["ms/request @ 8k"] == ["11.51", "5.76"]
    assert rows["prompt tokens/s/link"] == ["711,521", "1,423,042"]


def test_plan_json_carries_the_handover(tmp_path, capsys):
    assert main(["plan", "--json", str(write(tmp_path, spec(linkGbps=200)))]) == 0
    [own, other] = json.loads(capsys.readouterr().out)["transfer"]
    assert (own["decodeKV"], own["linkGbps"], own["wireBytesPerToken"]) == ("bf16", 200, 70_272)
    assert own["perRequest"]["8192"] == {"bytes": 575_668_224, "milliseconds": 23.027}
    assert other["decodeKV"] == "fp8_e4m3"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_examples_show_bytes_and_time_per_request(path, capsys):
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "KV handover, prefill -> decode, per request" in out
    assert "ms/request @ 8k" in out and "MB/request @ 8k" in out
