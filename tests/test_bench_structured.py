"""`photon bench structured` runs on CPU and reports grammar-bounded outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from photon.cli import main

# A schema the grammar ends within a few tokens (a quoted word): the runs stay short on CPU while
# the grammar, not max_tokens, still ends every request.
COLOR_SCHEMA = {"enum": ["red", "green", "blue"]}
MAX_TOKENS = 24


def test_bench_structured_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    schema = tmp_path / "color.json"
    schema.write_text(json.dumps(COLOR_SCHEMA))
    rc = main(["bench", "structured", "--model-shape", "tiny", "--batch-sizes", "3",
               "--max-output-tokens", str(MAX_TOKENS), "--prompt-len", "8", "--repeats", "3",
               "--schema", str(schema)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = summary["rows"]
    assert row["batch_size"] == 3 and summary["schema"] == str(schema)
    assert 0 < row["mean_output_tokens"] < MAX_TOKENS  # the grammar, not max_tokens, ended them
    for key in ("json_blocking", "json_pipelined", "plain_blocking", "plain_pipelined"):
        assert row[f"{key}_tok_per_s"] > 0
    assert row["json_pipelined_mask_fill_ms_per_step"] > 0
    assert row["json_pipelined_finish_reasons"] == {"stop": 3}
    # Three pipelined pairs; the row is the pair with the median ratio.
    each = row["pipelined_json_vs_plain_each"]
    assert len(each) == 3 and row["pipelined_json_vs_plain"] == sorted(each)[1]
    assert row["pipelined_json_vs_plain"] == pytest.approx(
        row["json_pipelined_tok_per_s"] / row["plain_pipelined_tok_per_s"])
    # The breakdown: the same lengths take the same steps (+1: the step a grammar's end is
    # committed in flight); plain steps fill no masks; the probe saw forward + sampling time.
    assert 0 <= row["json_pipelined_steps"] - row["plain_pipelined_steps"] <= 1
    assert row["plain_pipelined_mask_fill_ms_per_step"] == 0.0
    for key in ("json_blocking", "json_pipelined", "plain_blocking", "plain_pipelined"):
        assert 0 < row[f"{key}_gpu_ms_per_step"] <= row[f"{key}_ms_per_step"]
        assert 0 < row[f"{key}_host_ms_per_step"] <= row[f"{key}_ms_per_step"]
    # Each grammar job's time: median <= 90th percentile <= longest; plain runs have none.
    assert 0 < row["json_pipelined_job_ms_p50"] <= row["json_pipelined_job_ms_p90"] \
        <= row["json_pipelined_job_ms_max"]
    assert "plain_pipelined_job_ms_p50" not in row


def test_bench_structured_named_schema_without_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    from photon.bench.structured import SCHEMAS

    item = SCHEMAS["records-no-ranges"]["items"]["properties"]
    assert "minimum" not in item["id"] and "maximum" not in item["score"]
    assert SCHEMAS["records"]["items"]["properties"]["id"]["maximum"] == 9999  # untouched
    # A few tokens of the schema's JSON are enough to show the name is accepted and reported.
    rc = main(["bench", "structured", "--model-shape", "tiny", "--batch-sizes", "1",
               "--max-output-tokens", "4", "--prompt-len", "4", "--repeats", "1",
               "--schema", "records-no-ranges"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["schema"] == "records-no-ranges"
    assert summary["rows"][0]["mean_output_tokens"] == 4  # cut by max_tokens: never done in 4


def test_bench_structured_rejects_zero_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "structured", "--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats: must be at least 1, got 0" in capsys.readouterr().err
