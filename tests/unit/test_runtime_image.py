"""The runtime image (which cannot be built here) agrees with the package: the same SGLang
pin everywhere, the declared entry point, the config's default ports."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path

from tessera.runtime.config import ENGINE_VERSION, PortsConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "images/runtime/Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    """Arguments of every `name` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.split(None, 1)[:1] == [name]]


def test_base_image_is_the_pinned_sglang_release():
    assert instructions("FROM") == [f"lmsysorg/sglang:v{ENGINE_VERSION}"]


def test_build_refuses_another_sglang():
    (run,) = instructions("RUN")
    assert f"assert v == '{ENGINE_VERSION}'" in run


def test_requirements_pin_the_same_sglang():
    lines = (ROOT / "scripts/sglang-no-deps.txt").read_text().splitlines()
    assert f"sglang=={ENGINE_VERSION}" in lines


def test_entrypoint_is_the_declared_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entry,) = instructions("ENTRYPOINT")
    (command,) = json.loads(entry)
    module, func = scripts[command].split(":")
    assert callable(getattr(importlib.import_module(module), func))
    (cmd,) = instructions("CMD")
    assert json.loads(cmd) == ["serve"]
    assert "serve" in importlib.import_module(module).COMMANDS


def test_exposed_ports_are_the_config_defaults():
    (ports,) = instructions("EXPOSE")
    defaults = PortsConfig()
    assert sorted(int(p) for p in shlex.split(ports)) == sorted(
        [defaults.http, defaults.bootstrap, defaults.metrics])


def test_every_package_folder_is_copied():
    copied = {src.rstrip("/") for args in instructions("COPY") for src in args.split()[:-1]}
    assert {"tessera", "operator", "runtime", "kernels", "pyproject.toml", "setup.py",
            "README.md"} <= copied
