"""Offline generation in process (`LLM.generate`) against the engine core in its own process
(`AsyncLLM`, what `photon serve` runs), on the same requests, in one run.

Usage: python tools/bench_offline_process.py [--model-shape qwen3-0.6b] [--num-prompts 256]
           [--input-len 1024] [--output-len 256]
Prints one JSON line with both throughputs (output tokens / wall time, after a warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

from photon import LLM, SamplingParams
from photon.bench.shapes import materialize_shape
from photon.engine.async_engine import RequestSink
from photon.engine.async_llm import AsyncLLM
from photon.engine_args import EngineArgs


def _engine_kwargs(ns: argparse.Namespace, workdir: str) -> dict:
    if ns.model_shape == "tiny":
        return {"max_model_len": ns.input_len + ns.output_len}
    return {"model": materialize_shape(ns.model_shape, workdir), "load_format": "dummy",
            "dtype": "bfloat16", "max_model_len": ns.input_len + ns.output_len}


def _requests(ns: argparse.Namespace, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(ns.input_len)]
            for i in range(ns.num_prompts)]


async def _process_run(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams
                       ) -> int:
    sink = RequestSink()
    for i, p in enumerate(prompts):
        await engine.add_request(p, params, f"r{time.monotonic_ns()}-{i}", sink, tag=i)
    done, tokens = 0, 0
    while done < len(prompts):
        _, out = await sink.get()
        tokens += sum(len(c.token_ids) for c in out.outputs)
        done += out.finished
    return tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-shape", default="tiny", choices=["tiny", "qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    ns = p.parse_args()
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=ns.output_len)
    result = {"model_shape": ns.model_shape, "num_prompts": ns.num_prompts,
              "input_len": ns.input_len, "output_len": ns.output_len}
    with tempfile.TemporaryDirectory() as workdir:
        config = EngineArgs(**_engine_kwargs(ns, workdir)).create_config()
        prompts = _requests(ns, config.model.vocab_size)
        # The engine-core process first: its exit frees the GPU for the in-process engine.
        engine = AsyncLLM(config)
        engine.start()
        try:
            asyncio.run(_process_run(engine, prompts[:8], params))  # warm-up
            start = time.perf_counter()
            tokens = asyncio.run(_process_run(engine, prompts, params))
            result["engine_process_tok_per_s"] = tokens / (time.perf_counter() - start)
        finally:
            engine.shutdown()
        llm = LLM(**_engine_kwargs(ns, workdir))
        llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["in_process_tok_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (
            time.perf_counter() - start)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
