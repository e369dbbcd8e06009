"""Host-side cProfile of the engine thread: a pipelined JSON-schema batch (the `records` schema of
`photon bench structured`) against its unconstrained twin (same prompts, same output lengths), to
find what a grammar step adds to the engine thread's Python.

Usage: python tools/profile_structured_host.py [--batch 128] [--shape qwen3-0.6b] [--top 45]
Prints ms/step of both runs (inflated by cProfile), then per function its own-time and
cumulative-time difference per step (JSON - plain), largest first. Without a GPU the shape is
shrunk to one small layer (the tokenizer, so the grammar work, stays full size).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile

import torch

from photon.bench.shapes import materialize_shape
from photon.bench.structured import SCHEMAS, grammar_batch, run_batch, warm_up
from photon.engine.engine_core import EngineCore
from photon.llm import LLM
from photon.sampling_params import SamplingParams

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, torch_dtype="float32")


def _profile(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
             ) -> tuple[dict, int, float]:
    steps0 = core.scheduler.num_steps
    prof = cProfile.Profile()
    prof.enable()
    _, wall, _ = run_batch(core, prompts, params)
    prof.disable()
    steps = core.scheduler.num_steps - steps0
    own_cum = {k: (v[2], v[3], v[1]) for k, v in pstats.Stats(prof).stats.items()}
    return own_cum, steps, wall


def _engine(shape: str, batch: int) -> EngineCore:
    """The shape with random weights (shrunk to one small layer without a GPU); the engine keeps
    what it needs, so the directory goes right after."""
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize_shape(shape, tmp)
        if not torch.cuda.is_available():
            cfg_path = os.path.join(path, "config.json")
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f) | SMALL
            with open(cfg_path, "w", encoding="utf-8") as f:
                json.dump(cfg, f)
        return LLM(model=path, load_format="dummy", max_num_seqs=batch,
                   max_model_len=1200).engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--top", type=int, default=45)
    ns = p.parse_args()
    core = _engine(ns.shape, ns.batch)
    prompts, params = grammar_batch(ns.batch, SCHEMAS["records"], 64, 1024)
    warm_up(core, prompts, params)
    lengths, _, _ = run_batch(core, prompts, params)  # warm: every shape compiled
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
             for i, n in enumerate(lengths)]
    run_batch(core, prompts, plain)
    js, nj, wj = _profile(core, prompts, params)
    pl, npl, wp = _profile(core, prompts, plain)
    print(f"json {nj} steps {1e3 * wj / nj:.2f} ms/step; plain {npl} steps "
          f"{1e3 * wp / npl:.2f} ms/step (under cProfile)")
    rows = []
    for key in set(js) | set(pl):
        a, b = js.get(key, (0.0, 0.0, 0)), pl.get(key, (0.0, 0.0, 0))
        rows.append((1e3 * (a[0] / nj - b[0] / npl), 1e3 * (a[1] / nj - b[1] / npl),
                     a[2] / nj, b[2] / npl, key))
    rows.sort(key=lambda r: -r[0])
    print(f"sum of own-time differences: {sum(r[0] for r in rows):.3f} ms/step")
    print("own-diff cum-diff  calls/step json plain")
    for own, cum, cj, cp, (path_, line, func) in rows[:ns.top]:
        where = path_.split("site-packages/")[-1].split("/photon/")[-1]
        print(f"{own:8.3f} {cum:8.3f}  {cj:7.1f} {cp:7.1f}  {where}:{line}({func})")


if __name__ == "__main__":
    main()
