"""`tessera plan FILE.yaml`: the table, --json, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tessera.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*/modeldeployment.yaml"))


def manifest(tmp_path: Path, **spec_overrides) -> Path:
    doc = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "kimi"},
        "spec": {
            "model": {"name": "moonshotai/Kimi-K2", "architecture": {"preset": "kimi-k2"},
                      "contextLength": 65536},
            "prefill": {"tensorParallel": 8, "weights": {"dtype": "fp8"},
                        "kvCache": {"dtype": "fp8_e4m3"}},
            "decode": {"replicas": 2, "tensorParallel": 8,
                       "weights": {"dtype": "int4", "groupSize": 32},
                       "kvCache": {"dtype": "fp8_e4m3"}},
            **spec_overrides,
        },
    }
    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_table_compares_precisions_per_phase(tmp_path, capsys):
    assert main(["plan", str(manifest(tmp_path))]) == 0
    out = capsys.readouterr().out
    for phase in ("prefill: 1 replica(s) x 8 GPUs", "decode: 2 replica(s) x 8 GPUs"):
        assert phase in out
    # five precision columns, the spec's own marked, in each phase
    assert out.count("W bf16 / KV bf16") == 2
    assert "*W fp8 / KV fp8" in out and "*W int4 / KV fp8" in out
    for row in ("weights GiB/GPU", "KV pool GiB/GPU", "KV tokens/replica", "requests @ 4k",
                "requests @ 32k", "requests @ 128k", "requests @ 65,536"):
        assert row in out
    assert "CapacityPlanned: True (Fits)" in out
    # the decode attention each phase gets, and why
    assert "decode attention sglang: a prefill pool does not decode" in out
    assert "decode attention flashmla: fastest measured for MLA with fp8_e4m3 KV at 8" in out
    # and its INT4 kernels: the default scheme quantizes only the routed experts
    assert "w4a16 sglang: fp8 weights: no tessera INT4 kernel" in out
    assert "w4a16 sglang: no INT4 linear layers" in out


def test_json_matches_the_plan(tmp_path, capsys):
    assert main(["plan", str(manifest(tmp_path)), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    decode = doc["status"]["decode"]["capacity"]
    assert decode["maxConcurrentRequests"] == decode["kvTokensPerReplica"] // 65536
    assert [c["type"] for c in doc["conditions"]] == ["PrecisionValid", "CapacityPlanned"]
    assert len(doc["comparison"]["decode"]) == 5
    chosen = [v for v in doc["comparison"]["decode"]
              if v["precision"] == {"weights": "int4", "kvCache": "fp8_e4m3"}]
    assert chosen[0]["capacity"] == decode
    assert doc["decodeAttention"]["decode"]["impl"] == "flashmla"
    assert doc["decodeAttention"]["prefill"] == {"impl": "sglang",
                                                 "reason": "a prefill pool does not decode"}
    assert doc["w4a16"]["decode"]["impl"] == "sglang"


def test_json_names_tessera_for_an_expert_parallel_int4_decode_pool(tmp_path, capsys):
    decode = {"replicas": 1, "tensorParallel": 8, "expertParallel": 8,
              "weights": {"dtype": "int4", "groupSize": 32,
                          "quantize": ["attention", "sharedExperts", "routedExperts"]},
              "kvCache": {"dtype": "fp8_e4m3"}}
    assert main(["plan", str(manifest(tmp_path, decode=decode)), "--json"]) == 0
    choice = json.loads(capsys.readouterr().out)["w4a16"]["decode"]
    assert choice["impl"] == "tessera"
    assert "SGLang's Marlin MoE for the experts" in choice["reason"]


def test_error_findings_exit_1(tmp_path, capsys):
    one_gpu = {"tensorParallel": 1, "weights": {"dtype": "fp8"}, "kvCache": {"dtype": "bf16"}}
    assert main(["plan", str(manifest(tmp_path, prefill=one_gpu))]) == 1
    assert "InsufficientGPUMemory" in capsys.readouterr().out


def test_the_report_configuration_shows_its_handover_staging(tmp_path, capsys):
    bf16_kv_prefill = {"tensorParallel": 8, "weights": {"dtype": "fp8"},
                       "kvCache": {"dtype": "bf16"}}
    model = {"name": "moonshotai/Kimi-K2", "architecture": {"preset": "kimi-k2"},
             "contextLength": 32768}
    assert main(["plan", str(manifest(tmp_path, prefill=bf16_kv_prefill, model=model))]) == 0
    out = capsys.readouterr().out
    staging = next(line for line in out.splitlines() if "handover staging" in line)
    assert f"{4 * 8192 * 61 * 576 / 2**30:.2f}" in staging  # the FP8 latents of 4 chunks


@pytest.mark.parametrize(("content", "needle"), [
    ("kind: Deployment\n", "exactly one document of kind ModelDeployment"),
    ("kind: ModelDeployment\nspec: [\n", "not valid YAML"),
    ("kind: ModelDeployment\nspec: {model: {architecture: {preset: gpt-9}}, single: {}}\n",
     "unknown architecture preset"),
])
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, content, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["plan", str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_examples_plan_cleanly(path, capsys):
    assert main(["plan", str(path)]) == 0, capsys.readouterr().out
    assert "CapacityPlanned: True" in capsys.readouterr().out
