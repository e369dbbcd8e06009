"""`photon bench profile`: where a decode step's GPU time goes, by kernel class.

B requests are prefilled to a given context, then N decode steps run under torch.profiler. Each GPU
kernel is put in a class by its name (attention, gemm, sampling, elementwise); idle is the wall time
not covered by any kernel; with `--num-lora-adapters N` the requests run synthetic adapters (as
`photon bench throughput`'s, assigned by `--lora-assignment`) and the LoRA kernels are a class
of their own. With
`--refills-per-step R`, R new requests of `--refill-prompt-len`
tokens arrive before each profiled step, so every step is a mixed one (the decode rows beside
prefill chunks), as in a server whose finished requests are replaced; the warm-up steps refill too,
so that the mixed steps' kernel variants are compiled before profiling. Prints one JSON object
(GPU time by kernel class and the heaviest kernels and host ops per step).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import re
import tempfile
import time
from dataclasses import asdict
from typing import Any

import torch

from photon.bench.bubble import _start_batch, decode_len_needed
from photon.bench.cli import add_model_source_args, bench_engine_args, gpu_info
from photon.bench.throughput_lora import add_lora_args, assign, check_lora_args, write_adapters
from photon.sampling_params import SamplingParams

KERNEL_CLASSES: list[tuple[str, re.Pattern[str]]] = [
    ("lora", re.compile(r"_shrink_kernel|_expand_kernel|lora", re.I)),
    ("attention", re.compile(r"attn|attention|flash|paged|fmha|sdpa|_decode|_prefill|kv_write",
                             re.I)),
    ("sampling", re.compile(r"gumbel|sampl|sort|topk|top_k|argmax|softmax|threshold|penalt", re.I)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|matmul|cublas|sm90_|splitk", re.I)),
]


def classify(name: str) -> str:
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return cls
    return "elementwise"


def add_parser(sub: Any) -> None:
    from photon.cli import RawDescriptionHelpFormatter

    p = sub.add_parser("profile", description=__doc__,
                       help="GPU time of a decode step by kernel class (attention, GEMM, ...).",
                       formatter_class=RawDescriptionHelpFormatter)
    add_model_source_args(p, default_shape=None)
    p.add_argument("--batch-size", type=int, default=256, help="Requests decoding together.")
    p.add_argument("--prompt-len", type=int, default=1024, help="Context length before decoding.")
    p.add_argument("--steps", type=int, default=16, help="Profiled decode steps.")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="Decode steps before profiling starts.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy sampling.")
    p.add_argument("--output-mode", choices=("final", "delta"), default="final",
                   help="final: outputs only at the end (offline); delta: streamed every step.")
    p.add_argument("--refills-per-step", type=int, default=0, metavar="R",
                   help="New requests added before each profiled step (default 0: decode steps "
                        "only).")
    p.add_argument("--refill-prompt-len", type=int, default=128,
                   help="Prompt tokens of each refill request (default 128).")
    p.add_argument("--host-profile", action="store_true",
                   help="Before the kernel profile: the steps' wall time without any profiler, "
                        "then their host time under cProfile by function (cumulative), in "
                        "`host_profile`.")
    from photon.cli import add_engine_args

    add_engine_args(p)
    add_lora_args(p)
    p.set_defaults(func=run_profile)


def _breakdown(prof: torch.profiler.profile, wall_s: float, steps: int) -> dict[str, Any]:
    totals = dict.fromkeys([cls for cls, _ in KERNEL_CLASSES] + ["elementwise"], 0.0)
    top: dict[str, float] = {}
    launches = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
        totals[classify(evt.name)] += us
        launches += 1
        top[evt.name] = top.get(evt.name, 0.0) + us
    busy_ms = sum(totals.values()) / 1e3
    wall_ms = wall_s * 1e3
    per_step = {k: v / 1e3 / steps for k, v in totals.items()}
    per_step["idle"] = max(wall_ms - busy_ms, 0.0) / steps
    heaviest = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    host = sorted(((e.key, e.self_cpu_time_total) for e in prof.key_averages()),
                  key=lambda kv: -kv[1])[:12]
    return {"ms_per_step": per_step, "wall_ms_per_step": wall_ms / steps,
            "fraction": {k: v / (wall_ms / steps) for k, v in per_step.items()},
            "kernels_per_step": launches / steps,
            "top_kernels_ms_per_step": {k[:90]: v / 1e3 / steps for k, v in heaviest},
            "top_host_ops_self_ms_per_step": {k[:90]: v / 1e3 / steps for k, v in host}}


def add_refills(core: Any, count: int, prompt_len: int, max_tokens: int, seed: int,
                loras: list[Any] | None = None) -> None:
    """`count` greedy requests of `prompt_len` random tokens and `max_tokens` output tokens (EOS
    ignored): the next step prefills them beside the decode rows. With `loras`, refill i runs
    loras[(seed + i) % len(loras)]."""
    rng = random.Random(seed)
    for i in range(count):
        prompt = [rng.randrange(3, 1000) for _ in range(prompt_len)]
        core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True),
                         lora_request=loras[(seed + i) % len(loras)] if loras else None)


def _run_steps(core: Any, ns: argparse.Namespace, seed: int,
               loras: list[Any] | None = None) -> float:
    """`ns.steps` steps (each after its refills); returns their wall seconds, GPU included."""
    t0 = time.perf_counter()
    for step in range(ns.steps):
        add_refills(core, ns.refills_per_step, ns.refill_prompt_len, ns.steps - step + 1,
                    seed + step, loras)
        core.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def host_profile(core: Any, ns: argparse.Namespace, top: int = 30,
                 loras: list[Any] | None = None) -> dict[str, Any]:
    """The steps' wall ms without a profiler, then the heaviest functions (cumulative host ms
    per step under cProfile, which inflates Python-heavy code) of as many steps again."""
    wall = _run_steps(core, ns, 10_000, loras)
    prof = cProfile.Profile()
    prof.enable()
    _run_steps(core, ns, 20_000, loras)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(((f"{fn.rsplit('/', 2)[-1] if '/' in fn else fn}:{line}({name})", cum)
                   for (fn, line, name), (_, _, _, cum, _) in stats.items()),
                  key=lambda kv: -kv[1])[:top]
    return {"wall_ms_per_step": wall * 1e3 / ns.steps,
            "cumulative_ms_per_step": {k: v * 1e3 / ns.steps for k, v in rows}}


def run_profile(ns: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("photon bench profile needs a CUDA GPU (it reads CUDA kernel times)")
    if ns.model is None and ns.model_shape is None:
        ns.model_shape = "qwen3-0.6b"
    if ns.refills_per_step < 0 or ns.refill_prompt_len < 1:
        raise ValueError("--refills-per-step must be >= 0 and --refill-prompt-len >= 1, got "
                         f"{ns.refills_per_step}, {ns.refill_prompt_len}")
    lora = check_lora_args(ns)
    rounds = 3 if ns.host_profile else 1  # --host-profile: two more rounds of steps first
    # The batch decodes through every round (its requests' lengths count all of them).
    whole = argparse.Namespace(**{**vars(ns), "steps": rounds * ns.steps})
    if ns.max_model_len is None:
        ns.max_model_len = max(decode_len_needed(whole, ns.batch_size),
                               ns.refill_prompt_len + ns.steps + 1)
    ns.max_num_seqs = max(ns.max_num_seqs, ns.batch_size
                         + ns.refills_per_step * (rounds * ns.steps + ns.warmup_steps))
    with tempfile.TemporaryDirectory() as tmp:  # the adapters are read while the steps run
        result = _profile(ns, whole, lora, tmp)
    print(json.dumps(result))
    return 0


def _profile(ns: argparse.Namespace, whole: argparse.Namespace, lora: Any, tmp: str
             ) -> dict[str, Any]:
    from photon.llm import LLM
    from photon.model.tiny import resolve_model_path

    args = bench_engine_args(ns, tmp)
    adapters = (write_adapters(lora, resolve_model_path(args.model), tmp)
                if lora.num_adapters else [])
    loras = assign(adapters, ns.batch_size, lora.assignment, 0)  # the refills cycle through it
    llm = LLM(**asdict(args))
    core = llm.engine
    _start_batch(core, ns.batch_size, whole, loras)
    for step in range(ns.warmup_steps if ns.refills_per_step else 0):
        # Mixed steps compile their own kernel variants: keep that out of the profiled steps.
        add_refills(core, ns.refills_per_step, ns.refill_prompt_len, 2, -1 - step, loras)
        core.step()
    torch.cuda.synchronize()
    host = host_profile(core, ns, loras=loras) if ns.host_profile else None
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        wall = _run_steps(core, ns, 0, loras)
    result = {"benchmark": "profile", "model_shape": ns.model_shape, "batch_size": ns.batch_size,
              "context": ns.prompt_len, "refills_per_step": ns.refills_per_step,
              "refill_prompt_len": ns.refill_prompt_len, "pipelined": args.pipelined,
              "attention_backend": core.runner.backend.name,
              "num_lora_adapters": lora.num_adapters, "lora_rank": lora.rank,
              **_breakdown(prof, wall, ns.steps), **gpu_info("cuda")}
    if host is not None:
        result["host_profile"] = host
    return result
