"""The handover plugin's entry point installs into SGLang's PD classes for PD pools only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.disaggregation.mooncake.conn", reason="needs SGLang (no deps)")

from tessera.runtime.config import ENV_CONFIG, ModelConfig, RuntimeConfig  # noqa: E402
from tessera.runtime.kv_handover import sglang_plugin  # noqa: E402


def _config(tmp_path: Path, phase: str) -> dict[str, str]:
    config = RuntimeConfig(deployment="kimi-k2", namespace="llm", phase=phase,
                           model=ModelConfig(name="m", path="/models/m"))
    path = tmp_path / f"{phase}.json"
    path.write_text(json.dumps(config.to_dict()))
    return {ENV_CONFIG: str(path)}


def test_installs_for_pd_pools_only(tmp_path: Path) -> None:
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    stock = MooncakeKVManager.send_kvcache
    sglang_plugin.register({})  # SGLang started without tessera
    sglang_plugin.register(_config(tmp_path, "single"))  # nothing is handed over
    assert not sglang_plugin.installed() and MooncakeKVManager.send_kvcache is stock
    sglang_plugin.register(_config(tmp_path, "decode"))
    assert sglang_plugin.installed()
    assert MooncakeKVManager.send_kvcache is not stock
    assert CommonKVManager.try_ensure_parallel_info.__module__ == sglang_plugin.__name__
