"""`photon bench spec`: the matrix, step times, predicted speedups, prompts and the CLI (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from photon.bench.serve_workload import length_bounds
from photon.bench.spec_prompts import heldout_code_prompts, random_prompts
from photon.bench.spec_report import (
    CONTROL,
    NO_SPEC,
    Cell,
    SpecSetting,
    StepRecorder,
    draft_share,
    expected_tokens,
    fill_speedups,
    full_step_share,
    output_lengths,
    settings,
)
from photon.cli import main
from photon.model.tiny import PHOTON_TINY, PHOTON_TINY_DRAFT, builtin_model_path
from photon.train.tokenizer import HELDOUT_FILE, Manifest, load_stream, prepare
from tests.test_train import _write_fake_stdlib

BATCH_SIZES, KS, OUTPUT_LEN = (1, 3), (1, 2), 6


class FakeClock:
    def __init__(self, times: list[float]) -> None:
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


def test_step_recorder_times_consecutive_decode_steps_by_k() -> None:
    rec = StepRecorder(k=2, clock=FakeClock([0.0, 1.0, 1.5, 2.5, 2.75, 3.75, 5.0, 5.5, 6.0]))
    rec.committed(0, 4, 2, False, 4)  # prefill
    rec.committed(1, 4, 2, True, 4)  # 1.0 (after a prefill step: still a decode step)
    rec.committed(2, 4, 2, True, 4)  # 0.5
    rec.committed(3, 4, 1, True, 4)  # right after a change of K_eff: not timed
    rec.committed(4, 4, 1, True, 4)  # 0.25 at K_eff 1
    rec.committed(5, 3, 1, True, 3)  # a smaller batch: not B = 4
    rec.committed(7, 4, 2, True, 4)  # not consecutive (step 6 missing)
    rec.committed(8, 4, 2, True, 4)  # 0.5
    assert rec.step_times(4) == {2: [1.0, 0.5, 0.5], 1: [0.25]}
    assert rec.choose(4) == 2  # fixed K without the engine's policy
    # every step after the first, by kind: full 1.0 + 0.5 + 1.0 + 0.25 + 1.25 + 0.5, partial
    # 1.0 (3 rows)
    seconds, counts = rec.time_by_kind(4)
    assert seconds == {"full": 4.5, "partial": 1.0, "mixed": 0.0}
    assert counts == {"full": 6, "partial": 1, "mixed": 0}
    rec.committed(9, 4, 2, False, 4)  # a prompt chunk beside decode rows
    assert rec.time_by_kind(4)[1] == {"full": 6, "partial": 1, "mixed": 1}
    cell = _cell("ngram", 2, False, 10.0, {2: 0.5})
    assert full_step_share(cell) is None  # steps not recorded
    cell.step_kind_s = {"full": 2.5, "partial": 1.0, "mixed": 1.0}
    assert full_step_share(cell) == 2.5 / cell.elapsed_s


def _cell(method: str, k: int, adaptive: bool, tok_s: float, step: dict[int, float],
          rates: list[float] | None = None, batch_size: int = 4) -> Cell:
    accept = None if rates is None else expected_tokens(rates, k)
    return Cell(method, k, adaptive, batch_size, 100, 100 / tok_s, tok_s, step, dict.fromkeys(step, 10),
                mean_acceptance_length=accept, acceptance_rate_per_pos=rates)


def test_predicted_speedup_fixed_and_adaptive() -> None:
    cells = [_cell(NO_SPEC, 0, False, 100.0, {0: 1.0}),
             _cell("ngram", 1, False, 150.0, {1: 1.2}, [0.8]),
             _cell("ngram", 2, False, 120.0, {2: 2.0}, [0.8, 0.5]),
             _cell("ngram", 2, True, 140.0, {1: 1.3}, [0.6, 0.3])]
    fill_speedups(cells)
    base, k1, k2, adaptive = cells
    assert (base.speedup, base.predicted_speedup) == (1.0, None)
    assert k1.speedup == pytest.approx(1.5)
    assert k1.predicted_speedup == pytest.approx(1.8 / 1.2)
    assert k1.prediction_error == pytest.approx(1.5 / 1.5 - 1)
    assert k2.predicted_speedup == pytest.approx(2.3 / 2.0)
    # adaptive: the best of k = 0 (1.0), k = 1 (1.6 / 1.2 from the fixed K=1 cell's step time)
    # and k = 2 (1.9 / 2.0), from its own acceptance rates
    assert adaptive.predicted_speedup == pytest.approx(1.6 / 1.2)


def test_paired_baseline_sets_the_speedup_and_t0() -> None:
    """A cell with baseline runs of its own takes its speedup and T(B, 0) from them, not from
    the no-speculation cell measured earlier (the machine's speed may have drifted since)."""
    cells = [_cell(NO_SPEC, 0, False, 100.0, {0: 1.0}),
             _cell("ngram", 1, False, 150.0, {1: 1.2}, [0.8]),
             _cell("ngram", 1, False, 150.0, {1: 1.2}, [0.8], batch_size=2)]
    paired = cells[1]
    paired.baseline_tokens_per_s, paired.baseline_step_time_s = 75.0, 0.9
    fill_speedups(cells)
    assert paired.speedup == pytest.approx(2.0)
    assert paired.predicted_speedup == pytest.approx(1.8 * 0.9 / 1.2)
    # no baseline runs and no no-speculation cell at its B: nothing to compare with
    assert cells[2].speedup is None and cells[2].predicted_speedup is None


def test_repeated_rounds_each_over_the_baseline_runs_around_them() -> None:
    """--repeats: the baseline's calls frame each of the cell's calls; a round's speedup is the
    two framing calls' mean time over the cell's call, and the cell's is their median."""
    from photon.bench.spec_report import Timed, cell_of, pair_cell

    def timed(seconds: float, steps: list[float]) -> Timed:
        return Timed(100, seconds, {0: steps}, {"full": seconds}, {"full": len(steps)})

    runs = [timed(1.0, [0.1]), timed(2.0, [0.2]), timed(1.0, [0.3])]
    base = [timed(2.0, [0.5]), timed(4.0, [0.6]), timed(2.0, [0.7]), timed(2.0, [0.8])]
    cell = cell_of(SpecSetting(CONTROL), 4, runs)
    pair_cell(cell, runs, base)
    assert (cell.output_tokens, cell.elapsed_s) == (300, 4.0)
    assert cell.step_time_s == {0: 0.2} and cell.step_kind_count == {"full": 3}
    assert cell.speedup_rounds == pytest.approx([3.0, 1.5, 2.0])
    assert cell.baseline_tokens_per_s == pytest.approx(400 / 10.0)
    assert cell.baseline_step_time_s == pytest.approx(0.65)
    fill_speedups([cell])
    assert cell.speedup == pytest.approx(2.0)  # the median round, not 300 / 4 over 40


def test_rows_without_drafts_lower_the_prediction() -> None:
    """An ngram cell whose rows had drafts in half of their row-steps: E' = (E + 1) / 2."""
    cells = [_cell(NO_SPEC, 0, False, 100.0, {0: 1.0}),
             _cell("ngram", 2, False, 120.0, {2: 1.5}, [0.8, 0.5])]
    k2 = cells[1]
    # 100 output tokens, 26 accepted drafts: 74 row-steps, 37 of them with drafts
    k2.num_drafts, k2.num_accepted_tokens = 37, 26
    assert draft_share(k2) == pytest.approx(0.5)
    fill_speedups(cells)
    assert k2.predicted_speedup == pytest.approx((0.5 * 2.3 + 0.5) / 1.5)


def test_matrix_and_speculative_configs() -> None:
    matrix = settings(["ngram", "draft_model"], [1, 3], [3, 5])
    assert matrix == [SpecSetting(NO_SPEC)] + [
        SpecSetting(m, k, a) for m in ("ngram", "draft_model")
        for k, a in ((1, False), (3, False), (3, True), (5, True))]
    assert settings(["ngram"], [2], []) == [SpecSetting(NO_SPEC), SpecSetting("ngram", 2)]
    assert settings(["ngram"], [2], [], control=True) == [
        SpecSetting(NO_SPEC), SpecSetting(CONTROL), SpecSetting("ngram", 2)]
    assert SpecSetting(CONTROL).speculative_config("d") is None
    assert matrix[0].speculative_config("d") is None
    assert SpecSetting("draft_model", 3, True).speculative_config("d") == {
        "method": "draft_model", "num_speculative_tokens": 3, "adaptive": True, "model": "d"}
    assert "model" not in SpecSetting("ngram", 1).speculative_config("d")
    lookup = settings(["ngram", "draft_model"], [2], [], lookup=(2, 4))
    assert lookup[1].speculative_config("d") == {
        "method": "ngram", "num_speculative_tokens": 2, "adaptive": False,
        "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert "prompt_lookup_min" not in lookup[2].speculative_config("d")  # draft_model


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("stdlib")
    _write_fake_stdlib(root)
    out = str(tmp_path_factory.mktemp("data"))
    prepare(out, vocab_size=400, stdlib=str(root))
    return out


def test_heldout_prompts_are_windows_of_the_stream(data_dir: str, tmp_path: Path) -> None:
    model = tmp_path / "model"  # trained on the data's tokenizer
    model.mkdir()
    record = {"tokenizer_sha256": Manifest.read(data_dir).tokenizer_sha256}
    (model / "config.json").write_text(json.dumps({"photon_training": record}))
    stream = load_stream(data_dir, HELDOUT_FILE).tolist()
    prompts = heldout_code_prompts(data_dir, 5, 20, str(model))
    assert [len(p) for p in prompts] == [20] * 5
    assert prompts[0] == stream[:20] and prompts[-1] == stream[-20:]
    assert len({tuple(p) for p in prompts}) == 5


def test_heldout_prompts_re_encode_for_another_tokenizer(data_dir: str) -> None:
    model = builtin_model_path(PHOTON_TINY)  # trained on another corpus's tokenizer
    prompts = heldout_code_prompts(data_dir, 3, 12, model)
    source = Tokenizer.from_file(f"{data_dir}/tokenizer.json")
    target = Tokenizer.from_file(f"{model}/tokenizer.json")
    text = source.decode(load_stream(data_dir, HELDOUT_FILE).tolist())
    assert [len(p) for p in prompts] == [12] * 3
    assert all(target.decode(p) in text for p in prompts)


def test_random_prompts_are_seeded_and_in_the_vocabulary() -> None:
    prompts = random_prompts(4, 9, 50, seed=1)
    assert prompts == random_prompts(4, 9, 50, seed=1) != random_prompts(4, 9, 50, seed=2)
    assert np.array(prompts).shape == (4, 9) and np.array(prompts).max() < 50


def test_cli_small_matrix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "spec.json"
    code = main(["bench", "spec", "--model", PHOTON_TINY, "--draft", PHOTON_TINY_DRAFT,
                 "--device", "cpu", "--batch-sizes", *map(str, BATCH_SIZES),
                 "--num-speculative-tokens", *map(str, KS), "--adaptive-num-speculative-tokens", "2",
                 "--input-len", "16", "--requests-per-slot", "2", "--min-requests", "1",
                 "--output-len", str(OUTPUT_LEN), "--warmup-tokens", "2", "--no-paired",
                 "--prompt-lookup-min", "2", "--prompt-lookup-max", "4",
                 "--output-json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert json.loads(out_json.read_text()) == summary
    assert (summary["prompt_lookup_min"], summary["prompt_lookup_max"]) == (2, 4)
    assert summary["complete"] is True and summary["errors"] == []
    assert "method" in out and "per-position acceptance" in out  # the table
    assert "full steps" in out
    cells = {(c["method"], c["k"], c["adaptive"], c["batch_size"]): c for c in summary["cells"]}
    want = {(NO_SPEC, 0, False, b) for b in BATCH_SIZES} | {
        (m, k, a, b) for m in ("ngram", "draft_model") for k, a in ((1, False), (2, False),
                                                                     (2, True))
        for b in BATCH_SIZES}
    assert set(cells) == want and len(summary["cells"]) == len(want)
    for (method, k, adaptive, b), c in cells.items():
        # the adaptive cells' guard verdicts by bucket (JSON keys are strings); none elsewhere
        verdicts = c["guard_verdicts"]
        assert (verdicts is None) != adaptive
        assert not adaptive or (verdicts and set(verdicts.values()) <= {True, False, None})
        # 2 x B requests, B at a time: decode steps of exactly B rows were timed
        assert c["output_tokens"] == 2 * b * OUTPUT_LEN and c["output_tokens_per_s"] > 0
        assert c["step_time_s"]
        assert set(c["step_kind_s"]) == {"full", "partial", "mixed"}
        assert c["step_kind_count"]["full"] >= sum(c["steps"].values())
        assert 0 < sum(c["step_kind_s"].values()) <= c["elapsed_s"]
        if method == NO_SPEC:
            assert c["speedup"] == 1.0 and c["mean_acceptance_length"] is None
            assert c["acceptance_rate_per_pos"] is None and c["predicted_speedup"] is None
            assert set(c["step_time_s"]) == {"0"}
        else:
            assert 1.0 <= c["mean_acceptance_length"] <= k + 1
            assert len(c["acceptance_rate_per_pos"]) == k
            # --no-paired: the speedup is over the no-speculation cell at the same B
            assert c["speedup"] == pytest.approx(
                c["output_tokens_per_s"] / cells[NO_SPEC, 0, False, b]["output_tokens_per_s"])
        assert c["baseline_tokens_per_s"] is None


def test_output_lengths_are_seeded_and_in_range() -> None:
    assert output_lengths(5, 128, 0.0, 0) == [128] * 5
    lengths = output_lengths(1000, 128, 0.5, 3)
    assert lengths == output_lengths(1000, 128, 0.5, 3) != output_lengths(1000, 128, 0.5, 4)
    assert (min(lengths), max(lengths)) == (64, 192) == length_bounds(128, 0.5)
    assert abs(sum(lengths) / len(lengths) - 128) < 4
    assert min(output_lengths(100, 2, 0.9, 0)) >= 1


def test_cli_output_lengths_vary_and_are_generated(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    """--output-len-range-ratio: each cell generates exactly the drawn lengths (the same for
    every setting), the engine's max_model_len fits the longest, and the ratio is recorded."""
    out_json = tmp_path / "spec.json"
    code = main(["bench", "spec", "--model", PHOTON_TINY, "--device", "cpu", "--methods", "ngram",
                 "--batch-sizes", "2", "--num-speculative-tokens", "2",
                 "--adaptive-num-speculative-tokens", "--input-len", "8", "--output-len", "6",
                 "--output-len-range-ratio", "0.5", "--requests-per-slot", "3",
                 "--min-requests", "8", "--warmup-tokens", "0", "--no-paired",
                 "--output-json", str(out_json)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(out_json.read_text())
    assert summary["output_len_range_ratio"] == 0.5
    # --no-paired: no baseline runs; the speedup is over the no-speculation cell
    none, ngram = summary["cells"]
    assert none["baseline_tokens_per_s"] is None is ngram["baseline_tokens_per_s"]
    assert ngram["speedup"] == pytest.approx(ngram["output_tokens_per_s"]
                                             / none["output_tokens_per_s"])
    # 3 x 2 requests, raised to --min-requests 8
    assert (summary["requests_per_slot"], summary["min_requests"]) == (3, 8)
    want = sum(output_lengths(8, 6, 0.5, 0))
    assert [c["output_tokens"] for c in summary["cells"]] == [want, want]
    assert main(["bench", "spec", "--device", "cpu", "--output-len-range-ratio", "1"]) != 0
    assert "--output-len-range-ratio must be in [0, 1)" in capsys.readouterr().err


def test_cli_control_is_a_paired_no_speculation_engine(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    """--control: a second engine without speculation, timed between the baseline's runs like
    a speculative setting; it has a speedup (the noise) but no acceptance or prediction."""
    out_json = tmp_path / "spec.json"
    code = main(["bench", "spec", "--model", PHOTON_TINY, "--device", "cpu", "--methods", "ngram",
                 "--batch-sizes", "2", "--num-speculative-tokens", "1",
                 "--adaptive-num-speculative-tokens", "--input-len", "8", "--output-len", "3",
                 "--warmup-tokens", "0", "--control", "--repeats", "2", "--min-requests", "1",
                 "--output-json", str(out_json)])
    assert code == 0, capsys.readouterr().err
    cells = json.loads(out_json.read_text())["cells"]
    assert [c["method"] for c in cells] == [NO_SPEC, CONTROL, "ngram"]
    none, control, ngram = cells
    assert none["baseline_tokens_per_s"] is None  # the baseline's own cells are not paired
    assert none["output_tokens"] == 24 and none["speedup_rounds"] is None  # 4 x 2 x 3
    for c in (control, ngram):  # paired (the default): over the runs framing each call
        assert c["baseline_tokens_per_s"] > 0 and c["baseline_step_time_s"] > 0
        assert c["output_tokens"] == 48 and len(c["speedup_rounds"]) == 2
        assert c["speedup"] == pytest.approx(sum(c["speedup_rounds"]) / 2)
    lo, hi = sorted(control["speedup_rounds"])
    assert f"{lo:.2f}-{hi:.2f}" in capsys.readouterr().out  # the table's rounds column
    assert control["mean_acceptance_length"] is None and control["predicted_speedup"] is None
    assert ngram["mean_acceptance_length"] >= 1.0 and ngram["predicted_speedup"] > 0


def test_cli_refuses_a_speculative_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "spec", "--device", "cpu", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 1}']) != 0
    assert "--speculative-config is set by the benchmark" in capsys.readouterr().err
    assert main(["bench", "spec", "--device", "cpu", "--methods", "draft_model"]) != 0
    assert "--methods draft_model needs --draft" in capsys.readouterr().err
    assert main(["bench", "spec", "--device", "cpu", "--repeats", "2", "--no-paired"]) != 0
    assert "above 1 only with --paired" in capsys.readouterr().err
    assert main(["bench", "spec", "--device", "cpu", "--min-requests", "0"]) != 0
    assert "--min-requests must be at least 1, got 0" in capsys.readouterr().err
    assert main(["bench", "spec", "--device", "cpu", "--prompt-lookup-min", "3",
                 "--prompt-lookup-max", "2"]) != 0
    assert "prompt_lookup_min=3 must be <= prompt_lookup_max=2" in capsys.readouterr().err


def test_a_failing_setting_is_reported_and_the_others_run(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    out_json = tmp_path / "spec.json"
    code = main(["bench", "spec", "--model", PHOTON_TINY, "--draft", str(tmp_path / "missing"),
                 "--device", "cpu", "--batch-sizes", "2", "--num-speculative-tokens", "1",
                 "--adaptive-num-speculative-tokens", "--input-len", "8", "--output-len", "3",
                 "--warmup-tokens", "0", "--min-requests", "1", "--output-json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 1 and "draft_model K=1 failed" in err
    summary = json.loads(out_json.read_text())
    assert summary == json.loads(out.strip().splitlines()[-1]) and summary["complete"] is True
    assert [e["setting"] for e in summary["errors"]] == ["draft_model K=1"]
    assert [(c["method"], c["k"]) for c in summary["cells"]] == [(NO_SPEC, 0), ("ngram", 1)]


def test_the_warm_up_refills_its_batch() -> None:
    """2 x B requests, every other one half as long: the short ones finish first and their places
    are refilled while the others decode, as in a timed cell (the mixed steps warm up too)."""
    from photon.bench.spec import _warm_up

    class Recorder:
        def generate(self, prompts: list, params: list, use_tqdm: bool) -> list:
            self.prompts, self.lengths = prompts, [p.max_tokens for p in params]
            return []

    llm = Recorder()
    _warm_up(llm, [[1], [2], [3]], 2, 16)
    assert llm.prompts == [[1], [2], [3], [1]] and llm.lengths == [16, 8, 16, 8]
    _warm_up(llm, [[1]], 1, 1)
    assert llm.lengths == [1, 1]
