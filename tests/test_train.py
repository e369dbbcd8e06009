"""photon's training script (`python -m photon.train`) on CPU: a fake standard library, the
`test` preset, a few steps."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from photon.config import ModelConfig
from photon.model.hf_config import load_hf_config
from photon.model.loader import load_model
from photon.model.tiny import CHATML_TEMPLATE, build_tokenizer, is_random_weights
from photon.train.cli import main
from photon.train.evaluate import _run_lengths, agreement
from photon.train.fit import build_model, fit, load_trained
from photon.train.loop import MIN_LR_RATIO, BestWeights, FitSettings, lr_at
from photon.train.presets import PRESETS, count_params, get_preset
from photon.train.prompts import heldout_prompts
from photon.train.tokenizer import HELDOUT_FILE, Manifest, load_stream, prepare
from tests.hf_models import hf_tensor

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_FILES = 40


def _write_fake_stdlib(root: Path) -> None:
    for i in range(NUM_FILES):
        body = "".join(f"def f{i}_{j}(x, y={j}):\n    \"\"\"Add {j}.\"\"\"\n    return x + y * {j % 7}"
                       f"\n\n\nclass C{j}:\n    value = {i * j}\n\n" for j in range(12))
        path = root / ("pkg" if i % 2 else "") / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_text("THIRD_PARTY = 1\n")
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: skipped


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stdlib")
    _write_fake_stdlib(root)
    return root


@pytest.fixture(scope="module")
def data_dir(stdlib: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("data"))
    prepare(out, vocab_size=400, stdlib=str(stdlib))
    return out


def _settings(**kwargs: object) -> FitSettings:
    preset = get_preset("test")
    base = dict(seq_len=preset.seq_len, batch_size=preset.batch_size, lr=preset.lr,
                warmup_steps=preset.warmup_steps, seed=0, steps=20, log_interval=1)
    return FitSettings(**{**base, **kwargs})


@pytest.fixture(scope="module")
def trained(data_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    out = str(tmp_path_factory.mktemp("model"))
    outcome = fit(data_dir, get_preset("test"), _settings(), out, torch.device("cpu"),
                  log=lambda _: None)
    return out, outcome


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _read_all(directory: str) -> dict[str, bytes]:
    return {name: Path(directory, name).read_bytes() for name in sorted(os.listdir(directory))}


def test_prepare_is_deterministic_and_holds_out_five_percent(stdlib: Path, data_dir: str,
                                                            tmp_path: Path) -> None:
    again = str(tmp_path / "again")
    prepare(again, vocab_size=400, stdlib=str(stdlib))
    assert _read_all(data_dir) == _read_all(again)
    m = Manifest.read(data_dir)
    assert m.num_files == NUM_FILES  # site-packages and the non-UTF-8 file are not in it
    assert m.num_heldout_files == math.ceil(0.05 * NUM_FILES) == len(m.heldout_files)
    assert m.num_train_files == NUM_FILES - m.num_heldout_files
    texts = [(stdlib / rel).read_text(encoding="utf-8")
             for rel in sorted(p.relative_to(stdlib).as_posix() for p in stdlib.rglob("mod*.py"))]
    corpus = "".join(texts).encode("utf-8")
    assert m.corpus_sha256 == hashlib.sha256(corpus).hexdigest()
    assert m.corpus_bytes == len(corpus) == m.train_bytes + m.heldout_bytes
    assert m.tokenizer_sha256 == _sha256(os.path.join(data_dir, "tokenizer.json"))
    assert m.tokenizer_config_sha256 == _sha256(os.path.join(data_dir, "tokenizer_config.json"))
    assert m.train_sha256 == _sha256(os.path.join(data_dir, "train.npy"))
    assert m.heldout_sha256 == _sha256(os.path.join(data_dir, "heldout.npy"))
    held = load_stream(data_dir, HELDOUT_FILE)
    assert held.dtype == np.uint16 and held.size == m.heldout_tokens
    assert int((held == 0).sum()) == m.num_heldout_files  # one <|endoftext|> per document


def test_heldout_prompts_are_prefixes_of_the_prepared_heldout_files(stdlib: Path,
                                                                   data_dir: str) -> None:
    """`heldout_prompts` on a `prepare` directory: one prompt per held-out file (manifest
    order), each a prefix of the file's tokens of a length in the asked bounds."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
    files = Manifest.read(data_dir).heldout_files
    prompts = heldout_prompts(data_dir, count=len(files), min_tokens=8, max_tokens=32)
    assert [p.file for p in prompts] == files
    for p in prompts:
        ids = tok.encode((stdlib / p.file).read_text(encoding="utf-8"),
                         add_special_tokens=False).ids
        assert 8 <= len(p.token_ids) <= 32 and p.token_ids == ids[:len(p.token_ids)]
    with pytest.raises(ValueError, match=f"have 32 tokens; {len(files) + 1} prompts"):
        heldout_prompts(data_dir, count=len(files) + 1, min_tokens=8, max_tokens=32)


