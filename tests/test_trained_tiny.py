"""The trained built-in pair (photon-tiny, photon-tiny-draft): photon matches transformers on it
(greedy tokens and held-out perplexity, float32), and the committed files are what
`python -m photon.train` produces."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from photon import LLM, SamplingParams
from photon.config import ModelConfig
from photon.model.hf_config import load_hf_config
from photon.model.loader import load_model
from photon.model.tiny import PHOTON_TINY, PHOTON_TINY_DRAFT, builtin_model_path
from photon.train.corpus import corpus_digest, load_corpus
from photon.train.presets import get_preset, qwen3_config
from photon.train.prompts import HeldoutPrompt, cut_prompts, prompts_json
from photon.train.tokenizer import EOT, encode_files, train_tokenizer
from tests.hf_models import hf_tensor

PROMPTS_FILE = Path(__file__).parent / "data" / "heldout_code.json"
PAIR = ((PHOTON_TINY, "tiny"), (PHOTON_TINY_DRAFT, "draft"))
NEW_TOKENS = 32
FILE_LIMIT = 16 << 20


def _record(name: str) -> dict:
    return load_hf_config(builtin_model_path(name))["photon_training"]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [p["token_ids"] for p in json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))]


@dataclass(frozen=True)
class Prepared:
    directory: str  # the tokenizer files `prepare` writes
    prompts: list[HeldoutPrompt]  # what `photon.train.prompts` cuts from its held-out stream


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """`prepare`'s steps on this machine's standard library, when it is the corpus the pair was
    trained on (its hash is the recorded one); otherwise the tests that need it skip. Only the
    held-out stream is encoded: no test here reads the train stream, two thirds of `prepare`'s
    time (test_train runs `prepare` and `heldout_prompts` whole, on a small corpus)."""
    corpus = load_corpus()
    digest, _ = corpus_digest(corpus.all_files())
    if digest != _record(PHOTON_TINY)["corpus_sha256"]:
        pytest.skip("this Python's standard library is not the corpus photon-tiny was trained on")
    out = str(tmp_path_factory.mktemp("prepared"))
    tokenizer, special = train_tokenizer(corpus, out)
    heldout = encode_files(tokenizer, corpus.heldout, special[EOT])
    return Prepared(out, cut_prompts(heldout, special[EOT], [f.path for f in corpus.heldout]))


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        builtin_model_path(PHOTON_TINY), dtype=torch.float32).eval()


# ---------------------------------------------------------------- parity with transformers


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None  # as photon's ignore_eos: always NEW_TOKENS
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=0, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_greedy(prompts: list[list[int]], hf_model: torch.nn.Module) -> list[list[int]]:
    return [_hf_greedy(hf_model, p) for p in prompts]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_greedy_tokens_match_transformers(pipelined: bool, prompts: list[list[int]],
                                          hf_greedy: list[list[int]]) -> None:
    llm = LLM(PHOTON_TINY, dtype="float32", max_model_len=512, max_num_seqs=8,
              pipelined=pipelined)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    assert len(ours) == len(prompts) == 20
    for i, (a, b) in enumerate(zip(ours, hf_greedy)):
        assert list(a) == b, f"prompt {i}"


def test_heldout_perplexity_matches_transformers(prompts: list[list[int]],
                                                 hf_model: torch.nn.Module) -> None:
    llm = LLM(PHOTON_TINY, dtype="float32", max_model_len=512, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ours = [entry[tid].logprob for p, o in zip(prompts, outs)
            for tid, entry in zip(p[1:], o.prompt_logprobs[1:])]
    theirs = []
    with torch.no_grad():
        for p in prompts:
            logits = hf_model(torch.tensor([p])).logits[0, :-1].float()
            theirs += torch.log_softmax(logits, -1).gather(1, torch.tensor(p[1:])[:, None])[:, 0]
    ppl_ours = math.exp(-sum(ours) / len(ours))
    ppl_theirs = math.exp(-float(torch.stack(theirs).double().mean()))
    assert len(ours) == len(theirs) == sum(len(p) - 1 for p in prompts)
    assert ppl_ours == pytest.approx(ppl_theirs, rel=1e-3)
    assert 1.0 < ppl_ours < 100.0  # a trained model, not a uniform 8k-way guess


# ---------------------------------------------------------------- the committed files


def test_heldout_prompts_are_what_the_script_cuts(prepared: Prepared) -> None:
    assert prompts_json(prepared.prompts) == PROMPTS_FILE.read_text(encoding="utf-8")


def test_tokenizer_is_what_prepare_writes(prepared: Prepared) -> None:
    made = Path(prepared.directory, "tokenizer.json").read_bytes()
    for name, _ in PAIR:
        assert Path(builtin_model_path(name), "tokenizer.json").read_bytes() == made, name


@pytest.mark.parametrize(("name", "preset"), PAIR)
def test_recorded_tokenizer_hash(name: str, preset: str) -> None:
    data = Path(builtin_model_path(name), "tokenizer.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == _record(name)["tokenizer_sha256"]
    assert _record(name)["preset"] == preset


_ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
              "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
              "eos_token_id", "pad_token_id", "architectures", "model_type")


@pytest.mark.parametrize(("name", "preset"), PAIR)
def test_architecture_is_the_presets(name: str, preset: str) -> None:
    pytest.importorskip("transformers")
    from photon.tokenizer import Tokenizer

    directory = builtin_model_path(name)
    tok = Tokenizer.from_pretrained(directory)
    special = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert special == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    built = qwen3_config(get_preset(preset), tok.vocab_size, special).to_dict()
    committed = load_hf_config(directory)
    assert {k: committed[k] for k in _ARCH_KEYS} == {k: built[k] for k in _ARCH_KEYS}
    assert committed["photon_training"]["parameters"] == sum(
        p.numel() for p in _load(directory).parameters())


def _load(directory: str) -> torch.nn.Module:
    hf_config = load_hf_config(directory)
    config = ModelConfig(model=directory, hf_config=hf_config, architecture="Qwen3ForCausalLM",
                         dtype=torch.bfloat16, max_model_len=512,
                         vocab_size=hf_config["vocab_size"], seed=0, served_model_name="t")
    return load_model(config, "cpu")


@pytest.mark.parametrize("name", [name for name, _ in PAIR])
def test_files_are_small_and_photon_loads_the_weights_exactly(name: str) -> None:
    from safetensors.torch import load_file

    directory = Path(builtin_model_path(name))
    shards = sorted(directory.glob("*.safetensors"))
    assert shards and all(f.stat().st_size < FILE_LIMIT for f in directory.iterdir())
    stored = {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    params = dict(_load(str(directory)).named_parameters())
    assert len(params) > 5
    for pname, param in params.items():
        expected = hf_tensor(stored, pname)
        assert param.dtype == expected.dtype == torch.bfloat16, pname
        assert torch.equal(param, expected), pname
