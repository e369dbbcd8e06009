"""Plot each quantization scheme's quality cost against its throughput.

Reads `photon bench throughput --output-json` files (THROUGHPUT_DIR/throughput_SHAPE_SCHEME.json)
and `photon bench quality --output-json` files (QUALITY_DIR/quality_MODEL_SCHEME.json) and draws
mean KL divergence against output tokens/s, one point per scheme (bf16 at KL 0).

Usage: python tools/plot_quant_tradeoff.py THROUGHPUT_DIR SHAPE QUALITY_DIR MODEL OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEMES = ("bf16", "fp8", "fp8-kv-fp8", "w8a8-int8", "w4a16")


def points(tp_dir: Path, shape: str, q_dir: Path, model: str) -> list[tuple[str, float, float]]:
    """(scheme, output tok/s, mean KL) for every scheme with both files (bf16: KL 0)."""
    out = []
    for scheme in SCHEMES:
        tp = tp_dir / f"throughput_{shape}_{scheme}.json"
        q = q_dir / f"quality_{model}_{scheme}.json"
        if not tp.exists() or (scheme != "bf16" and not q.exists()):
            continue
        kl = 0.0 if scheme == "bf16" else json.loads(q.read_text())["kl_mean"]
        out.append((scheme, json.loads(tp.read_text())["output_tok_per_s"], kl))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tp_dir, shape, q_dir, model, out = Path(argv[0]), argv[1], Path(argv[2]), argv[3], argv[4]
    pts = points(tp_dir, shape, q_dir, model)
    fig, ax = plt.subplots(figsize=(6, 4))
    for scheme, tps, kl in pts:
        ax.scatter(tps, kl)
        ax.annotate(scheme, (tps, kl), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel(f"output tok/s, standard workload ({shape} shape)")
    ax.set_ylabel(f"mean KL vs unquantized ({model}, held-out code)")
    ax.set_title("Quantization: quality cost against throughput")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}: {len(pts)} schemes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
