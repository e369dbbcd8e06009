"""tools/inspect_kernel.py: a kernel compiled for sm_90a and read back without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(180)


def test_the_fp8_decode_kernel_reads_back_with_tensor_core_and_fp8_conversions(
        tmp_path: Path) -> None:
    # Compiled, not interpreted: the test environment's TRITON_INTERPRET stays out.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    sass = tmp_path / "decode.sass"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_kernel.py"), "decode",
                          "--cache", "fp8", "--fp8-f16", "--block-n", "128",
                          "--sass-out", str(sass)],
                         capture_output=True, text=True, env=env, timeout=150)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    const = out["constexprs"]
    assert out["kernel"] == "decode" and const["BLOCK_N"] == 128
    assert const["FP8"] is True and const["FP8_F16"] is True
    assert 32 <= out["registers"] <= 255 and out["spill_store_bytes"] == 0
    assert out["shared_bytes"] > 0 and out["sass_instructions"] > 100
    ops = out["opcodes"]
    assert any(op.startswith("F2FP.F16.E4M3") for op in ops)  # e4m3 -> float16 tiles
    assert any(op.startswith(("HMMA", "HGMMA")) for op in sass.read_text().split())
