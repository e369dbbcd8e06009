"""LoRA adapters in `photon bench throughput` (vLLM's benchmark_throughput --enable-lora).

`--num-lora-adapters N` writes N synthetic PEFT adapters of the model (random small weights:
adapter_config.json and adapter_model.safetensors, the format photon.lora.adapter reads) into the
run's temp dir, turns LoRA on, and gives every request one adapter, round-robin or drawn with the
workload seed. With N above --max-loras the adapters take turns in the slots (slot churn); the
summary counts the timed run's slot loads.

Only the first DISTINCT_WEIGHTS adapters get weights of their own; the others link to one of
those files. Each is still its own adapter to the engine (own id, host copy and slot load), so
the throughput is the same, and 500 adapters of an 8B model do not fill the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from typing import Any

from photon.lora.adapter import CONFIG_FILE, TARGETS, WEIGHTS_FILE, target_shapes

DISTINCT_WEIGHTS = 8
DEFAULT_TARGETS = "q,k,v,o,gate,up,down"
ASSIGNMENTS = ("round-robin", "random", "zipf")
ZIPF_EXPONENT = 1.0  # adapter i (from 1) is drawn with weight 1 / i ** ZIPF_EXPONENT
INIT_STD = 0.01  # small: the adapters perturb the base model without swamping it


@dataclass(frozen=True)
class LoRABench:
    """The checked LoRA flags of one run (num_adapters 0: no adapters)."""

    num_adapters: int
    rank: int | None
    targets: tuple[str, ...]
    assignment: str


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (with --max-loras and --max-lora-rank)")
    g.add_argument("--num-lora-adapters", type=int, default=0, metavar="N",
                   help="Synthetic PEFT adapters (random weights) to write and spread over the "
                        "requests; turns on --enable-lora. N above --max-loras makes the "
                        "adapters take turns in the slots. Default 0: no adapters.")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="The synthetic adapters' rank r (default: --max-lora-rank).")
    g.add_argument("--lora-targets", default=DEFAULT_TARGETS, metavar="LIST",
                   help="Comma-separated projections the adapters target, of q, k, v, o, gate, "
                        f"up, down (default {DEFAULT_TARGETS}).")
    g.add_argument("--lora-assignment", default="round-robin", choices=ASSIGNMENTS,
                   help="How requests get adapters: in turn, drawn uniformly, or drawn "
                        f"Zipf-distributed (adapter i with weight 1/i^{ZIPF_EXPONENT:g}), the draws "
                        "seeded by --workload-seed (default round-robin).")


def check_lora_args(ns: argparse.Namespace) -> LoRABench:
    """The LoRA flags, checked (ValueError naming the flag); N > 0 sets enable_lora."""
    n = ns.num_lora_adapters
    if n < 0:
        raise ValueError(f"--num-lora-adapters must be >= 0, got {n}")
    targets = _parse_targets(ns.lora_targets)
    if n == 0:
        return LoRABench(0, None, targets, ns.lora_assignment)
    rank = ns.max_lora_rank if ns.lora_rank is None else ns.lora_rank
    if not 1 <= rank <= ns.max_lora_rank:
        raise ValueError(f"--lora-rank must be in [1, --max-lora-rank = {ns.max_lora_rank}], "
                         f"got {rank}")
    ns.enable_lora = True
    return LoRABench(n, rank, targets, ns.lora_assignment)


def _parse_targets(text: str) -> tuple[str, ...]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    targets = tuple(t if t.endswith("_proj") else f"{t}_proj" for t in names)
    bad = [n for n, t in zip(names, targets) if t not in TARGETS]
    if not targets or bad:
        raise ValueError(f"--lora-targets: unknown projection(s) {bad or [text]}; allowed: "
                         f"{', '.join(t.removesuffix('_proj') for t in TARGETS)}")
    return targets


def write_adapters(bench: LoRABench, model_dir: str, out_dir: str) -> list[Any]:
    """Write the adapters under out_dir; their LoRARequests (ids 1..N)."""
    from photon.lora.request import LoRARequest

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    requests = []
    for i in range(bench.num_adapters):
        path = os.path.join(out_dir, f"lora-{i}")
        os.makedirs(path, exist_ok=True)
        _write_config(path, bench)
        weights = os.path.join(path, WEIGHTS_FILE)
        if i < DISTINCT_WEIGHTS:
            _write_weights(weights, hf_config, bench, seed=i)
        else:
            first = os.path.join(out_dir, f"lora-{i % DISTINCT_WEIGHTS}", WEIGHTS_FILE)
            os.symlink(first, weights)
        requests.append(LoRARequest(f"lora-{i}", i + 1, path))
    return requests


def _write_config(path: str, bench: LoRABench) -> None:
    config = {"peft_type": "LORA", "r": bench.rank, "lora_alpha": 2 * bench.rank,
              "target_modules": list(bench.targets), "lora_dropout": 0.0, "bias": "none",
              "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


def _write_weights(file: str, hf_config: dict[str, Any], bench: LoRABench, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = target_shapes(hf_config)
    tensors = {}
    for layer in range(int(hf_config["num_hidden_layers"])):
        for target in bench.targets:
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            shape = shapes[target]
            a = torch.randn(bench.rank, shape.in_features, generator=gen) * INIT_STD
            b = torch.randn(shape.out_features, bench.rank, generator=gen) * INIT_STD
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, file, metadata={"format": "pt"})


def assign(adapters: list[Any], num_requests: int, how: str, seed: int) -> list[Any] | None:
    """One adapter per request (None without adapters)."""
    if not adapters:
        return None
    rng = random.Random(seed)
    if how == "random":
        return [rng.choice(adapters) for _ in range(num_requests)]
    if how == "zipf":
        weights = [1 / (i + 1) ** ZIPF_EXPONENT for i in range(len(adapters))]
        return rng.choices(adapters, weights=weights, k=num_requests)
    return [adapters[i % len(adapters)] for i in range(num_requests)]


def slot_loads(llm: Any) -> int:
    """Adapters loaded into a slot so far (0 without LoRA)."""
    stats = llm.engine.stats().lora
    return 0 if stats is None else stats.num_slot_loads


def lora_summary(bench: LoRABench, llm: Any, loads: int) -> dict[str, Any]:
    """The summary's LoRA fields (`lora_slot_loads`: during the timed run)."""
    lora = llm.config.lora_config
    return {"num_lora_adapters": bench.num_adapters,
            "max_loras": None if lora is None else lora.max_loras,
            "max_lora_rank": None if lora is None else lora.max_lora_rank,
            "lora_rank": bench.rank,
            "lora_targets": list(bench.targets) if bench.num_adapters else None,
            "lora_assignment": bench.assignment if bench.num_adapters else None,
            "lora_slot_loads": loads}
