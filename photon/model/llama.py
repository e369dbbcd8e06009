"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 share this graph via flags).

Flags on the ForCausalLM class select the variants:
  * qkv_bias: bias on q/k/v (Qwen2: always; Llama/Qwen3: `attention_bias`);
  * o_bias: bias on o_proj (Llama/Qwen3: `attention_bias`; Qwen2: never);
  * qk_norm: per-head RMSNorm on q and k before rope (Qwen3).
Module names mirror HF's (`model.layers.N.self_attn...`) so checkpoint names map one to one,
except the packed `qkv_proj` (q/k/v) and `gate_up_proj` (gate/up).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from photon.attention.backend import ForwardContext
from photon.config import ConfigError
from photon.distributed.group import TPGroup
from photon.model.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    get_rope,
)

if TYPE_CHECKING:
    from photon.quant.base import LinearMethod
    from photon.quant.config import QuantConfig


@dataclass(frozen=True)
class DecoderFlags:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool


def linear_method(quant: QuantConfig | None, prefix: str, packed: str,
                  *members: str) -> LinearMethod | None:
    """The quantization method of linear `prefix + packed`, which packs the checkpoint's
    modules `members` (None: unquantized)."""
    if quant is None:
        return None
    return quant.linear_method(prefix + packed, tuple(prefix + m for m in members))


def head_dim_of(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


class DecoderAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, flags: DecoderFlags,
                 use_triton: bool, tp: TPGroup | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = head_dim_of(cfg)
        prefix = f"model.layers.{layer_idx}.self_attn."
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, bias=flags.qkv_bias, tp=tp,
            quant=linear_method(quant, prefix, "qkv_proj", "q_proj", "k_proj", "v_proj"))
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=flags.o_bias, tp=tp,
                                        quant=linear_method(quant, prefix, "o_proj", "o_proj"))
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(head_dim, eps, use_triton) if flags.qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, use_triton) if flags.qk_norm else None
        self.rotary_emb = get_rope(head_dim, cfg, use_triton)
        self.attn = Attention(layer_idx, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                              head_dim, head_dim ** -0.5)

    def project(self, positions: torch.Tensor, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention's inputs: q [T, H, D] and k [T, Hkv, D] normed and rotated, v [T, Hkv*D]."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        a = self.attn
        q = q.view(-1, a.num_heads, a.head_dim)
        k = k.view(-1, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.o_proj(self.attn(*self.project(positions, x), ctx))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], flags: DecoderFlags, use_triton: bool,
                 tp: TPGroup | None = None, quant: QuantConfig | None = None,
                 prefix: str = "") -> None:
        """prefix: the checkpoint's name of this MLP with a trailing dot (model.layers.0.mlp.),
        which names its linears for `quant`."""
        super().__init__()
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r} (only silu)")
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=flags.mlp_bias, tp=tp,
            quant=linear_method(quant, prefix, "gate_up_proj", "gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=flags.mlp_bias, tp=tp,
            quant=linear_method(quant, prefix, "down_proj", "down_proj"))
        self.act_fn = SiluAndMul(use_triton)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# Builds layer i's MLP (dense, or a sparse MoE block in the MoE families).