def test_tokenizer_has_photon_tiny_specials_and_chat_template(data_dir: str) -> None:
    from tokenizers import Tokenizer

    tiny = build_tokenizer()
    tok = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
    assert [tok.token_to_id(t) for t in SPECIALS] == [tiny.token_to_id(t) for t in SPECIALS]
    assert Manifest.read(data_dir).special_tokens == {t: tiny.token_to_id(t) for t in SPECIALS}
    with open(os.path.join(data_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["chat_template"] == CHATML_TEMPLATE
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text).ids) == text


def test_twenty_steps_lower_the_loss(trained: tuple[str, object]) -> None:
    _, outcome = trained
    losses = [loss for _, loss in outcome.result.losses]
    assert len(losses) == 20 and outcome.result.steps == 20
    assert losses[0] > math.log(300)  # about uniform over the vocabulary at the start
    assert np.mean(losses[-3:]) < losses[0] - 1.5
    assert outcome.heldout.loss < losses[0] - 1.0
    assert outcome.result.tokens_seen == 20 * 8 * 32


def test_saved_config_records_training(trained: tuple[str, object], data_dir: str) -> None:
    out, outcome = trained
    config = load_hf_config(out)
    assert not is_random_weights(out) and "photon_random_weights" not in config
    record = config["photon_training"]
    manifest = Manifest.read(data_dir)
    assert record["preset"] == "test" and record["steps"] == 20 and record["seed"] == 0
    assert record["corpus_sha256"] == manifest.corpus_sha256
    assert record["tokenizer_sha256"] == manifest.tokenizer_sha256 == _sha256(
        os.path.join(out, "tokenizer.json"))
    assert record["heldout_loss"] == outcome.heldout.loss
    assert record["parameters"] == count_params(get_preset("test"), manifest.vocab_size)
    assert config["vocab_size"] % 128 == 0 and config["tie_word_embeddings"] is True
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert all(os.path.getsize(os.path.join(out, f)) < 16 * 2**20 for f in os.listdir(out))
    assert "perplexity" in Path(out, "README.md").read_text(encoding="utf-8")


def test_photon_loads_the_saved_weights_bit_exactly(trained: tuple[str, object]) -> None:
    out, _ = trained
    hf = load_trained(out, torch.device("cpu")).to(torch.bfloat16).state_dict()
    hf_config = load_hf_config(out)
    config = ModelConfig(model=out, hf_config=hf_config, architecture="Qwen3ForCausalLM",
                         dtype=torch.bfloat16, max_model_len=512,
                         vocab_size=hf_config["vocab_size"], seed=0, served_model_name="t")
    model = load_model(config, "cpu")
    params = dict(model.named_parameters())
    assert len(params) > 5
    for name, param in params.items():
        expected = hf_tensor(hf, name)
        assert param.dtype == expected.dtype == torch.bfloat16, name
        assert torch.equal(param, expected), name
    # the float32 -> bf16 -> float32 trip in load_trained is exact: bf16 is the saved dtype
    from safetensors.torch import load_file

    saved = load_file(os.path.join(out, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, hf[n]) for n, t in saved.items())


