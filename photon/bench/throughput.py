"""`photon bench throughput`: offline throughput on the standard workload, against the roofline.

Progress goes to stderr (a tqdm bar of finished prompts while timing); the last stdout line is one
JSON object summarizing the run. Throughput = output tokens / wall time of the whole generate call
(prefill included), after a small warm-up generate. On CPU the defaults are CPU-sized (CPU_DEFAULTS:
fewer and shorter requests, drawn the same way), so that a run takes seconds, not hours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from photon.bench.cli import add_cost_args, check_cost_args, cost_fields, device_label, on_cuda
from photon.bench.roofline import ModelCosts, kv_bytes_per_token, roofline_tok_per_s
from photon.bench.throughput_lora import (
    LoRABench,
    add_lora_args,
    assign,
    check_lora_args,
    lora_summary,
    slot_loads,
    write_adapters,
)
from photon.bench.workload import Workload, fit_vocab, standard_workload, totals

WARMUP_MAX_TOKENS = 64  # the warm-up only has to touch every code path once


@dataclass(frozen=True)
class WorkloadDefaults:
    num_prompts: int
    input_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    warmup_prompts: int

    def describe(self, name: str) -> str:
        value = getattr(self, name)
        return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


CUDA_DEFAULTS = WorkloadDefaults(256, (100, 1024), (100, 1024), 16)  # the standard workload
CPU_DEFAULTS = WorkloadDefaults(16, (32, 256), (32, 256), 1)


def _default_help(name: str) -> str:
    return f"default {CUDA_DEFAULTS.describe(name)} on CUDA, {CPU_DEFAULTS.describe(name)} on CPU"


def add_parser(bench_sub: Any) -> None:
    from photon.bench.cli import add_model_source_args
    from photon.cli import add_engine_args

    p = bench_sub.add_parser(
        "throughput", help="Offline throughput on the standard workload vs the roofline.",
        description="Generate the standard offline workload (256 random token-id prompts of "
                    "100-1024 tokens, 100-1024 output tokens each, EOS ignored; on CPU a smaller "
                    "one, see the defaults below) and report output tokens/s, with the "
                    "memory-bandwidth roofline for comparison. A progress bar on stderr counts "
                    "finished prompts. Last stdout line: JSON summary.")
    _add_workload_args(p)
    add_lora_args(p)
    add_model_source_args(p, default_shape=None)
    add_engine_args(p)
    p.set_defaults(func=run_throughput)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload and roofline")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"Requests ({_default_help('num_prompts')}).")
    g.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help=f"Prompt length range, inclusive ({_default_help('input_len_range')}).")
    g.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help=f"Output length range, inclusive ({_default_help('output_len_range')}).")
    g.add_argument("--workload-seed", type=int, default=0,
                   help="Seed of the workload's Python `random` (default 0).")
    g.add_argument("--warmup-prompts", type=int, default=None,
                   help="Prompts in the warm-up generate before timing (0 = none; "
                        f"{_default_help('warmup_prompts')}).")
    g.add_argument("--hbm-bandwidth", type=float, default=None,
                   help="HBM bandwidth in bytes/s for the roofline (default: measured on CUDA, "
                        "none on CPU = no roofline).")
    g.add_argument("--peak-flops", type=float, default=None,
                   help="Dense FLOP/s for the roofline's prefill term (default: measured bf16 "
                        "matmul on CUDA; none on CPU = prefill not counted).")
    g.add_argument("--output-json", default=None, metavar="PATH",
                   help="Also write the JSON summary to PATH.")
    add_cost_args(g, num_gpus_flag=False)


def _log(msg: str) -> None:
    print(f"[bench throughput] {msg}", file=sys.stderr, flush=True)


def run_throughput(ns: argparse.Namespace) -> int:
    from photon.llm import LLM

    _cpu_sized_defaults(ns)
    _check_ranges(ns)
    check_cost_args(ns)
    lora = check_lora_args(ns)
    workload = standard_workload(ns.num_prompts, tuple(ns.input_len_range),
                                 tuple(ns.output_len_range), ns.workload_seed)
    with tempfile.TemporaryDirectory(prefix="photon-bench-") as workdir:
        args = _engine_args(ns, workdir)
        adapters = _adapters(lora, args.model, workdir)
        ceilings = _ceilings(ns, args.device)  # before the engine takes the GPU's memory
        _log(f"building the engine for {args.model or 'photon-tiny'}")
        llm = LLM(**dataclasses.asdict(args))
        workload = fit_vocab(workload, llm.config.model.vocab_size)
        if ns.warmup_prompts > 0:
            _warmup(llm, ns, adapters)
        before, loads_before = llm.engine.spec_stats(), slot_loads(llm)
        loras = assign(adapters, len(workload), lora.assignment, ns.workload_seed)
        elapsed, output_tokens, ttft = _timed_generate(llm, workload, loras)
        summary = _summary(ns, llm, workload, elapsed, output_tokens, ceilings)
        summary.update(ttft)
        summary.update(_spec_summary(before, llm.engine.spec_stats()))
        summary.update(lora_summary(lora, llm, slot_loads(llm) - loads_before))
    if summary["dollars_per_million_output_tokens"] is not None:
        _log(f"cost: ${summary['dollars_per_million_output_tokens']:.4f} per million output "
             f"tokens at ${ns.gpu_cost_per_hour}/GPU-hour")
    line = json.dumps(summary)
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


def _adapters(lora: LoRABench, model: str | None, workdir: str) -> list[Any]:
    """The synthetic LoRA adapters of the model, written under workdir (none when N = 0)."""
    from photon.model.tiny import resolve_model_path

    if lora.num_adapters == 0:
        return []
    _log(f"writing {lora.num_adapters} synthetic LoRA adapters of rank {lora.rank}")
    return write_adapters(lora, resolve_model_path(model), workdir)


def _spec_summary(before: Any, after: Any) -> dict[str, Any]:
    """The timed run's speculative decoding fields (the warm-up's counts left out)."""
    from photon.spec.stats import acceptance_summary

    fields = acceptance_summary(None if after is None else after.since(before))
    if after is not None:
        rates = ", ".join(f"{r:.3f}" for r in fields["spec_acceptance_rate_per_pos"])
        _log(f"speculative decoding: mean acceptance length "
             f"{fields['spec_mean_acceptance_length']:.3f}, acceptance per position [{rates}]")
    return fields


def _cpu_sized_defaults(ns: argparse.Namespace) -> None:
    """Fill the workload flags left unset with the device's defaults."""
    defaults = CUDA_DEFAULTS if on_cuda(ns.device) else CPU_DEFAULTS
    for f in dataclasses.fields(WorkloadDefaults):
        if getattr(ns, f.name) is None:
            setattr(ns, f.name, getattr(defaults, f.name))


