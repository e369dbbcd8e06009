"""tools/gpu_bench.sh: the script parses, every step is documented and has a function, unknown
steps are refused, and the two-GPU steps skip (with a message) without two GPUs. The steps
themselves need GPUs and are not run here."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "gpu_bench.sh"
TWO_GPU_STEPS = ("parallel", "router", "pd")


def _steps() -> list[str]:
    m = re.search(r"^STEPS=\(([^)]*)\)$", SCRIPT.read_text(), re.M)
    assert m is not None, "gpu_bench.sh has no STEPS=(...) list"
    return m.group(1).split()


def _run(tmp_path: Path, *steps: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *steps], env=env,
                          capture_output=True, text=True, timeout=60)


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_every_step_is_documented_and_defined() -> None:
    text = SCRIPT.read_text()
    header = text.split("set -uo pipefail")[0]
    steps = _steps()
    for step in ("quant", "lora", *TWO_GPU_STEPS):
        assert step in steps
    for step in steps:
        assert re.search(rf"^#   {step} ", header, re.M), f"step {step} not in the header"
        assert re.search(rf"^step_{step}\(\) \{{", text, re.M), f"no step_{step} function"


def test_unknown_step_is_refused(tmp_path: Path) -> None:
    done = _run(tmp_path, "throughput", "warp-drive")
    assert done.returncode == 2
    assert "unknown step 'warp-drive' (allowed: env tests throughput" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_two_gpu_steps_skip_without_two_gpus(tmp_path: Path) -> None:
    done = _run(tmp_path, *TWO_GPU_STEPS)
    assert done.returncode == 0, done.stderr
    for step in TWO_GPU_STEPS:
        assert f"{step}: skipped: needs 2 GPUs, 0 visible" in done.stdout
