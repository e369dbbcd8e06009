"""`photon bench COMMAND`: registry of benchmark subcommands (each module adds its own parser)."""

from __future__ import annotations

import argparse
import importlib
import math
from typing import Any

# name -> module with `add_parser(subparsers)`; imported lazily.
BENCHMARKS: dict[str, str] = {
    "bubble": "photon.bench.bubble",
    "profile": "photon.bench.profile",
    "quality": "photon.bench.quality",
    "structured": "photon.bench.structured",
    "serve": "photon.bench.serve",
    "spec": "photon.bench.spec",
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


BENCH_EXTRA = "pip install 'photon-llm[bench]'"


def require(module: str, purpose: str) -> Any:
    """Import an optional dependency of the benchmarks, or say how to install it."""
    from photon.config import ConfigError

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{purpose} needs {module}, which is not installed: {BENCH_EXTRA}") \
            from e


def add_model_source_args(p: argparse.ArgumentParser, default_shape: str | None) -> None:
    from photon.bench.shapes import SHAPES

    p.add_argument("--model-shape", default=default_shape, choices=tuple(SHAPES),
                   help="Built-in random-weight shape (ignored when --model is given).")


def bench_engine_args(ns: argparse.Namespace, workdir: str) -> Any:
    """EngineArgs from the parsed flags; a --model-shape becomes a dummy-weight model dir."""
    from photon.bench.shapes import materialize_shape
    from photon.cli import engine_args_from

    args = engine_args_from(ns)
    if args.model is None and ns.model_shape:
        args.model = materialize_shape(ns.model_shape, workdir)
        args.load_format = "dummy"
    return args


def on_cuda(device: str) -> bool:
    """Whether an engine built with `--device device` runs on a CUDA GPU."""
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def device_label(device: str) -> str:
    """What result columns call the accelerator: "gpu" on CUDA, "device" elsewhere (CPU)."""
    return "gpu" if on_cuda(device) else "device"


def gpu_info(device: str = "auto") -> dict[str, str]:
    """`gpu_name` (on CUDA) or `device_name` ("cpu"), and the torch version."""
    import torch

    name = torch.cuda.get_device_name() if on_cuda(device) else "cpu"
    return {f"{device_label(device)}_name": name, "torch_version": torch.__version__}


def add_cost_args(group: argparse._ArgumentGroup, num_gpus_flag: bool) -> None:
    group.add_argument("--gpu-cost-per-hour", type=float, default=None, metavar="DOLLARS",
                       help="Price of one GPU-hour in dollars (without a GPU: of the machine): "
                            "adds the cost per million output tokens (the price x GPUs used x "
                            "run time / output tokens).")
    if num_gpus_flag:
        group.add_argument("--num-gpus", type=int, default=1,
                           help="GPUs the server runs on, for the cost per token.")


def check_cost_args(ns: argparse.Namespace) -> None:
    cost, num_gpus = ns.gpu_cost_per_hour, getattr(ns, "num_gpus", 1)
    if cost is not None and not (math.isfinite(cost) and cost >= 0):
        raise ValueError(f"--gpu-cost-per-hour must be a number of dollars >= 0, got {cost}")
    if num_gpus < 1:
        raise ValueError(f"--num-gpus must be at least 1, got {num_gpus}")


def dollars_per_million_tokens(gpu_cost_per_hour: float | None, num_gpus: int,
                               tokens_per_s: float) -> float | None:
    """Dollars per million output tokens at `tokens_per_s` on `num_gpus` GPUs; None when
    unpriced or nothing was generated."""
    if gpu_cost_per_hour is None or not tokens_per_s > 0:
        return None
    return gpu_cost_per_hour * num_gpus / (tokens_per_s * 3600.0) * 1e6


def cost_fields(gpu_cost_per_hour: float | None, num_gpus: int,
                tokens_per_s: float) -> dict[str, float | int | None]:
    """The cost columns of a benchmark's JSON."""
    return {"gpu_cost_per_hour": gpu_cost_per_hour, "num_gpus": num_gpus,
            "dollars_per_million_output_tokens":
                dollars_per_million_tokens(gpu_cost_per_hour, num_gpus, tokens_per_s)}
