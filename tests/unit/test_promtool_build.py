"""promtool's cached build (tessera.devcluster.promtool): what it reuses and how it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.devcluster.build import BuildError
from tessera.devcluster.promtool import PROMETHEUS_VERSION, ensure_promtool, promtool_path


def test_a_cached_promtool_is_reused_without_go(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    target = promtool_path(tmp_path)
    target.parent.mkdir(parents=True)
    target.write_text("#!/bin/sh\n")
    monkeypatch.setenv("GO", str(tmp_path / "no-go-here"))  # any build would fail on this
    assert ensure_promtool(tmp_path, progress=lambda _: None) == target
    assert target.parts[-4:] == ("prometheus", PROMETHEUS_VERSION, "bin", "promtool")


def test_a_missing_go_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GO", str(tmp_path / "no-go-here"))
    with pytest.raises(BuildError, match="is not an executable file"):
        ensure_promtool(tmp_path, progress=lambda _: None)


def test_an_old_go_is_refused_with_the_version_needed(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    go = tmp_path / "go"
    go.write_text("#!/bin/sh\necho go1.24.3\n")
    go.chmod(0o755)
    monkeypatch.setenv("GO", str(go))
    with pytest.raises(BuildError, match=r"go1\.24\.3; promtool v0\.316\.0 needs Go >= 1\.26\.7"):
        ensure_promtool(tmp_path / "cache", progress=lambda _: None)
    assert not promtool_path(tmp_path / "cache").exists()
