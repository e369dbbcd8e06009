"""Model presets (Qwen3 shapes and training defaults) and the Qwen3Config they build.

Sizes are counted with the real vocabulary (8,192 tokens from `prepare`): `tiny` about 11M
parameters, `draft` about 1.4M, `bench` about 310M, `bench-draft` about 23M; `test` is a few
thousand parameters plus its embedding, for CPU tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Preset:
    name: str
    model_name: str  # the name the trained model directory's README gives it
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int
    batch_size: int  # sequences per optimizer step
    lr: float
    warmup_steps: int

    def arch(self) -> dict[str, int]:
        d = asdict(self)
        return {k: d[k] for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                  "head_dim", "intermediate_size")}


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", "photon-tiny", hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2,
           head_dim=64, intermediate_size=896, seq_len=512, batch_size=128, lr=3e-3,
           warmup_steps=100),
    Preset("draft", "photon-tiny-draft", hidden_size=128, num_layers=2, num_heads=2,
           num_kv_heads=1, head_dim=64, intermediate_size=384, seq_len=512, batch_size=128,
           lr=3e-3, warmup_steps=100),
    Preset("bench", "photon-bench", hidden_size=1024, num_layers=24, num_heads=16,
           num_kv_heads=8, head_dim=64, intermediate_size=3072, seq_len=512, batch_size=64,
           lr=6e-4, warmup_steps=100),
    Preset("bench-draft", "photon-bench-draft", hidden_size=512, num_layers=6, num_heads=8,
           num_kv_heads=4, head_dim=64, intermediate_size=1536, seq_len=512, batch_size=128,
           lr=2e-3, warmup_steps=100),
    Preset("test", "photon-train-test", hidden_size=32, num_layers=1, num_heads=2,
           num_kv_heads=1, head_dim=16, intermediate_size=64, seq_len=32, batch_size=8, lr=1e-2,
           warmup_steps=2),
)}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def padded_vocab(vocab_size: int) -> int:
    return (vocab_size + VOCAB_MULTIPLE - 1) // VOCAB_MULTIPLE * VOCAB_MULTIPLE


def qwen3_config(preset: Preset, vocab_size: int, special: dict[str, int]) -> Any:
    """A transformers Qwen3Config for `preset` with the vocabulary padded to a multiple of 128
    and the embeddings tied (photon-tiny's layout)."""
    from transformers import Qwen3Config

    eot, im_end = special["<|endoftext|>"], special["<|im_end|>"]
    return Qwen3Config(
        vocab_size=padded_vocab(vocab_size), hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim, hidden_act="silu", max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, attention_dropout=0.0,
        tie_word_embeddings=True, use_sliding_window=False, use_cache=True,
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
        architectures=["Qwen3ForCausalLM"])


def count_params(preset: Preset, vocab_size: int) -> int:
    """Parameters of the model `preset` builds (tied embeddings counted once)."""
    h, hd, inter = preset.hidden_size, preset.head_dim, preset.intermediate_size
    q, kv = preset.num_heads * hd, preset.num_kv_heads * hd
    attn = h * q * 2 + h * kv * 2 + 2 * hd
    layer = attn + 3 * h * inter + 2 * h
    return padded_vocab(vocab_size) * h + preset.num_layers * layer + h