def _check_ranges(ns: argparse.Namespace) -> None:
    if ns.num_prompts <= 0:
        raise ValueError(f"--num-prompts must be positive, got {ns.num_prompts}")
    for flag, (lo, hi) in (("--input-len-range", ns.input_len_range),
                           ("--output-len-range", ns.output_len_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{flag} needs 1 <= MIN <= MAX, got {lo} {hi}")


def _engine_args(ns: argparse.Namespace, workdir: str) -> Any:
    """EngineArgs; max_model_len defaults to the workload's longest request if the model allows."""
    from photon.bench.cli import bench_engine_args
    from photon.model.hf_config import load_hf_config
    from photon.model.tiny import resolve_model_path

    args = bench_engine_args(ns, workdir)
    if args.max_model_len is None:
        need = ns.input_len_range[1] + ns.output_len_range[1]
        hf_config = load_hf_config(resolve_model_path(args.model))
        if need <= int(hf_config.get("max_position_embeddings") or 2048):
            args.max_model_len = need
    return args


def _sampling(workload: Workload, max_tokens_cap: int | None = None) -> list[Any]:
    from photon.sampling_params import SamplingParams

    return [SamplingParams(temperature=0.0, ignore_eos=True,
                           max_tokens=min(out, max_tokens_cap or out)) for _, out in workload]


def _warmup(llm: Any, ns: argparse.Namespace, adapters: list[Any]) -> None:
    warm = standard_workload(ns.warmup_prompts, tuple(ns.input_len_range),
                             tuple(ns.output_len_range), ns.workload_seed + 1)
    warm = fit_vocab(warm, llm.config.model.vocab_size)
    _log(f"warm-up: {len(warm)} prompts, up to {WARMUP_MAX_TOKENS} output tokens each")
    llm.generate([ids for ids, _ in warm], _sampling(warm, WARMUP_MAX_TOKENS), use_tqdm=False,
                 lora_request=assign(adapters, len(warm), "round-robin", 0))


def _sync(llm: Any) -> None:
    import torch

    if llm.config.device == "cuda":
        torch.cuda.synchronize()


def _timed_generate(llm: Any, workload: Workload,
                    loras: list[Any] | None) -> tuple[float, int, dict[str, float | None]]:
    """Elapsed seconds, output tokens and the requests' time-to-first-token statistics
    (every request arrives at the start, so TTFT includes its wait for admission)."""
    prompt_tokens, want = totals(workload)
    _log(f"timing {len(workload)} prompts: {prompt_tokens} prompt, {want} output tokens")
    params = _sampling(workload)
    _sync(llm)
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in workload], params, use_tqdm=True,
                           lora_request=loras)
    _sync(llm)
    elapsed = time.perf_counter() - start
    got = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    if got != want:
        raise RuntimeError(f"generated {got} output tokens, the workload asked for {want}")
    _log(f"{got} output tokens in {elapsed:.3f} s = {got / elapsed:.1f} tok/s")
    return elapsed, got, ttft_stats(outputs)


