"""Host-side cProfile of one pipelined JSON-schema batch (the `records` schema of
`photon bench structured`), to find the engine thread's per-step Python costs.

Usage: python tools/profile_structured_host.py [--batch 128] [--shape qwen3-0.6b] [--top 45]
Prints, per function under photon/ or xgrammar, its cumulative and own ms per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile

from photon.bench.shapes import materialize_shape
from photon.bench.structured import SCHEMAS, grammar_batch, run_batch, warm_up
from photon.llm import LLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--top", type=int, default=45)
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=materialize_shape(ns.shape, tmp), load_format="dummy",
                  max_num_seqs=ns.batch, max_model_len=1200)
    core = llm.engine
    prompts, params = grammar_batch(ns.batch, SCHEMAS["records"], 64, 1024)
    warm_up(core, prompts, params)
    run_batch(core, prompts, params)  # warm: every shape compiled
    steps0 = core.runner.step_count
    prof = cProfile.Profile()
    prof.enable()
    _, wall, _ = run_batch(core, prompts, params)
    prof.disable()
    steps = core.runner.step_count - steps0
    print(f"{steps} steps, {1e3 * wall / steps:.2f} ms/step under cProfile")
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:ns.top]
    for (path, line, func), (_, calls, own, cum, _) in rows:
        where = path.split("site-packages/")[-1].split("/photon/")[-1]
        print(f"{1e3 * own / steps:8.3f} own {1e3 * cum / steps:8.3f} cum  {calls:8d}  "
              f"{where}:{line}({func})")


if __name__ == "__main__":
    main()
