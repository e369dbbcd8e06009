"""`photon bench serve --dataset-name multiturn`: multi-turn chats (photon.bench.multiturn).

Conversations start at --request-rate (default: all at once) and at most --max-concurrency of
them are open at a time (a conversation holds its slot from its first turn to its last). Within
a conversation each turn is sent once the previous answer has arrived, and carries the whole
history with the model's actual answers. Reports the usual latencies and throughput over every
turn, the median TTFT of each turn, and the servers' prefix hit rate and prefill tokens computed
(photon.bench.serve_prefix) from their /metrics before and after the run: --metrics-urls names
the servers (the backends behind a router), default --base-url.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from photon.bench.multiturn import (
    ConversationPlan,
    MultiTurnOptions,
    fit_plans,
    plan_conversations,
    render_transcript,
    turn_messages,
)
from photon.bench.serve_metrics import RequestRecord
from photon.bench.serve_report import log
from photon.bench.serve_workload import RequestSpec

NOT_SENT = "not sent: an earlier turn of its conversation failed"


def add_multiturn_args(p: argparse.ArgumentParser) -> None:
    d = MultiTurnOptions()
    g = p.add_argument_group("multi-turn chats (--dataset-name multiturn)")
    g.add_argument("--num-conversations", type=int, default=d.num_conversations,
                   help="Conversations of the run.")
    g.add_argument("--num-turns", type=int, default=d.num_turns,
                   help="User turns per conversation.")
    g.add_argument("--system-prompt-len", type=int, default=d.system_prompt_len,
                   help="Tokens of each group's shared system prompt (0: none).")
    g.add_argument("--num-groups", type=int, default=d.num_groups,
                   help="Distinct system prompts: the conversations are split into this many "
                        "groups of consecutive conversations, each sharing one.")
    g.add_argument("--turn-len", type=int, default=d.turn_len,
                   help="Tokens of each user message.")
    g.add_argument("--output-len", type=int, default=d.output_len,
                   help="Tokens of each answer (EOS is ignored).")
    g.add_argument("--metrics-urls", nargs="+", default=None, metavar="URL",
                   help="Servers whose /metrics give the prefix-cache counters (the backends "
                        "behind a router; default: --base-url).")


_FLAGS = ("num_conversations", "num_turns", "system_prompt_len", "num_groups", "turn_len",
          "output_len", "metrics_urls")


def check_multiturn_args(ns: argparse.Namespace) -> None:
    """The multi-turn flags are valid with --dataset-name multiturn and absent without it."""
    if ns.dataset_name == "multiturn":
        multiturn_options(ns)
        return
    defaults = {**vars(MultiTurnOptions()), "metrics_urls": None}
    given = [f for f in _FLAGS if getattr(ns, f) != defaults[f]]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ValueError(f"{flags}: only for --dataset-name multiturn (this run's dataset "
                         f"is {ns.dataset_name})")


def multiturn_options(ns: argparse.Namespace) -> MultiTurnOptions:
    """The options of a multiturn run; ValueError for flags that do not apply to it."""
    if ns.num_prompts is not None:
        raise ValueError("--num-prompts is not used by --dataset-name multiturn: it sends "
                         "--num-conversations x --num-turns requests")
    if ns.sweep or ns.sweep_concurrency:
        raise ValueError("--sweep / --sweep-concurrency do not apply to --dataset-name "
                         "multiturn; run it once per --max-concurrency")
    opts = MultiTurnOptions(ns.num_conversations, ns.num_turns, ns.system_prompt_len,
                            ns.num_groups, ns.turn_len, ns.output_len, ns.seed)
    opts.check()
    return opts


def check_fits(opts: MultiTurnOptions, max_model_len: int | None) -> None:
    """The last turn (its prompt and answer) must fit the server's max_model_len."""
    need = (opts.system_prompt_len + opts.num_turns * (opts.turn_len + opts.output_len))
    if max_model_len is not None and need > max_model_len:
        raise ValueError(
            f"a conversation's last turn needs at least {need} tokens (system prompt + "
            f"{opts.num_turns} x (turn + answer)), more than the server's max_model_len of "
            f"{max_model_len}; lower --num-turns, --turn-len, --output-len or "
            "--system-prompt-len")


async def sized_plans(cfg: Any, opts: MultiTurnOptions,
                      tokenizer_dir: str | None) -> list[ConversationPlan]:
    """The conversations, each text cut to its token count with the server's /tokenize (or
    --tokenizer DIR); without one, word counts stand in for token counts."""
    from photon.bench.serve_tokenizer import open_tokenizer

    plans = plan_conversations(opts)
    try:
        async with open_tokenizer(cfg, tokenizer_dir) as tok:
            async def fit(text: str, n: int) -> str:
                return await tok.decode((await tok.encode(text, add_special_tokens=False))[:n])

            return await fit_plans(plans, opts, fit)
    except ValueError:
        raise
    except Exception as e:  # a server without /tokenize
        log(f"texts are not cut to exact token counts ({type(e).__name__}: {e}); one common "
            "word stands for one token (--tokenizer DIR counts locally)")
        return plans


def turn_spec(cfg: Any, plan: ConversationPlan, answers: Sequence[str],
              output_len: int) -> RequestSpec:
    """Turn len(answers) of `plan`: chat messages, or their transcript for completions."""
    messages = turn_messages(plan, answers)
    if cfg.chat:
        return RequestSpec("", output_len, None, messages)
    return RequestSpec(render_transcript(messages), output_len)


