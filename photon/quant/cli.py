"""`photon quantize --model DIR --scheme SCHEME --out DIR` (also `python -m photon.quant`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from photon.quant.quantize import DEFAULT_GROUP_SIZE, SCHEMES

DESCRIPTION = """Write a compressed-tensors checkpoint of a model: its decoder's linear weights
quantized by round-to-nearest (FP8 or INT8 per output channel, INT4/INT8 in groups), everything
else copied. `photon serve --model OUT` / `LLM(OUT)` load it (quantization is detected)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="The model to quantize: a built-in name or a local model directory.")
    p.add_argument("--scheme", required=True, metavar="{" + ",".join(SCHEMES) + "}",
                   help="fp8-dynamic / fp8-static: FP8 W8A8 (activations per token, or one "
                        "static scale per linear from the calibration text); w8a8-int8: INT8 "
                        "W8A8; w4a16 / w8a16: weight-only INT4 / INT8 with group scales.")
    p.add_argument("--out", required=True, help="Directory to write (created if missing).")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                   help="Input channels per scale for w4a16 / w8a16.")
    p.add_argument("--asymmetric", action="store_true",
                   help="w4a16 / w8a16: a zero point per group (default: symmetric).")
    p.add_argument("--calibration-file", default=None,
                   help="fp8-static: a UTF-8 text file; each blank-line separated passage is "
                        "one calibration sample.")
    p.add_argument("--calibration-tokens", type=int, default=512,
                   help="fp8-static: longest calibration sample, in tokens.")


def run(ns: argparse.Namespace) -> int:
    from photon.model.tiny import resolve_model_path
    from photon.quant.quantize import make_scheme, quantize_model

    if ns.group_size <= 0:
        raise ValueError(f"--group-size must be a positive integer, got {ns.group_size}")
    model_dir = resolve_model_path(ns.model)
    scheme = make_scheme(ns.scheme, ns.group_size, symmetric=not ns.asymmetric)
    quantize_model(model_dir, ns.out, scheme,
                   _calibration(model_dir, ns.calibration_file, ns.calibration_tokens))
    print(f"wrote {ns.scheme} checkpoint to {ns.out}", file=sys.stderr)
    return 0


def _calibration(model_dir: str, path: str | None, max_tokens: int) -> list[list[int]] | None:
    if path is None:
        return None
    from photon.tokenizer import Tokenizer

    with open(path, encoding="utf-8") as f:
        passages = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    tokenizer = Tokenizer.from_pretrained(model_dir)
    return [ids[:max_tokens] for ids in tokenizer.encode_batch(passages) if ids]


def add_quantize(sub: Any) -> None:
    from photon.cli import RawDescriptionHelpFormatter

    p = sub.add_parser("quantize", help="Write a quantized (compressed-tensors) checkpoint.",
                       description=DESCRIPTION, formatter_class=RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    from photon.cli import CLIParser, RawDescriptionHelpFormatter

    parser = CLIParser(prog="python -m photon.quant", description=DESCRIPTION,
                       formatter_class=RawDescriptionHelpFormatter)
    add_arguments(parser)
    ns = parser.parse_args(argv)
    try:
        return run(ns)
    except ValueError as e:  # ConfigError included
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
