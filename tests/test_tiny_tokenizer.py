from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from photon.config import ConfigError
from photon.model.hf_config import load_hf_config
from photon.model.tiny import (
    BUILTIN_MODELS,
    PHOTON_TINY,
    PHOTON_TINY_DRAFT,
    PHOTON_TINY_RANDOM,
    builtin_model_path,
    ensure_photon_tiny_random,
    is_random_weights,
    resolve_model_path,
)
from photon.tokenizer import Tokenizer

UNICODE_SAMPLES = [
    "Hello, world!",
    "naïve café, jalapeño, Ærøskøbing, ß",
    "日本語のテキストと中文文本",
    "emoji 🚀🔥👩‍👩‍👧 and flags 🇫🇷",
    "def f(x: int) -> int:\n\treturn x ** 2  # square\n",
    '{"key": [1, 2.5, null], "ü": "\\u00fc"}',
    "  leading and trailing spaces  \n\n",
    "Ω≈ç√∫˜µ≤≥÷ — “quotes” ‘single’ …",
    "",
]


@pytest.fixture()
def tiny_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path / "cache"))
    return resolve_model_path(PHOTON_TINY_RANDOM)


def _read_all(directory: str) -> dict[str, bytes]:
    return {name: Path(directory, name).read_bytes() for name in sorted(os.listdir(directory))}


def test_creation_is_deterministic(tmp_path: Path) -> None:
    a = ensure_photon_tiny_random(str(tmp_path / "a"))
    b = ensure_photon_tiny_random(str(tmp_path / "b"))
    files_a, files_b = _read_all(a), _read_all(b)
    assert set(files_a) >= {"config.json", "model.safetensors", "tokenizer.json",
                            "tokenizer_config.json", "generation_config.json", "README.md"}
    assert files_a == files_b
    assert not [p for p in os.listdir(tmp_path / "a") if p.startswith(".")]  # no temp dirs left


def test_reuse_and_resolve(tiny_dir: str, tmp_path: Path) -> None:
    assert tiny_dir == str(tmp_path / "cache" / "photon-tiny-random-v1")
    mtime = os.stat(os.path.join(tiny_dir, "model.safetensors")).st_mtime_ns
    assert resolve_model_path(PHOTON_TINY_RANDOM) == tiny_dir
    assert os.stat(os.path.join(tiny_dir, "model.safetensors")).st_mtime_ns == mtime
    assert resolve_model_path(tiny_dir) == tiny_dir
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_builtin_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """photon-tiny (the default) and photon-tiny-draft are the trained package directories, with
    no random-weights marker; photon-tiny-random is generated; served under their own names."""
    from photon.engine_args import EngineArgs

    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path / "cache"))
    package = Path(__file__).resolve().parents[1] / "photon" / "assets"
    assert resolve_model_path(None) == resolve_model_path(PHOTON_TINY) == str(package / PHOTON_TINY)
    assert resolve_model_path(PHOTON_TINY_DRAFT) == str(package / PHOTON_TINY_DRAFT)
    for name in (PHOTON_TINY, PHOTON_TINY_DRAFT):
        assert not is_random_weights(resolve_model_path(name))
        assert "photon_training" in load_hf_config(resolve_model_path(name))
    assert is_random_weights(resolve_model_path(PHOTON_TINY_RANDOM))
    assert not os.path.exists(package / PHOTON_TINY_RANDOM)  # generated, never shipped
    for name in (None, *BUILTIN_MODELS):
        config = EngineArgs(model=name).create_config()
        assert config.model.served_model_name == (name or PHOTON_TINY)
    with pytest.raises(ConfigError, match="built-in models: photon-tiny, photon-tiny-draft"):
        builtin_model_path("photon-huge")


def test_concurrent_creation(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: ensure_photon_tiny_random(str(tmp_path)), range(4)))
    assert len(set(paths)) == 1 and is_random_weights(paths[0])
    assert os.listdir(tmp_path) == ["photon-tiny-random-v1"]  # losers cleaned up their temp dirs


def test_incomplete_dir_is_rebuilt(tmp_path: Path) -> None:
    partial = tmp_path / "photon-tiny-random-v1"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    path = ensure_photon_tiny_random(str(tmp_path))
    assert is_random_weights(path)
    assert Path(path, "model.safetensors").is_file()


def test_config_and_marker(tiny_dir: str) -> None:
    cfg = load_hf_config(tiny_dir)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] % 64 == 0
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (128, 4, 32)
    assert is_random_weights(tiny_dir)
    assert "RANDOM WEIGHTS" in Path(tiny_dir, "README.md").read_text(encoding="utf-8")


def test_not_random_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert not is_random_weights(str(tmp_path))
    assert not is_random_weights(str(tmp_path / "missing"))


def test_tokenizer_round_trip(tiny_dir: str) -> None:
    tok = Tokenizer.from_pretrained(tiny_dir)
    assert 900 <= tok.vocab_size <= load_hf_config(tiny_dir)["vocab_size"]
    for text in UNICODE_SAMPLES:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode("The quick brown fox jumps over the lazy dog.")) < 20  # merges work


def test_special_tokens_and_eos(tiny_dir: str) -> None:
    tok = Tokenizer.from_pretrained(tiny_dir)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    im_start = tok.token_to_id("<|im_start|>")
    assert tok.eos_token_ids == frozenset({im_end, eot})
    assert tok.all_special_ids == frozenset({im_end, eot, im_start})
    assert tok.bos_token_id is None
    assert tok.id_to_token(im_end) == "<|im_end|>"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_missing_tokenizer_and_template(tmp_path: Path, tiny_dir: str) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes(Path(tiny_dir, name).read_bytes())
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_ids == frozenset({tok.token_to_id("<|im_end|>")})
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_matches_transformers(tiny_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tok = Tokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Hi 👋 there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n")
    assert tok.apply_chat_template(messages[:1]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    for text in UNICODE_SAMPLES:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True)


def test_transformers_loads_model(tiny_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = Tokenizer.from_pretrained(tiny_dir)
    ids = torch.tensor([tok.encode("def forward(self, input_ids):")])
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 24
    assert len(set(new)) >= 6  # random weights scaled so that greedy output is varied
