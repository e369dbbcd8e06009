"""photon's built-in model names, and photon-tiny-random (a Qwen3 directory with random weights).

`photon-tiny` (the default model) and `photon-tiny-draft` (its speculative-decoding draft) are
trained checkpoints shipped inside the package (photon/assets, made by `python -m photon.train`).
`photon-tiny-random` is a small random-weight model for tests of the engine's mechanics. It is
generated on first use, deterministically (fixed seeds, no network, no transformers), into
`$PHOTON_CACHE_DIR/photon-tiny-random-v1` (default `~/.cache/photon`). Two creations give byte-identical
files. Creation is atomic: files are written to a temporary sibling directory that is renamed
into place, so a reader never sees a half-written model and two racing processes are harmless.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch

from photon.config import ConfigError

PHOTON_TINY = "photon-tiny"  # the default model
PHOTON_TINY_DRAFT = "photon-tiny-draft"
PHOTON_TINY_RANDOM = "photon-tiny-random"
BUILTIN_MODELS = (PHOTON_TINY, PHOTON_TINY_DRAFT, PHOTON_TINY_RANDOM)
_DIR_NAME = "photon-tiny-random-v1"  # bump the suffix whenever the generated content changes
_MARKER = "photon_random_weights"
_SEED = 1234
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TOKENIZER_VOCAB = 1000  # bytes (256) + specials (3) + ~740 merges; padded to 1024 in the model
_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json", "README.md")

_ARCH: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
}

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_README = """# photon-tiny-random

**RANDOM WEIGHTS — output is meaningless; for smoke tests and benchmarks.**

A 4-layer Qwen3-architecture model (hidden 128) with a small byte-level BPE tokenizer, generated
deterministically by `photon.model.tiny.ensure_photon_tiny_random()`. It is a real Hugging Face model
directory: `transformers` can load both the tokenizer and the model from it.
"""

# Fixed training text for the tokenizer: English prose, Python code, JSON and chat-style text.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A language model reads a prompt, splits it into
tokens, and predicts the next token again and again until it reaches a stop condition. The
inference engine schedules many requests together, keeps their attention keys and values in a
paged cache, and streams the generated text back to each client as soon as it is available.
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past three.
Please write a short story about a robot who learns to paint the sea at sunset. Once upon a
time, in a small village near the mountains, there lived an old engineer named Ada. She built
machines that could count, sort, translate and remember. Every morning she walked to the river,
listened to the water, and wrote notes in her notebook about numbers, rivers, music and light.
Summarize the following article in three sentences. Translate this sentence into French.
Explain why the sky is blue. Because sunlight is scattered by the molecules of the atmosphere,
and shorter wavelengths are scattered more strongly than longer ones. Science, history,
mathematics, geography, biology, chemistry, physics, economics, philosophy and literature.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June
July August September October November December morning evening night yesterday tomorrow.
def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    hidden_states = self.embed_tokens(input_ids)
    for layer in self.layers:
        hidden_states = layer(positions, hidden_states)
    return self.norm(hidden_states)

class Scheduler:
    def __init__(self, max_num_seqs: int = 256, block_size: int = 16) -> None:
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def schedule(self) -> SchedulerOutput:
        if not self.waiting and not self.running:
            return None
        for request in sorted(self.running, key=lambda r: r.arrival_time):
            print(f"request {request.request_id} has {len(request.tokens)} tokens")
        return SchedulerOutput(scheduled=self.running, num_tokens=sum(map(len, self.running)))

import os, sys, json, math, random, time, asyncio, logging
from typing import Any, Optional, Union
async def main() -> None:
    while True:
        try:
            result = await client.get("/v1/models", timeout=10.0)
        except Exception as error:
            logging.error("request failed: %s", error)
            raise
        else:
            break
    return result

for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; } return sum;
const response = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" } });
SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
{"model": "photon-tiny", "messages": [{"role": "system", "content": "You are a helpful assistant."},
{"role": "user", "content": "What is the capital of France?"}], "temperature": 0.7, "max_tokens": 128,
"stream": true, "stop": ["\\n\\n"], "top_p": 0.95, "seed": 42, "n": 1, "logprobs": null}
{"id": "cmpl-123", "object": "chat.completion", "created": 1700000000, "choices": [{"index": 0,
"message": {"role": "assistant", "content": "The capital of France is Paris."},
"finish_reason": "stop"}], "usage": {"prompt_tokens": 25, "completion_tokens": 8, "total_tokens": 33}}
{"error": {"message": "invalid request", "type": "invalid_request_error", "code": 400}}
[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 65536]
0.1 0.25 0.5 1.0 2.5 3.14159 2.71828 100% 42 1e-6 -1 true false null None True False
user assistant system tool function arguments name content role index value key values keys
https://example.com/api/v1/chat/completions?stream=true&model=photon README.md setup.py main.py
Good morning! Thanks for your help. Yes, no, maybe. I think that this is a good idea, but we
should test it first. Could you please check the results and let me know what you find? Sure!
Here is the answer: first, compute the sum; second, divide by the count; finally, round it.
"""