def ttft_stats(outputs: list[Any]) -> dict[str, float | None]:
    """TTFT (first token's commit minus arrival) over the outputs, as `photon bench serve`
    reports it: mean/std/median/p90/p99_ttft_ms."""
    from photon.bench.serve_metrics import latency_stats

    return latency_stats("ttft", [1000 * (o.metrics.first_token_time - o.metrics.arrival_time)
                                  for o in outputs if o.metrics is not None
                                  and o.metrics.first_token_time is not None])


def model_costs(llm: Any) -> ModelCosts:
    """Weight bytes and parameters of the loaded model (tied weights once), KV bytes per token."""
    runner = llm.engine.runner
    params = list(runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    mc = llm.config.model
    kv = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                            runner.kv_caches[0].element_size())
    return ModelCosts(weight_bytes, kv, sum(p.numel() for p in params))


Ceilings = tuple[float | None, float | None]  # (HBM bytes/s, peak FLOP/s)


def _ceilings(ns: argparse.Namespace, device: str) -> Ceilings:
    """The flags, else measured on CUDA (then the peak-memory counter is reset), else None."""
    import torch

    from photon.bench.roofline import measure_hbm_bandwidth, measure_matmul_flops

    bandwidth, flops = ns.hbm_bandwidth, ns.peak_flops
    if device == "cpu" or not torch.cuda.is_available() or None not in (bandwidth, flops):
        return bandwidth, flops
    if bandwidth is None:
        bandwidth = measure_hbm_bandwidth("cuda")
        _log(f"measured HBM read bandwidth: {bandwidth / 1e12:.2f} TB/s")
    if flops is None:
        flops = measure_matmul_flops("cuda")
        _log(f"measured bf16 matmul: {flops / 1e12:.0f} TFLOP/s")
    torch.cuda.reset_peak_memory_stats()
    return bandwidth, flops


def _roofline(llm: Any, workload: Workload, ceilings: Ceilings) -> dict[str, Any]:
    bandwidth, flops = ceilings
    if not bandwidth:
        return {"roofline_tok_per_s": None, "hbm_bandwidth": None, "peak_flops": flops,
                "roofline_includes_prefill": False}
    requests = [(len(ids), out) for ids, out in workload]
    roof = roofline_tok_per_s(requests, model_costs(llm), bandwidth,
                              llm.config.scheduler.max_num_seqs, flops)
    return {"roofline_tok_per_s": roof, "hbm_bandwidth": bandwidth, "peak_flops": flops,
            "roofline_includes_prefill": bool(flops)}


def _peak_memory(device: str) -> int | None:
    """Peak bytes allocated on the GPU; None elsewhere (not measured)."""
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def _summary(ns: argparse.Namespace, llm: Any, workload: Workload, elapsed: float,
             output_tokens: int, ceilings: Ceilings) -> dict[str, Any]:
    from photon.bench.cli import gpu_info

    cfg = llm.config
    label = device_label(cfg.device)
    tp = cfg.parallel.tensor_parallel_size
    prompt_tokens, _ = totals(workload)
    out_tps = output_tokens / elapsed
    roof = _roofline(llm, workload, ceilings)
    fraction = out_tps / roof["roofline_tok_per_s"] if roof["roofline_tok_per_s"] else None
    return {
        "benchmark": "throughput",
        "output_tokens": output_tokens, "prompt_tokens": prompt_tokens, "elapsed_s": elapsed,
        "output_tok_per_s": out_tps, "total_tok_per_s": (prompt_tokens + output_tokens) / elapsed,
        **roof, "roofline_fraction": fraction,
        **cost_fields(ns.gpu_cost_per_hour, tp, out_tps),  # one GPU per tensor-parallel rank
        f"peak_{label}_memory_bytes": _peak_memory(cfg.device), **gpu_info(cfg.device),
        "pipelined": cfg.pipelined, "model": cfg.model.served_model_name,
        "model_shape": ns.model_shape if ns.model is None else None,
        "num_prompts": len(workload), "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "max_model_len": cfg.model.max_model_len, "tensor_parallel_size": tp,
        "enable_expert_parallel": cfg.parallel.enable_expert_parallel,
        "dtype": str(cfg.model.dtype).removeprefix("torch."),
        "attention_backend": getattr(llm.engine.runner.backend, "name", "")
        or cfg.attention_backend,
        "enforce_eager": cfg.enforce_eager, "device": cfg.device,
        "workload_seed": ns.workload_seed,
    }
