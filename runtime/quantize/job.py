"""What a Kubernetes Job needs to run the converter: the one contract with the operator.

The operator mounts the source checkpoint read-only at `source_mount` and a persistent volume
at `output_mount`, runs `argv` in the runtime image, and treats the Job's success as the
weights being ready. The output volume must outlive a failed pod: a retried pod resumes from
the manifest there instead of starting over.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.runtime.quantize.options import REOPEN_BYTES, Options

SOURCE_MOUNT = "/models/source"
OUTPUT_MOUNT = "/models/int4"
# Python with torch imported (about 0.5 GiB) and a CUDA context (about 0.3 GiB) before any
# tensor is read; measured by bench/quantize_memory.py
BASELINE_BYTES = 1 << 30
# Live copies of the largest tensor while it is converted: its mapped source pages, the tensor
# read, and what is made from it. An estimate, not a measurement: in the benchmark the
# largest tensor (32 MiB at most) was lost in the shard read window.
LARGEST_TENSOR_COPIES = 4


@dataclass(frozen=True)
class ConverterJob:
    argv: list[str]
    source_mount: str  # mount the source checkpoint here, read-only
    output_mount: str  # mount the output volume here, writable, kept across pod retries
    memory_bytes: int  # memory request (and limit) for the container


def converter_job(options: Options, largest_tensor_bytes: int,
                  source_mount: str = SOURCE_MOUNT, output_mount: str = OUTPUT_MOUNT,
                  device: str = "cpu") -> ConverterJob:
    """The converter's container inputs for `options`.

    `largest_tensor_bytes` is the biggest single tensor of the source, in practice the BF16
    embedding or output head (vocab_size x hidden_size x 2): memory scales with it, not with
    the shard or model size.
    """
    if largest_tensor_bytes <= 0:
        raise ValueError(f"largest_tensor_bytes must be positive, got {largest_tensor_bytes}")
    if source_mount == output_mount:
        raise ValueError("source and output must be different mounts: the source is read-only")
    argv = ["tessera", "quantize", "convert", source_mount, output_mount,
            "--group-size", str(options.group_size), "--device", device]
    for target in options.targets:
        argv += ["--target", target]
    memory = BASELINE_BYTES + REOPEN_BYTES + LARGEST_TENSOR_COPIES * largest_tensor_bytes
    return ConverterJob(argv, source_mount, output_mount, memory)