MlpFactory = Callable[[int], nn.Module]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, flags: DecoderFlags,
                 use_triton: bool, mlp: nn.Module, tp: TPGroup | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        eps, hidden = float(cfg.get("rms_norm_eps", 1e-6)), int(cfg["hidden_size"])
        self.self_attn = DecoderAttention(cfg, layer_idx, flags, use_triton, tp, quant)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, use_triton)
        self.post_attention_layernorm = RMSNorm(hidden, eps, use_triton)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        # Invariant: on return, residual holds the stream *before* this layer's MLP output is
        # added; the next layer's (or the final) norm performs that add.
        q, k, v, residual = self.before_attention(positions, x, residual)
        return self.after_attention(self.self_attn.attn(q, k, v, ctx), residual)

    def before_attention(self, positions: torch.Tensor, x: torch.Tensor,
                         residual: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention, token by token: (q, k, v, residual)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.project(positions, x), residual)

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from attention's output [T, H*D] on, token by token: (MLP output,
        residual)."""
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn), residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], flags: DecoderFlags, use_triton: bool,
                 make_mlp: MlpFactory, tp: TPGroup | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(int(cfg["vocab_size"]), int(cfg["hidden_size"]),
                                                   tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, flags, use_triton, make_mlp(i), tp, quant)
            for i in range(int(cfg["num_hidden_layers"])))
        self.norm = RMSNorm(int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6)),
                            use_triton)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# (packed param name, HF name, shard id): HF's separate projections -> our packed ones.
_STACKED: list[tuple[str, str, str | int]] = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]
_SHARDS: dict[str, set[str | int]] = {".qkv_proj.": {"q", "k", "v"}, ".gate_up_proj.": {0, 1}}


class LlamaForCausalLM(nn.Module):
    @staticmethod
    def decoder_flags(cfg: dict[str, Any]) -> DecoderFlags:
        bias = bool(cfg.get("attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=False,
                            mlp_bias=bool(cfg.get("mlp_bias", False)))

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype,
                 device: torch.device | str, use_triton: bool = False,
                 tp: TPGroup | None = None, quant_config: QuantConfig | None = None) -> None:
        """use_triton: the layers run photon.kernels' Triton kernels on CUDA tensors (else the
        torch ops; ModelConfig.use_triton says which). tp: this rank's tensor-parallel group
        (None: one rank); the layers hold and load only the rank's shards. quant_config: the
        linear layers' quantization (None: unquantized); embeddings and LM head never are."""
        super().__init__()
        self.hf_config = hf_config
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        # RotaryEmbedding builds its float32 caches explicitly, so the default dtype only
        # affects parameters.
        flags = self.decoder_flags(hf_config)
        with _default_dtype(dtype), torch.device(device):
            self.model = DecoderModel(
                hf_config, flags, use_triton,
                lambda i: self.make_mlp(hf_config, i, flags, use_triton, tp, quant_config),
                tp, quant_config)
            self.lm_head = ParallelLMHead(int(hf_config["vocab_size"]),
                                          int(hf_config["hidden_size"]), tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(cfg: dict[str, Any], layer_idx: int, flags: DecoderFlags,
                 use_triton: bool, tp: TPGroup | None = None,
                 quant: QuantConfig | None = None) -> nn.Module:
        """Layer `layer_idx`'s MLP; the MoE families return their sparse block where it applies."""
        return DecoderMLP(cfg, flags, use_triton, tp, quant, f"model.layers.{layer_idx}.mlp.")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def map_weight_name(self, hf_name: str) -> tuple[str, Any]:
        """(our parameter name, shard id or None) for a checkpoint tensor name."""
        return _map_name(hf_name)

    def expected_shards(self, name: str) -> set[Any] | None:
        """The shard ids that together fill packed parameter `name` (None: not packed)."""
        return next((want for key, want in _SHARDS.items() if key in name), None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of our parameters that are fully loaded."""
        params = dict(self.named_parameters())
        seen_shards: dict[str, set[Any]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            name, shard_id = self.map_weight_name(hf_name)
            if name not in params:
                raise ConfigError(f"checkpoint weight {hf_name!r} does not match any parameter "
                                  f"of {type(self).__name__}")
            _call_loader(params[name], tensor, shard_id, hf_name, name)
            if shard_id is None:
                loaded.add(name)
            else:
                seen_shards.setdefault(name, set()).add(shard_id)
        loaded.update(name for name, shards in seen_shards.items()
                      if shards == self.expected_shards(name))
        return loaded


def _map_name(hf_name: str) -> tuple[str, str | int | None]:
    for packed, separate, shard_id in _STACKED:
        if separate in hf_name:
            return hf_name.replace(separate, packed), shard_id
    return hf_name, None


def _call_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any,
                 hf_name: str, name: str) -> None:
    loader = param.weight_loader  # type: ignore[attr-defined]
    try:
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except ValueError as e:
        raise ConfigError(f"cannot load checkpoint weight {hf_name!r} into {name!r}: {e}") from e
