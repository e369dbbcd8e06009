"""A Triton kernel's machine code for the H200 (sm_90a), read without a GPU.

Usage: python tools/inspect_kernel.py decode [--cache fp8] [--block-n 128] [--num-warps 4]
           [--num-stages 3] [--fp8-f16] [--sass-out FILE]
       python tools/inspect_kernel.py wna16 [--rows 16]

Compiles one launch of a photon kernel for CUDA compute capability 9.0 on any machine (Triton
compiles for an explicit target; no driver is needed), assembles its PTX with the ptxas that
ships with Triton, and prints one JSON line: registers per thread, spilled bytes, shared memory,
the number of SASS instructions and the most frequent opcodes (`cuobjdump -sass`). A kernel
variant's instruction mix and register count can so be compared before it runs on a GPU.
Triton's newest PTX may be newer than a bundled ptxas accepts; its `.version` line is then set
to the newest that ptxas knows. Kernels are in KERNELS (decode: the split-K decode attention
kernel at the Llama-3.1-8B head layout, 32 query / 8 KV heads, D = 128, 16-token pages; wna16:
the fused W4A16 GEMM at that shape's qkv projection).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

PTX_VERSIONS = ("8.8", "8.7", "8.5", "8.4")  # tried in order when ptxas refuses Triton's


@dataclass(frozen=True)
class Launch:
    kernel: Any  # a triton.JITFunction
    args: dict[str, str | int | float]  # pointer type strings ("*bf16"), or example values
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int


def decode_launch(ns: argparse.Namespace) -> Launch:
    from photon.attention.triton_paged_kernels import _decode_split_kernel

    fp8 = ns.cache == "fp8"
    ptr = {"q_ptr": "*bf16", "cache_ptr": "*fp8e4nv" if fp8 else "*bf16", "bt_ptr": "*i32",
           "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
           "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32"}
    heads, kv_heads, dim, block = 32, 8, 128, 16
    ints = {"scale": 0.088, "max_ctx": 4096, "tokens_per_split": 4096, "num_splits": 1,
            "stride_qt": heads * dim, "stride_qh": dim, "stride_ot": heads * dim,
            "stride_oh": dim, "stride_bt": 256, "stride_kv": 1 << 30,
            "stride_blk": block * kv_heads * dim, "stride_off": kv_heads * dim, "stride_ch": dim}
    const = {"GROUP": heads // kv_heads, "GROUP_PAD": 16, "NUM_HEADS": heads, "HEAD_DIM": dim,
             "D_PAD": dim, "BLOCK_SIZE": block, "BLOCK_N": ns.block_n, "DIRECT": True,
             "DOT_PREC": "tf32", "FP8": fp8, "FP8_F16": fp8 and ns.fp8_f16}
    return Launch(_decode_split_kernel, {**ptr, **ints}, const, ns.num_warps, ns.num_stages)


def wna16_launch(ns: argparse.Namespace) -> Launch:
    """The fused W4A16 GEMM (photon/kernels/wna16.py) at the Llama-3.1-8B qkv projection
    (N 6144, K 4096, group 128, no zero points), at the tile `gemm_tiles(--rows)` picks."""
    from photon.kernels.wna16 import _wna16_gemm, gemm_tiles

    tiles = gemm_tiles(ns.rows)
    n, k = 6144, 4096
    args = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*fp32",
            "out_ptr": "*bf16", "M": ns.rows, "N": n, "K": k, "K_PER_SPLIT": k // 2,
            "stride_xm": k, "stride_wn": k // 8, "stride_sn": k // 128, "stride_zn": k // 128,
            "stride_os": ns.rows * n, "stride_om": n}
    const = {"BITS": 4, "GROUP": 128, "HAS_ZP": False, "BLOCK_M": tiles.block_m,
             "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
    return Launch(_wna16_gemm, args, const, tiles.num_warps, ns.num_stages)


KERNELS = {"decode": decode_launch, "wna16": wna16_launch}


def _arg_type(value: str | int | float) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return "fp32"
    return "i32" if -2**31 <= value < 2**31 else "i64"


def compile_ptx(launch: Launch) -> tuple[str, int]:
    """(PTX, shared memory bytes) of the launch, compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = launch.kernel.arg_names
    sig = {n: "constexpr" if n in launch.constexprs else _arg_type(launch.args[n])
           for n in names}
    # Triton's own specialisation: pointers and ints divisible by 16 are marked so.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in launch.constexprs and (isinstance(launch.args[n], str) or (
                 isinstance(launch.args[n], int) and launch.args[n] % 16 == 0))}
    constexprs = {(names.index(n),): v for n, v in launch.constexprs.items()}
    src = ASTSource(launch.kernel, sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps,
                                       "num_stages": launch.num_stages})
    return compiled.asm["ptx"], compiled.metadata.shared


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def assemble(ptx: str, workdir: str) -> tuple[str, str]:
    """(cubin path, ptxas -v report), trying Triton's PTX version, then older ones."""
    errors = []
    for version in (None, *PTX_VERSIONS):
        text = ptx if version is None else re.sub(r"^\.version \S+", f".version {version}", ptx,
                                                   flags=re.M)
        for ptxas in ("ptxas", "ptxas-blackwell"):
            src, cubin = os.path.join(workdir, "k.ptx"), os.path.join(workdir, "k.cubin")
            with open(src, "w") as f:
                f.write(text)
            run = subprocess.run([_tool(ptxas), "-arch=sm_90a", "-v", src, "-o", cubin],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                return cubin, run.stdout + run.stderr
            errors.append(f"{ptxas} (.version {version or 'as compiled'}): "
                          f"{run.stderr.strip()[:200]}")
    raise RuntimeError("no bundled ptxas assembled the PTX:\n" + "\n".join(errors))


def summarize(report: str, sass: str, shared: int, top: int = 20) -> dict[str, Any]:
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*(?:\.[A-Z0-9_.]+)?)",
                     sass, flags=re.M)
    counts = collections.Counter(ops)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else 0,
            "shared_bytes": shared, "sass_instructions": len(ops),
            "opcodes": dict(counts.most_common(top))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=sorted(KERNELS))
    p.add_argument("--cache", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument("--fp8-f16", action="store_true", help="FP8 tiles as float16 (DecodeTuning)")
    p.add_argument("--rows", type=int, default=16, help="wna16: the GEMM's M (picks the tile)")
    p.add_argument("--sass-out", default=None, help="Also write the whole SASS listing here.")
    ns = p.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud
    launch = KERNELS[ns.kernel](ns)
    ptx, shared = compile_ptx(launch)
    with tempfile.TemporaryDirectory() as tmp:
        cubin, report = assemble(ptx, tmp)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    if ns.sass_out:
        with open(ns.sass_out, "w") as f:
            f.write(sass)
    print(json.dumps({"kernel": ns.kernel, "num_warps": launch.num_warps,
                      "num_stages": launch.num_stages, "constexprs": launch.constexprs,
                      **summarize(report, sass, shared)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