async def _conversation(session: Any, cfg: Any, plan: ConversationPlan, opts: MultiTurnOptions,
                        at: float, t0: float,
                        sem: asyncio.Semaphore | None) -> list[RequestRecord]:
    from photon.bench.serve_client import send_request

    delay = t0 + at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    answers: list[str] = []
    records: list[RequestRecord] = []
    async with sem if sem is not None else contextlib.nullcontext():
        for _ in range(opts.num_turns):
            record = await send_request(session, cfg, turn_spec(cfg, plan, answers,
                                                                opts.output_len), t0)
            records.append(record)
            if not record.success:
                break
            answers.append(record.text)
    missing = opts.num_turns - len(records)
    return records + [RequestRecord(False, opts.output_len, error=NOT_SENT)
                      for _ in range(missing)]


async def run_conversations(cfg: Any, plans: Sequence[ConversationPlan],
                            opts: MultiTurnOptions, offsets: Sequence[float],
                            max_concurrency: int | None) -> tuple[list[list[RequestRecord]],
                                                                  float]:
    """Every conversation (starting at its offset, s); its records in turn order, and the run's
    wall time (s)."""
    from photon.bench.serve_client import make_session

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with make_session(cfg, max_concurrency or len(plans)) as session:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(_conversation(session, cfg, p, opts, at, t0, sem)
                                      for p, at in zip(plans, offsets)))
        return list(runs), time.perf_counter() - t0


def ttft_by_turn(conversations: Sequence[Sequence[RequestRecord]]) -> list[float | None]:
    """The median TTFT (ms) of each turn over the conversations that completed it."""
    turns = max((len(c) for c in conversations), default=0)
    out: list[float | None] = []
    for t in range(turns):
        values = [c[t].ttft * 1e3 for c in conversations
                  if len(c) > t and c[t].success and c[t].ttft is not None]
        out.append(float(np.median(values)) if values else None)
    return out


def run_multiturn(ns: argparse.Namespace, cfg: Any, served: Any,
                  slos: dict[str, float]) -> int:
    """The whole multiturn run: plan, warm up, run, report."""
    opts = multiturn_options(ns)
    check_fits(opts, served.max_model_len if served is not None else None)
    plans = asyncio.run(sized_plans(cfg, opts, ns.tokenizer))
    log(f"{opts.num_conversations} conversations x {opts.num_turns} turns, "
        f"{opts.num_groups} system prompts of {opts.system_prompt_len} tokens")
    if not _warmup(cfg, opts, ns.warmup_requests):
        return 1
    return report_run(ns, cfg, opts, plans, slos)


def _warmup(cfg: Any, opts: MultiTurnOptions, count: int) -> bool:
    """Untimed short requests on texts no conversation shares."""
    import random

    from photon.bench.multiturn import word_text
    from photon.bench.serve import warmup

    rng = random.Random(f"warm-up {opts.seed}")
    specs = [RequestSpec(word_text(rng, 32), min(opts.output_len, 16))
             for _ in range(max(count, 1))]
    return asyncio.run(warmup(cfg, specs, count))


def report_run(ns: argparse.Namespace, cfg: Any, opts: MultiTurnOptions,
               plans: Sequence[ConversationPlan], slos: dict[str, float]) -> int:
    """Run the conversations between two reads of the servers' counters; print and write the
    summary (the last stdout line is its JSON)."""
    from photon.bench.cli import cost_fields
    from photon.bench.serve_metrics import aggregate, arrival_offsets
    from photon.bench.serve_prefix import fetch_prefix_counters, prefix_fields
    from photon.bench.serve_report import emit, print_human
    from photon.bench.serve_spec import fetch_spec_counters, spec_delta_fields

    urls = list(ns.metrics_urls or [cfg.base_url])
    offsets = arrival_offsets(len(plans), ns.request_rate, ns.burstiness, ns.seed)
    before = asyncio.run(fetch_prefix_counters(cfg, urls))
    spec_before = asyncio.run(fetch_spec_counters(cfg))
    conversations, duration = asyncio.run(run_conversations(cfg, plans, opts, offsets,
                                                            ns.max_concurrency))
    spec = spec_delta_fields(spec_before, asyncio.run(fetch_spec_counters(cfg)))
    prefix = prefix_fields(before, asyncio.run(fetch_prefix_counters(cfg, urls)))
    records = [r for c in conversations for r in c]
    metrics = aggregate(records, duration, slos)
    summary = {"benchmark": "serve", **metrics, **spec, **prefix,
               "median_ttft_ms_by_turn": ttft_by_turn(conversations),
               **cost_fields(ns.gpu_cost_per_hour, ns.num_gpus, metrics["output_throughput"]),
               **_params(ns, cfg, opts, urls)}
    if ns.save_requests:
        from dataclasses import asdict

        summary["requests"] = [asdict(r) for r in records]
    print_human(summary, _prefix_rows(summary))
    emit(ns, summary, [summary])
    return 0


def _prefix_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    rate = s["prefix_hit_rate"]
    return [("Prefix cache hit rate", "n/a" if rate is None else f"{rate:.3f}"),
            ("Prefill tokens computed", s["prefill_tokens"]),
            ("Median TTFT by turn (ms)", " ".join(
                "-" if v is None else f"{v:.1f}" for v in s["median_ttft_ms_by_turn"]))]


def _params(ns: argparse.Namespace, cfg: Any, opts: MultiTurnOptions,
            urls: Sequence[str]) -> dict[str, Any]:
    from dataclasses import asdict

    return {"label": ns.label or cfg.model, "model": cfg.model, "base_url": cfg.base_url,
            "endpoint": cfg.endpoint, "dataset_name": "multiturn", **asdict(opts),
            "num_prompts": opts.num_requests, "max_concurrency": ns.max_concurrency,
            "request_rate": "inf" if ns.request_rate == float("inf") else ns.request_rate,
            "burstiness": ns.burstiness, "temperature": ns.temperature, "metrics_urls": urls,
            "goodput_slos_ms": None, "sweep": None}
