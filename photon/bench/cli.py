"""`photon bench COMMAND`: registry of benchmark subcommands (each module adds its own parser)."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# name -> module with `add_parser(subparsers)`; imported lazily.
BENCHMARKS: dict[str, str] = {
    "bubble": "photon.bench.bubble",
    "profile": "photon.bench.profile",
    "structured": "photon.bench.structured",
    "serve": "photon.bench.serve",
    "throughput": "photon.bench.throughput",
}


def add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", allow_abbrev=False,
                       help="Benchmarks (throughput, pipeline bubble, serving).",
                       description="Benchmarks. Each prints JSON lines; the last is the summary.")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_sub.required = True
    for module in BENCHMARKS.values():
        importlib.import_module(module).add_parser(bench_sub)


def add_model_source_args(p: argparse.ArgumentParser, default_shape: str | None) -> None:
    p.add_argument("--model-shape", default=default_shape,
                   help="Built-in random-weight shape: qwen3-0.6b, llama-3.1-8b, tiny "
                        "(ignored when --model is given).")


def bench_engine_args(ns: argparse.Namespace, workdir: str) -> Any:
    """EngineArgs from the parsed flags; a --model-shape becomes a dummy-weight model dir."""
    from photon.bench.shapes import materialize_shape
    from photon.cli import engine_args_from

    args = engine_args_from(ns)
    if args.model is None and ns.model_shape:
        args.model = materialize_shape(ns.model_shape, workdir)
        args.load_format = "dummy"
    return args


def gpu_info() -> dict[str, str]:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu_name": name, "torch_version": torch.__version__}
