"""`tessera quantize convert SRC DST` and `tessera quantize verify DST`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tessera.runtime.quantize.tensors import DEFAULT_TARGETS, TENSOR_CLASSES

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "quantize", help="convert an FP8/BF16 checkpoint to INT4 W4A16 (compressed-tensors)",
        description=__doc__)
    sub = parser.add_subparsers(dest="quantize_command", required=True, metavar="ACTION")

    convert = sub.add_parser("convert", help="convert SRC into DST, resuming a run there")
    convert.add_argument("src", type=Path, help="Hugging Face model folder (FP8 or BF16)")
    convert.add_argument("dst", type=Path, help="output folder (created; resumed if present)")
    linear = ", ".join(c.name for c in TENSOR_CLASSES if c.quantizable)
    convert.add_argument(
        "--target", dest="targets", action="append", metavar="CLASS|re:REGEX",
        help=f"weights to quantize: a tensor class ({linear}) or a regex over weight names; "
             f"repeatable (default: {' '.join(DEFAULT_TARGETS)})")
    convert.add_argument("--group-size", type=int, default=128, help="INT4 group size along K")
    convert.add_argument("--device", default="cpu",
                         help="torch device for the arithmetic, e.g. cuda (default: cpu)")
    convert.set_defaults(func=_convert)

    verify = sub.add_parser("verify", help="re-hash DST's shards against its manifest")
    verify.add_argument("dst", type=Path, help="a folder written by `tessera quantize convert`")
    verify.set_defaults(func=_verify)


def _convert(args: argparse.Namespace) -> int:
    from tessera.runtime.quantize.convert import convert, size_report
    from tessera.runtime.quantize.options import Options

    try:
        options = Options(tuple(args.targets or DEFAULT_TARGETS), args.group_size)
        manifest = convert(args.src, args.dst, options, device=args.device)
    except ValueError as err:
        print(f"tessera quantize: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(size_report(manifest))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from tessera.runtime.quantize.convert import verify

    problems = verify(args.dst)
    for problem in problems:
        print(f"tessera quantize verify: {problem}", file=sys.stderr)
    if not problems:
        print(f"{args.dst}: every shard matches its manifest checksum")
    return EXIT_FAILED if problems else EXIT_OK
