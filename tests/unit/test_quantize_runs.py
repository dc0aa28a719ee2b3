"""Resuming, refusing bad input, BF16 sources and the `tessera quantize` command line."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tessera.runtime.quantize import convert as convert_module
from tessera.runtime.quantize.checkpoint import read_checkpoint
from tessera.runtime.quantize.convert import MANIFEST, convert, verify
from tessera.runtime.quantize.options import Options
from tessera.runtime.quantize.plan import Action, make_plan
from tessera.runtime.quantize.synthetic import TINY_CONFIGS, write_checkpoint

from tessera.cli import main

KIMI = TINY_CONFIGS["kimi-k2"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: torch's thread pool only costs here, badly so on a busy 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "src", KIMI, max_shard_bytes=1 << 20)


def run(src: Path, dst: Path, options: Options | None = None) -> dict:
    return convert(src, dst, options or Options(), progress_stream=io.StringIO())


def test_an_interrupted_run_resumes_where_it_stopped_and_matches_a_clean_run(
        src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run(src, tmp_path / "clean")
    assert len(clean["shards"]) >= 3
    real_shard = convert_module._convert_shard
    calls = []

    def dies_on_the_third_shard(*args, **kwargs):  # the process is killed mid-shard
        calls.append(args[2])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_shard(*args, **kwargs)

    monkeypatch.setattr(convert_module, "_convert_shard", dies_on_the_third_shard)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run(src, out)
    partial = json.loads((out / MANIFEST).read_text())
    assert not partial["complete"] and sorted(partial["shards"]) == sorted(calls[:2])
    assert verify(out)[0] == "the conversion did not finish: run it again"
    finished = {f: (out / f).stat().st_mtime_ns for f in partial["shards"]}

    monkeypatch.setattr(convert_module, "_convert_shard", real_shard)
    resumed = run(src, out)
    assert {f: (out / f).stat().st_mtime_ns for f in finished} == finished  # not redone
    assert resumed["shards"] == clean["shards"]  # same bytes as an uninterrupted run
    assert verify(out) == []
    assert not list(out.glob("*.partial"))


def test_other_files_are_copied_but_not_weights_of_other_formats(src: Path,
                                                                  tmp_path: Path) -> None:
    (src / "tiktoken.model").write_bytes(b"tokenizer")
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    run(src, tmp_path / "out")
    assert (tmp_path / "out" / "tiktoken.model").read_bytes() == b"tokenizer"
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()


def test_a_deleted_output_shard_is_rewritten(src: Path, tmp_path: Path) -> None:
    first = run(src, tmp_path / "out")
    victim = tmp_path / "out" / sorted(first["shards"])[1]
    victim.unlink()
    assert verify(tmp_path / "out") == [f"{victim.name}: missing"]
    assert run(src, tmp_path / "out")["shards"] == first["shards"]
    assert verify(tmp_path / "out") == []


def test_resuming_with_other_options_is_refused(src: Path, tmp_path: Path) -> None:
    run(src, tmp_path / "out")
    with pytest.raises(ValueError, match="made with options"):
        run(src, tmp_path / "out", Options(group_size=32))


def test_bf16_source_quantizes_experts_and_copies_the_rest(tmp_path: Path) -> None:
    bf16 = write_checkpoint(tmp_path / "bf16", KIMI, dtype="bf16")
    plan = make_plan(read_checkpoint(bf16), Options())
    actions = {step.action for steps in plan.shards.values() for step in steps}
    assert actions == {Action.QUANTIZE, Action.COPY}
    manifest = run(bf16, tmp_path / "out")
    experts = manifest["sizes"]["routed_experts"]
    # BF16 (2 bytes) -> INT4 (0.5 byte + 2/128 scale) per weight
    assert experts["after"] / experts["before"] == pytest.approx((0.5 + 2 / 128) / 2, rel=1e-3)


def test_wider_targets_quantize_shared_experts_too(src: Path, tmp_path: Path) -> None:
    manifest = run(src, tmp_path / "out", Options(("routed_experts", "shared_experts")))
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())[
        "quantization_config"]["ignore"]
    assert not any("shared_experts" in entry for entry in ignore)
    assert manifest["sizes"]["shared_experts"]["after"] < manifest["sizes"]["shared_experts"][
        "before"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (Options(("re:nothing\\.matches",)), "match no Linear weight"),
        (Options(("re:.*experts\\.1\\..*",)), "only partly quantized"),
    ],
)
def test_targets_that_cannot_work_are_refused(src: Path, tmp_path: Path, options: Options,
                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(src, tmp_path / "out", options)


def test_group_size_that_does_not_divide_the_input_features_is_refused(tmp_path: Path) -> None:
    narrow = write_checkpoint(tmp_path / "src", {**KIMI, "moe_intermediate_size": 96})
    with pytest.raises(ValueError, match="96 input features, not a multiple of the group size"):
        run(narrow, tmp_path / "out")
    assert run(narrow, tmp_path / "out32", Options(group_size=32))["complete"]


def test_unsupported_sources_and_outputs_are_refused(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        run(tmp_path, tmp_path / "out")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="reads BF16 checkpoints or FP8 ones"):
        run(src, tmp_path / "out")
    with pytest.raises(ValueError, match="group size 100 is not supported"):
        Options(group_size=100)


def test_an_output_folder_holding_other_weights_is_refused(src: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="convert into an empty folder"):
        run(src, tmp_path / "out")


def test_cli_converts_verifies_and_reports(src: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["quantize", "convert", str(src), str(out), "--target", "routed_experts"]) == 0
    captured = capsys.readouterr()
    assert "routed_experts" in captured.out and "total" in captured.out
    assert "quantize [" in captured.err  # the progress line
    assert main(["quantize", "verify", str(out)]) == 0
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    assert main(["quantize", "verify", str(out)]) == 1
    assert "sha256 differs" in capsys.readouterr().err
    assert main(["quantize", "convert", str(src), str(tmp_path / "x"), "--target", "norm"]) == 2
    assert "neither a quantizable tensor class" in capsys.readouterr().err


def test_a_scale_stored_in_another_shard_is_found(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from tessera.runtime.quantize import fp8
    from tessera.runtime.quantize.synthetic import FP8_SOURCE_CONFIG

    src = tmp_path / "src"
    src.mkdir()
    prefix = "model.layers.1.mlp.experts.0"
    gen = torch.Generator().manual_seed(1)
    first, second = {}, {}
    for proj, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)),
                        ("down_proj", (256, 128))):
        weight, scale = fp8.quantize(torch.randn(shape, generator=gen) * 0.02)
        first[f"{prefix}.{proj}.weight"] = weight
        second[f"{prefix}.{proj}.weight_scale_inv"] = scale
    save_file(first, src / "model-00001-of-00002.safetensors")
    save_file(second, src / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {
        n: "model-00002-of-00002.safetensors" for n in second}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"quantization_config": FP8_SOURCE_CONFIG}))

    manifest = run(src, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors"}
    assert manifest["sizes"]["routed_experts"]["after"] == 3 * (128 * 256 // 2 + 128 * 256 // 64
                                                                + 8)


def test_read_chunks_bound_the_bytes_read_per_open(src: Path) -> None:
    from tessera.runtime.quantize.convert import read_chunks

    plan = make_plan(read_checkpoint(src), Options())
    steps = [step for steps in plan.shards.values() for step in steps]
    limit = 64 << 10
    chunks = read_chunks(steps, limit)
    assert [s for chunk in chunks for s in chunk] == steps  # all, in order
    for chunk in chunks:
        assert len(chunk) == 1 or sum(s.source_bytes for s in chunk) <= limit
    assert len(chunks) > 1
