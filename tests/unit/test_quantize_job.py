"""The converter Job's container inputs agree with the `tessera quantize` command line."""

from __future__ import annotations

import pytest
from tessera.runtime.quantize.job import (
    BASELINE_BYTES,
    LARGEST_TENSOR_COPIES,
    OUTPUT_MOUNT,
    SOURCE_MOUNT,
    converter_job,
)
from tessera.runtime.quantize.options import REOPEN_BYTES, Options

from tessera.cli import parse_args


@pytest.mark.parametrize(
    "options",
    [Options(), Options(("routed_experts", "re:.*shared_experts.*"), group_size=32)],
)
def test_argv_parses_back_to_the_same_options(options: Options) -> None:
    job = converter_job(options, largest_tensor_bytes=2 << 30)
    assert job.argv[:3] == ["tessera", "quantize", "convert"]
    args = parse_args(job.argv[1:])
    assert (str(args.src), str(args.dst)) == (SOURCE_MOUNT, OUTPUT_MOUNT)
    assert Options(tuple(args.targets), args.group_size) == options
    assert args.device == "cpu"


def test_memory_follows_the_largest_tensor() -> None:
    # Kimi K2's BF16 embedding: 163840 x 7168 x 2 bytes
    embedding = 163840 * 7168 * 2
    job = converter_job(Options(), embedding)
    assert job.memory_bytes == BASELINE_BYTES + REOPEN_BYTES + LARGEST_TENSOR_COPIES * embedding


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"largest_tensor_bytes": 0}, "must be positive"),
     ({"largest_tensor_bytes": 1, "output_mount": SOURCE_MOUNT}, "different mounts")],
)
def test_bad_inputs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        converter_job(Options(), **kwargs)