def resolve_model_path(model: str | None, revision: str | None = None,
                       download_dir: str | None = None) -> str:
    """Map the `--model` argument to an absolute model directory: a built-in name (None is
    photon-tiny; photon-tiny-random is created if need be), a local directory, or else a Hugging
    Face hub id (downloaded or taken from the cache)."""
    from photon.model.hub import download_model, is_repo_id

    if model is None or model in BUILTIN_MODELS:
        return builtin_model_path(model or PHOTON_TINY)
    if not os.path.isdir(model):
        if is_repo_id(model):
            return download_model(model, revision, download_dir)
        raise ConfigError(f"model directory {model!r} does not exist")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(f"model directory {model!r} has no config.json")
    return os.path.abspath(model)


def builtin_model_path(name: str) -> str:
    """The directory of one of BUILTIN_MODELS: the trained ones are package data."""
    if name == PHOTON_TINY_RANDOM:
        return ensure_photon_tiny_random()
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"unknown built-in model {name!r}; built-in models: "
                          f"{', '.join(BUILTIN_MODELS)}")
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
    return os.path.join(root, name)


def is_random_weights(model_dir: str) -> bool:
    """True when config.json carries photon's random-weights marker (photon-tiny-random)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get(_MARKER, False))
    except (OSError, ValueError):
        return False


def default_cache_dir() -> str:
    return os.environ.get("PHOTON_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "photon")


def ensure_photon_tiny_random(cache_dir: str | None = None) -> str:
    """Return the photon-tiny-random directory, generating it first if it is missing or
    incomplete."""
    return ensure_generated(_DIR_NAME, _FILES, write_photon_tiny_random, cache_dir)


def ensure_generated(dir_name: str, files: tuple[str, ...], write: Callable[[str], None],
                     cache_dir: str | None = None) -> str:
    """`$cache/dir_name`, written by `write(tmp_dir)` into a temporary sibling and renamed into
    place unless every one of `files` is already there (atomic; racing writers are harmless)."""
    root = os.path.abspath(cache_dir or default_cache_dir())
    final = os.path.join(root, dir_name)
    if _is_complete(final, files):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{dir_name}.tmp-", dir=root)
    try:
        write(tmp)
        _install(tmp, final, files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op when the rename succeeded
    return final


def _is_complete(path: str, files: tuple[str, ...]) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in files)


def _install(tmp: str, final: str, files: tuple[str, ...]) -> None:
    """Atomically rename `tmp` to `final`; losing a race to another process is fine."""
    if os.path.isdir(final) and not _is_complete(final, files):
        shutil.rmtree(final, ignore_errors=True)  # left over by a foreign/partial writer
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final, files):  # someone else won the race only if it is complete
            raise


def write_photon_tiny_random(out_dir: str) -> None:
    """Write every photon-tiny-random file into the existing directory `out_dir` (deterministic)."""
    from safetensors.torch import save_file

    tokenizer = build_tokenizer()
    special = write_tokenizer_files(tokenizer, out_dir)
    vocab_size = _round_up(tokenizer.get_vocab_size(with_added_tokens=True), 64)
    config = _hf_config(vocab_size, special)
    write_json(out_dir, "config.json", config)
    write_json(out_dir, "generation_config.json", {
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "do_sample": False,
    })
    save_file(random_weights(config), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(_README)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def write_json(out_dir: str, name: str, obj: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def _hf_config(vocab_size: int, special: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_ARCH,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "vocab_size": vocab_size,
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": special["<|im_end|>"],
        "pad_token_id": special["<|endoftext|>"],
        _MARKER: True,
    }


def write_tokenizer_files(tokenizer: Any, out_dir: str) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json (ChatML template); returns the special
    tokens' ids."""
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    special = {tok: tokenizer.token_to_id(tok) for tok in _SPECIAL_TOKENS}
    write_json(out_dir, "tokenizer_config.json", tokenizer_config(special))
    return special


def tokenizer_config(special: dict[str, int]) -> dict[str, Any]:
    decoder = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for tok, i in special.items()}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }


def build_tokenizer(vocab_size: int = _TOKENIZER_VOCAB, texts: Iterable[str] = (_CORPUS,)) -> Any:
    """Train a byte-level BPE with the ChatML specials at ids 0-2 on `texts` (default: the
    built-in corpus). Deterministic: see test_tiny_tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def random_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF-named Qwen3 weights from a fixed-seed generator.

    Matrices use std 0.1 (not the usual 0.02, which makes a random model repeat one token) so
    that greedy output is varied; norm weights are ones.
    """
    gen = torch.Generator().manual_seed(_SEED)
    hidden, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def randn(*shape: int, std: float = 0.1) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).contiguous()

    embed = randn(config["vocab_size"], hidden, std=0.25)
    # Shrink the special-token and vocab-padding rows: with tied embeddings their logits then stay
    # near 0, so the random model rarely stops at once or emits ids the tokenizer cannot decode.
    embed[: len(_SPECIAL_TOKENS)] *= 0.1
    embed[_TOKENIZER_VOCAB:] *= 0.1
    weights = {"model.embed_tokens.weight": embed}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": randn(q_out, hidden),
            p + "self_attn.k_proj.weight": randn(kv_out, hidden),
            p + "self_attn.v_proj.weight": randn(kv_out, hidden),
            p + "self_attn.o_proj.weight": randn(hidden, q_out),
            p + "self_attn.q_norm.weight": torch.ones(hd),
            p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "mlp.gate_proj.weight": randn(inter, hidden),
            p + "mlp.up_proj.weight": randn(inter, hidden),
            p + "mlp.down_proj.weight": randn(hidden, inter),
        })
    weights["model.norm.weight"] = torch.ones(hidden)
    return weights
