"""Micro-benchmark of the Triton draw (`photon.kernels.sampling._gumbel_argmax_kernel`) on CUDA:
microseconds a launch for 32/128/256 rows of a 151,936-id vocabulary, with and without a grammar
mask, per (num_warps, BLOCK); every variant must draw the same tokens as the first.

Usage: python tools/bench_draw_kernel.py [--old FILE]
--old FILE: also time the kernel of another copy of photon/kernels/sampling.py (e.g. from
`git show REV:photon/kernels/sampling.py > FILE`). Prints one JSON object per measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from types import ModuleType

import torch

from photon.kernels import sampling

VOCAB, WORDS = 151936, 3835
CONFIGS = ((8, 4096), (16, 4096), (32, 4096), (16, 8192), (32, 8192))  # (num_warps, BLOCK)


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("other_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _time(module: ModuleType, rows: int, masked: bool, warps: int, block: int,
          iters: int = 200) -> tuple[float, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=g) * 3
    temp = torch.full((rows,), 1.0, device="cuda")
    keys = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919
    counters = torch.arange(rows, device="cuda", dtype=torch.int64)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, WORDS), device="cuda", dtype=torch.int32,
                         generator=g)
    tail = torch.zeros(rows, device="cuda", dtype=torch.int32)
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    b, t, words = (bits, tail, WORDS) if masked else (temp, temp, 0)

    def launch() -> None:
        module._gumbel_argmax_kernel[(rows,)](
            logits, logits.stride(0), VOCAB, temp, keys, counters, temp, out, 1e-5, b, t, words,
            min(VOCAB, 32 * words), HAS_THRESHOLD=False, HAS_MASK=masked, BLOCK=block,
            num_warps=warps)

    for _ in range(5):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        launch()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters, out.clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", default=None)
    ns = p.parse_args()
    impls = [("current", sampling)] + ([("old", _load(ns.old))] if ns.old else [])
    for rows in (32, 128, 256):
        for masked in (False, True):
            first = None
            for name, module in impls:
                for warps, block in CONFIGS:
                    us, tokens = _time(module, rows, masked, warps, block)
                    first = tokens if first is None else first
                    print(json.dumps({"rows": rows, "masked": masked, "impl": name,
                                      "num_warps": warps, "block": block, "us": round(us, 1),
                                      "same_tokens": bool(torch.equal(first, tokens))}),
                          flush=True)


if __name__ == "__main__":
    main()
