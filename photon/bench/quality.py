"""`photon bench quality`: what a quantization scheme costs in quality, against the same model
unquantized (bfloat16 on CUDA, float32 on CPU).

Both models run over the same held-out windows through photon's own runner (its attention
backend, KV cache and quantized layers: one prefill per window) and give full next-token
distributions: per-token KL(reference || quantized) (mean, p99), top-1 agreement, perplexity of
both and its relative change. Then both generate greedily from a prompt set (photon's engine,
CUDA graphs and all): the share of prompts whose N-token continuation differs. One JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from photon.bench.cli import gpu_info, on_cuda

REF_FIELDS = {"quantization": None, "kv_cache_dtype": "auto", "calculate_kv_scales": False}


@dataclass(frozen=True)
class QualityReport:
    kl_mean: float  # nats per token
    kl_p99: float
    top1_agreement: float  # share of positions whose argmax is the reference's
    perplexity_ref: float
    perplexity: float
    perplexity_delta: float  # relative: perplexity / perplexity_ref - 1
    greedy_flips: float  # share of prompts whose greedy continuation differs
    tokens: int  # scored positions
    windows: int
    prompts: int
    greedy_tokens: int


def add_parser(bench_sub: Any) -> None:
    from photon.cli import add_engine_args

    p = bench_sub.add_parser(
        "quality", help="Quality of a quantized model (or KV cache) against the unquantized one.",
        description="Score held-out text with the model as configured (--quantization, "
                    "--kv-cache-dtype) and unquantized (bfloat16 on CUDA, float32 on CPU): "
                    "per-token KL divergence of the next-token distributions (mean, p99), top-1 "
                    "agreement, perplexity of both and the delta, and the share of prompts whose "
                    "greedy continuation differs. Last stdout line: JSON summary.")
    g = p.add_argument_group("held-out data")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="A `python -m photon.train prepare` directory (its held-out code), a "
                        "JSON list of token-id lists (or of objects with token_ids), or a text "
                        "file (tokenized with the model's tokenizer). Default: random token ids.")
    g.add_argument("--num-windows", type=int, default=16, help="Windows scored (default 16).")
    g.add_argument("--window-len", type=int, default=256, help="Tokens per window (default 256).")
    g.add_argument("--num-prompts", type=int, default=16,
                   help="Prompts of the greedy-flip check (default 16).")
    g.add_argument("--prompt-len", type=int, default=64, help="Their length (default 64).")
    g.add_argument("--greedy-tokens", type=int, default=32,
                   help="Tokens generated greedily per prompt (default 32).")
    g.add_argument("--reference-model", default=None, metavar="DIR",
                   help="The unquantized model to compare against (default: --model). Give it "
                        "for a quantized checkpoint: the model it was quantized from (e.g. "
                        "`photon quantize`'s --model).")
    g.add_argument("--output-json", default=None, metavar="PATH",
                   help="Also write the JSON summary to PATH.")
    add_engine_args(p)
    p.set_defaults(func=run_quality)


def run_quality(ns: argparse.Namespace) -> int:
    from photon.cli import engine_args_from

    for name in ("num_windows", "window_len", "num_prompts", "prompt_len", "greedy_tokens"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(ns, name)}")
    args = engine_args_from(ns)
    report = measure_quality(args, ns)
    fields = {"benchmark": "quality", "model": args.model,
              "reference_model": ns.reference_model or args.model,
              "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype,
              "calculate_kv_scales": args.calculate_kv_scales,
              "data": ns.data or "random", **asdict(report), **gpu_info(args.device)}
    line = json.dumps(fields)
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


def reference_args(args: Any, reference_model: str | None = None) -> Any:
    """The same engine, unquantized: no --quantization, a model-dtype KV cache, bf16 on CUDA;
    `reference_model` (a quantized checkpoint's source) in place of the model if given."""
    dtype = "bfloat16" if on_cuda(args.device) else "float32"
    model = reference_model or args.model
    return dataclasses.replace(args, model=model, dtype=dtype, **REF_FIELDS)


def measure_quality(args: Any, ns: argparse.Namespace) -> QualityReport:
    from photon.bench.quality_data import load_token_windows

    ref_args = reference_args(args, ns.reference_model)
    config = args.create_config()
    windows = load_token_windows(ns.data, ns.num_windows, ns.window_len, config.model)
    prompts = load_token_windows(ns.data, ns.num_prompts, ns.prompt_len, config.model,
                                 seed=1)
    scores = _compare_logits(ref_args, args, windows)
    flips = _greedy_flips(ref_args, args, prompts, ns.greedy_tokens)
    kl = torch.cat(scores["kl"])
    nll_ref, nll = torch.cat(scores["nll_ref"]), torch.cat(scores["nll"])
    ppl_ref, ppl = math.exp(nll_ref.mean().item()), math.exp(nll.mean().item())
    return QualityReport(
        kl_mean=kl.mean().item(), kl_p99=torch.quantile(kl, 0.99).item(),
        top1_agreement=torch.cat(scores["top1"]).float().mean().item(),
        perplexity_ref=ppl_ref, perplexity=ppl, perplexity_delta=ppl / ppl_ref - 1.0,
        greedy_flips=flips, tokens=kl.numel(), windows=len(windows), prompts=len(prompts),
        greedy_tokens=ns.greedy_tokens)


def _compare_logits(ref_args: Any, args: Any, windows: list[list[int]]
                    ) -> dict[str, list[torch.Tensor]]:
    """Per-position KL, top-1 agreement and both NLLs of every window (float64 sums)."""
    from photon.bench.quality_data import WindowScorer

    ref, test = WindowScorer(ref_args, len(windows[0])), WindowScorer(args, len(windows[0]))
    out: dict[str, list[torch.Tensor]] = {"kl": [], "top1": [], "nll_ref": [], "nll": []}
    for ids in windows:
        lp_ref, lp = ref.log_probs(ids), test.log_probs(ids)  # [T, V] float32 on the CPU
        targets = torch.tensor(ids[1:], dtype=torch.long)
        # KL(P_ref || P): sum_v p_ref (log p_ref - log p), >= 0 (clamped: rounding).
        kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0.0)
        out["kl"].append(kl)
        out["top1"].append(lp_ref.argmax(-1) == lp.argmax(-1))
        out["nll_ref"].append(-lp_ref[:-1].gather(1, targets[:, None])[:, 0].double())
        out["nll"].append(-lp[:-1].gather(1, targets[:, None])[:, 0].double())
    ref.close()
    test.close()
    return out


def _greedy_flips(ref_args: Any, args: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """The share of prompts whose greedy continuation of max_tokens differs (engines run one
    after the other: one model's memory at a time)."""
    outputs = [_greedy(a, prompts, max_tokens) for a in (ref_args, args)]
    return sum(a != b for a, b in zip(*outputs)) / len(prompts)


def _greedy(args: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from photon import LLM, SamplingParams

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "model"}
    llm = LLM(args.model, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
