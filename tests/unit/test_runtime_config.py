"""The runtime config: validation messages and lossless JSON/YAML round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
from tessera.runtime.config import (
    ENV_CONFIG,
    SCHEMA_VERSION,
    ConfigError,
    KVCacheConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    PrefillWorker,
    RouterConfig,
    RuntimeConfig,
    StaticWorkers,
    WeightsConfig,
)


def decode_config() -> RuntimeConfig:
    return RuntimeConfig(
        deployment="kimi-k2", namespace="llm", phase="decode",
        model=ModelConfig(name="moonshotai/Kimi-K2", path="/models/kimi", context_length=65536,
                          trust_remote_code=True),
        weights=WeightsConfig(dtype="int4", format="compressed-tensors", group_size=32),
        kv_cache=KVCacheConfig(dtype="fp8_e4m3", page_size=64),
        parallel=ParallelConfig(tensor=8, expert=8, attention_data=8),
        memory=MemoryConfig(mem_fraction_static=0.88, planned_weights_bytes_per_gpu=70 << 30,
                            planned_kv_pool_bytes_per_gpu=40 << 30),
    )


def router_config() -> RouterConfig:
    return RouterConfig(
        deployment="kimi-k2", namespace="llm", mode="disaggregated",
        static=StaticWorkers(prefill=(PrefillWorker(url="http://p-0:30000"),),
                             decode=("http://d-0:30000",)),
    )


@pytest.mark.parametrize("make", [decode_config, router_config])
def test_json_and_yaml_round_trip(make):
    config = make()
    kind = type(config)
    assert kind.from_text(config.to_json()) == config
    assert kind.from_text(config.to_yaml()) == config
    assert config.to_dict()["schema_version"] == SCHEMA_VERSION


def test_json_text_is_stable_for_hashing():
    assert decode_config().to_json() == decode_config().to_json()
    assert decode_config().to_json().index('"deployment"') < decode_config().to_json().index(
        '"weights"')


def test_from_file_and_from_env(tmp_path):
    path = tmp_path / "runtime.json"
    path.write_text(decode_config().to_json())
    assert RuntimeConfig.from_file(path) == decode_config()
    assert RuntimeConfig.from_env({ENV_CONFIG: str(path)}) == decode_config()


def test_from_env_without_the_variable_says_what_to_set():
    with pytest.raises(ConfigError, match=ENV_CONFIG):
        RuntimeConfig.from_env({})


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.json"):
        RuntimeConfig.from_file(tmp_path / "nope.json")


def _with(config: RuntimeConfig, **changes) -> dict:
    data = config.to_dict()
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for p in parents:
            node = node[p]
        node[leaf] = value
    return data


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schema_version": 2}, "schema_version 2 is not supported"),
        ({"weights__format": "safetensors"}, "cannot hold int4 weights"),
        ({"weights__dtype": "fp8", "weights__format": "awq", "weights__group_size": None},
         "cannot hold fp8 weights"),
        ({"weights__dtype": "bf16", "weights__format": "safetensors"},
         "group_size applies to int4 weights only"),
        ({"weights__group_size": 100}, "group_size must be one of"),
        ({"kv_cache__dtype": "fp8_e5m2"}, "kv_cache.dtype"),
        ({"kv_cache__page_size": 48}, "page_size must be one of"),
        ({"parallel__expert": 3}, "parallel.expert .3. must divide parallel.tensor .8."),
        ({"phase": "single"}, "disaggregation settings apply to prefill and decode"),
        ({"memory__mem_fraction_static": 1.5}, "memory.mem_fraction_static"),
        ({"surprise": True}, "surprise: Extra inputs are not permitted"),
        ({"phase": "router"}, "phase"),
    ],
)
def test_bad_configs_say_what_is_wrong(changes, message):
    data = _with(decode_config(), **changes)
    if changes.get("phase") == "single":
        data["disaggregation"]["kv_checksum"] = True
    with pytest.raises(ConfigError, match=message):
        RuntimeConfig.from_dict(data)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping"):
        RuntimeConfig.from_text("- a\n- b\n")


def test_planned_bytes_need_both_parts():
    assert decode_config().memory.planned_bytes_per_gpu == 110 << 30
    assert MemoryConfig(planned_weights_bytes_per_gpu=1).planned_bytes_per_gpu is None


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ({}, "exactly one of router.static and router.discovery"),
        ({"static": {"single": ["http://s:30000"]}}, r"needs workers for \['decode', 'prefill'\]"),
        ({"discovery": {"namespace": "llm", "prefill_selector": {"a": "b"}}},
         r"got \['prefill'\]"),
    ],
)
def test_router_config_needs_its_workers_once(workers, message):
    data = {"deployment": "kimi-k2", "namespace": "llm", "mode": "disaggregated", **workers}
    with pytest.raises(ConfigError, match=message):
        RouterConfig.from_dict(data)


def test_the_example_in_the_docs_is_a_valid_config():
    docs = (Path(__file__).resolve().parents[2] / "docs/runtime.md").read_text()
    example = docs.split("```json\n", 1)[1].split("```", 1)[0]
    config = RuntimeConfig.from_text(example, source="docs/runtime.md")
    assert (config.phase, config.weights.dtype, config.kv_cache.dtype) == (
        "decode", "int4", "fp8_e4m3")
