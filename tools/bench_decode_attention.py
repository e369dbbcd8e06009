"""Decode attention kernel against the HBM roofline: bf16 and FP8 KV caches, launch choices swept.

Usage: python tools/bench_decode_attention.py [--batch 256] [--context 1024] [--output-json F]

One decode step of one layer, for the Qwen3-0.6B (16 query / 8 KV heads) and Llama-3.1-8B
(32 / 8) head layouts, D = 128, 16-token pages scattered over the pool: every DecodeTuning in the
sweep is timed (median over replays of a CUDA graph of 20 launches; single launches timed by
events vary by +-20%) and its largest deviation from the default bf16 launch on the same
(dequantized) values is reported. The bandwidth fraction is KV bytes read / time / the measured HBM
read bandwidth. Prints one JSON line per (layout, cache dtype, tuning); needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict
from typing import Any

import torch

from photon.attention.kv_quant import LayerKVScales
from photon.attention.triton_paged import DecodeTuning, decode_attention
from photon.bench.roofline import measure_hbm_bandwidth, median_graph_ms
from photon.quant.numerics import FP8_DTYPE

LAYOUTS = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}
HEAD_DIM = 128
BLOCK_SIZE = 16


def _inputs(batch: int, context: int, heads: int, kv_heads: int, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pages = context // BLOCK_SIZE
    num_blocks = batch * pages + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM, generator=gen,
                        device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1
    tables = perm[: batch * pages].reshape(batch, pages).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, cache, tables, seq_lens


def _fp8_cache(cache: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, LayerKVScales]:
    k_scale = cache[0].abs().amax(dim=(0, 1, 3)).float() / 448.0
    v_scale = cache[1].abs().amax(dim=(0, 1, 3)).float() / 448.0
    scale = torch.stack([k_scale, v_scale]).reshape(2, 1, 1, kv_heads, 1)
    return (cache.float() / scale).to(FP8_DTYPE), LayerKVScales(k_scale, v_scale)


def sweep(cache_dtype: str) -> list[DecodeTuning]:
    if cache_dtype == "bf16":
        return [DecodeTuning(n, 4, s, False) for n in (64, 128) for s in (2, 3, 4)]
    grid = itertools.product((32, 64, 128), (2, 4), (2, 3))
    return [DecodeTuning(64, 4, 3, False)] + [DecodeTuning(n, w, s, True) for n, w, s in grid]


def _time(fn: Any, runs: int, launches: int = 20) -> float:
    """Milliseconds per launch (photon.bench.roofline.median_graph_ms); NaN when the launch does
    not fit the GPU."""
    try:
        return median_graph_ms(fn, runs, launches)
    except Exception as exc:  # out of shared memory or registers for this launch
        print(f"skipped: {exc.__class__.__name__}: {str(exc)[:120]}", file=sys.stderr)
        return float("nan")


def bench_layout(name: str, batch: int, context: int, hbm: float, runs: int) -> list[dict]:
    heads, kv_heads = LAYOUTS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, cache, tables, seq_lens = _inputs(batch, context, heads, kv_heads, gen)
    fp8, scales = _fp8_cache(cache, kv_heads)
    scale = HEAD_DIM ** -0.5
    ref = decode_attention(q, cache, tables, seq_lens, scale).float()
    rows = []
    for cache_dtype, kv, kv_scales in (("bf16", cache, None), ("fp8", fp8, scales)):
        kv_bytes = batch * context * 2 * kv_heads * HEAD_DIM * kv.element_size()
        for tune in sweep(cache_dtype):
            def fn(tune: DecodeTuning = tune, kv: torch.Tensor = kv,
                   kv_scales: LayerKVScales | None = kv_scales) -> torch.Tensor:
                return decode_attention(q, kv, tables, seq_lens, scale, kv_scales, tune)
            ms = _time(fn, runs)
            err = (fn().float() - ref).abs().max().item() if ms == ms else float("nan")
            rows.append({"layout": name, "cache": cache_dtype, **asdict(tune), "us": ms * 1e3,
                         "hbm_fraction": kv_bytes / (ms / 1e3) / hbm, "max_abs_err": err,
                         "batch": batch, "context": context})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--output-json", default=None, help="Also write every row to this file.")
    ns = p.parse_args()
    hbm = measure_hbm_bandwidth()
    rows = [r for name in LAYOUTS for r in bench_layout(name, ns.batch, ns.context, hbm, ns.runs)]
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"hbm_bandwidth": hbm, "gpu": torch.cuda.get_device_name(), "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
