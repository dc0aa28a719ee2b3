"""The CRD is the one source of the API's words: every field has a description (what
`kubectl explain` prints), and docs/api.md's field reference is generated from them by
scripts/gen-api-docs.py, so the two cannot drift apart."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen-api-docs.py"
CRD_TEXT = (ROOT / "crds" / "modeldeployment.yaml").read_text()
DOC_TEXT = (ROOT / "docs" / "api.md").read_text()


def _load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_api_docs", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def fields(schema: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for name, field in schema.get("properties", {}).items():
        here = f"{path}.{name}"
        yield here, field
        yield from fields(field, here)
        yield from fields(field.get("items", {}), here + "[]")


def root_schema() -> Mapping[str, Any]:
    (version,) = yaml.safe_load(CRD_TEXT)["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_docs_api_md_is_generated_from_the_crd() -> None:
    assert gen.render(CRD_TEXT, DOC_TEXT) == DOC_TEXT, (
        "docs/api.md's field reference differs from crds/modeldeployment.yaml: "
        "run scripts/gen-api-docs.py")


def test_every_field_has_a_description() -> None:
    root = root_schema()
    assert root.get("description")
    # metadata is the API server's ObjectMeta; everything else is ours.
    ours = [(p, f) for p, f in fields(root, "md") if not p.startswith("md.metadata")]
    assert len(ours) > 80
    missing = [p for p, f in ours if not f.get("description", "").strip()
               and not p.endswith("[]")]  # a list's items are described by the list
    assert not missing, f"CRD fields without a description: {missing}"


def test_every_scalar_default_is_stated_in_the_description() -> None:
    """kubectl explain prints the description; the schema default must be readable there."""
    unstated = []
    for path, field in fields(root_schema(), "md"):
        default = field.get("default")
        if default is None or isinstance(default, dict | list):
            continue
        text = field["description"].lower()
        if "default" not in text or str(default).lower() not in text:
            unstated.append((path, default))
    assert not unstated, f"descriptions that do not state their default: {unstated}"


def test_the_drift_check_fails_when_the_crd_changes_alone() -> None:
    old = "Tokens per KV cache page"
    assert CRD_TEXT.count(old) == 1
    changed_crd = CRD_TEXT.replace(old, "KV tokens in one page")
    assert gen.render(changed_crd, DOC_TEXT) != DOC_TEXT


def test_the_drift_check_fails_when_the_doc_changes_alone() -> None:
    row = next(line for line in DOC_TEXT.splitlines() if line.startswith("| `spec.router.port`"))
    edited = DOC_TEXT.replace(row, row.replace("Default 8000", "Default 8080"))
    assert edited != DOC_TEXT
    assert gen.render(CRD_TEXT, edited) != edited
    # The hand-written text outside the markers is the doc's own, kept as it is.
    outside = DOC_TEXT.replace("## Who judges what", "## Who decides what")
    assert gen.render(CRD_TEXT, outside) == outside


def test_prefill_decode_and_single_are_documented_once() -> None:
    block = gen.reference(yaml.safe_load(CRD_TEXT))
    assert "| `spec.prefill.kvCache.dtype` |" in block
    assert "`spec.decode.kvCache.dtype`" not in block
    assert "Same fields as `spec.prefill`" in block


def test_missing_markers_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="marker"):
        gen.render(CRD_TEXT, "# api\nno markers here\n")


def test_script_check_mode_agrees() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
