"""W4A16 / W8A16 GEMM: the fused Triton kernel against dequantize-then-cuBLAS, by row count.

Usage: python tools/bench_wna16.py [--bits 4] [--rows 16,64,...] [--output-json F]

For each linear layer shape of the Qwen3-0.6B and Llama-3.1-8B shapes (N, K of the fused qkv,
o, fused gate/up and down projections; group 128, no zero points) and each row count M, times
both paths of `photon.kernels.wna16.wna16_gemm` (the fused kernel: dequant_min_tokens above M;
the dequantize + torch linear path: dequant_min_tokens 0) and a bf16 cuBLAS GEMM of the same
shape as the peer, each a median over CUDA-graph replays of 10 calls. The row count where the
dequantize path starts to win is DEQUANT_MIN_TOKENS's measured value for that shape. Prints one
JSON line per (shape, layer, M); needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from photon.bench.roofline import median_graph_ms
from photon.kernels.wna16 import wna16_gemm

GROUP = 128
LAYERS = {  # (N, K) per linear layer
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                   "down": (1024, 3072)},
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                     "down": (4096, 14336)},
}


def bench_layer(n: int, k: int, rows: list[int], bits: int, runs: int,
                gen: torch.Generator) -> list[dict]:
    per_word = 32 // bits
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // per_word), generator=gen, device="cuda",
                           dtype=torch.int32)
    scale = torch.rand(n, k // GROUP, generator=gen, device="cuda") * 1e-2
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        gemm = functools.partial(wna16_gemm, x, packed, scale, None, bits, GROUP)
        fused = median_graph_ms(functools.partial(gemm, dequant_min_tokens=m + 1), runs)
        dequant = median_graph_ms(functools.partial(gemm, dequant_min_tokens=0), runs)
        bf16 = median_graph_ms(functools.partial(torch.nn.functional.linear, x, w), runs)
        out.append({"n": n, "k": k, "m": m, "bits": bits, "fused_us": fused * 1e3,
                    "dequant_us": dequant * 1e3, "bf16_us": bf16 * 1e3,
                    "faster": "fused" if fused < dequant else "dequant"})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--rows", default="16,64,128,192,256,384,512,1024,2048")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--output-json", default=None, help="Also write every row to this file.")
    ns = p.parse_args()
    rows = [int(r) for r in ns.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for shape, layers in LAYERS.items():
        for name, (n, k) in layers.items():
            for r in bench_layer(n, k, rows, ns.bits, ns.runs, gen):
                results.append({"shape": shape, "layer": name, **r})
                print(json.dumps(results[-1]), flush=True)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