def test_same_seed_same_model(data_dir: str) -> None:
    manifest = Manifest.read(data_dir)
    a = build_model(get_preset("test"), manifest, seed=3).state_dict()
    b = build_model(get_preset("test"), manifest, seed=3).state_dict()
    c = build_model(get_preset("test"), manifest, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_lr_schedule_warms_up_then_decays_to_ten_percent() -> None:
    s = _settings(lr=1.0, warmup_steps=4, steps=20)
    assert [lr_at(i, s, 20) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, s, 20) == pytest.approx(1.0)
    assert lr_at(12, s, 20) == pytest.approx((1 + MIN_LR_RATIO) / 2)
    assert lr_at(20, s, 20) == pytest.approx(MIN_LR_RATIO)
    assert lr_at(50, s, None) == 1.0  # total not known yet (seconds budget): peak


def test_agreement_of_a_model_with_itself_is_total(trained: tuple[str, object],
                                                   data_dir: str) -> None:
    out, _ = trained
    model = load_trained(out, torch.device("cpu"))
    stream = load_stream(data_dir, HELDOUT_FILE)
    result = agreement(model, model, stream, seq_len=16, windows=4, device=torch.device("cpu"))
    assert result.windows == 4 and result.positions == 64 and result.agreement == 1.0
    assert result.accepted_measured == {k: float(k) for k in range(1, 6)}
    assert result.accepted_independent == {k: float(k) for k in range(1, 6)}


def test_run_lengths_count_consecutive_agreements() -> None:
    agree = torch.tensor([[True, True, False, True, True, True, False]])
    assert _run_lengths(agree).tolist() == [[2, 1, 0, 3, 2, 1, 0]]


def test_presets_have_the_intended_sizes() -> None:
    sizes = {name: count_params(p, 8192) for name, p in PRESETS.items()}
    assert 8e6 <= sizes["tiny"] <= 12e6 and 1e6 <= sizes["draft"] <= 2e6
    assert 300e6 <= sizes["bench"] <= 600e6 and 20e6 <= sizes["bench-draft"] <= 40e6


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "5", "--seconds", "5"], "exactly one budget"),
    ([], "exactly one budget"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "2", "--eval-interval", "-1"], "--eval-interval must be >= 0"),
])
def test_fit_rejects_bad_budgets(argv: list[str], message: str, data_dir: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--data", data_dir, "--preset", "test", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_best_weights_keep_the_lowest_loss_and_restore_it() -> None:
    model = torch.nn.Linear(2, 2)
    best = BestWeights()
    with torch.no_grad():
        model.weight.fill_(1.0)
        assert best.offer(model, 10, 2.0)
        model.weight.fill_(2.0)
        assert best.offer(model, 20, 1.0)
        model.weight.fill_(3.0)
        assert not best.offer(model, 30, 1.5) and not best.offer(model, 40, float("nan"))
    best.restore(model)
    assert best.step == 20 and torch.equal(model.weight, torch.full((2, 2), 2.0))


def test_eval_interval_keeps_the_best_evaluated_weights(data_dir: str, tmp_path: Path) -> None:
    """The loop evaluates every N steps and after the last, and the model ends with the weights
    of the lowest evaluation (here a fake loss that is lowest at step 4), not the last ones."""
    from photon.train.loop import train
    from photon.train.tokenizer import TRAIN_FILE, load_stream

    manifest = Manifest.read(data_dir)
    model = build_model(get_preset("test"), manifest, seed=0)
    fake = iter([3.0, 1.0, 2.0, 2.5])
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def evaluate(m: torch.nn.Module) -> float:
        assert not m.training  # evaluated in eval mode
        seen[len(seen)] = {k: v.clone() for k, v in m.state_dict().items()}
        return next(fake)

    result = train(model, load_stream(data_dir, TRAIN_FILE), _settings(steps=7, eval_interval=2),
                   torch.device("cpu"), lambda _: None, evaluate)
    assert [step for step, _ in result.evals] == [2, 4, 6, 7]
    assert result.selected_step == 4 and result.steps == 7
    state = model.state_dict()
    assert all(torch.equal(state[k], seen[1][k]) for k in state)
    assert not all(torch.equal(state[k], seen[3][k]) for k in state)


def test_fit_with_eval_interval_records_the_selected_step(data_dir: str, tmp_path: Path) -> None:
    outcome = fit(data_dir, get_preset("test"), _settings(steps=4, eval_interval=2,
                                                          eval_windows=2),
                  str(tmp_path), torch.device("cpu"), log=lambda _: None)
    assert outcome.result.selected_step in (2, 4)
    assert [step for step, _ in outcome.result.evals] == [2, 4]
    record = load_hf_config(str(tmp_path))["photon_training"]
    assert record["selected_step"] == outcome.result.selected_step


def test_fit_names_a_missing_prepare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--data", str(tmp_path), "--preset", "test", "--out", str(tmp_path),
              "--steps", "1"])
    assert "manifest.json is missing" in capsys.readouterr().err


def test_all_trains_a_pair_and_measures_agreement(data_dir: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["all", "--out", str(tmp_path), "--data", data_dir, "--target-steps", "2",
            "--draft-steps", "2", "--batch-size", "2", "--seq-len", "16", "--windows", "3",
            "--max-eval-windows", "2", "--device", "cpu"]
    assert main(argv) == 0
    for name, preset in (("photon-tiny", "tiny"), ("photon-tiny-draft", "draft")):
        record = load_hf_config(str(tmp_path / name))["photon_training"]
        assert (record["preset"], record["steps"], record["seq_len"]) == (preset, 2, 16)
        assert record["heldout_tokens"] == 32
    with open(tmp_path / "agreement.json", encoding="utf-8") as f:
        result = json.load(f)
    assert result["windows"] == 3 and result["positions"] == 48
    assert 0.0 <= result["agreement"] <= 1.0
    assert "greedy agreement" in capsys.readouterr().out
