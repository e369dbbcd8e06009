"""Piecewise CUDA graphs: the forward of a step no other graph holds, replayed between attention
calls.

Prefill chunks, mixed steps (decode rows beside a prompt chunk) and speculative rows beside one
run outside the decode and speculative graphs. Launched op by op from Python, such a forward
costs the host several times its GPU time (some 390 launches for a 28-layer model, Triton's
the costliest). Here a step of up to `max_tokens` tokens is padded to a token bucket (one-token
padding rows, as a decode graph's: `inputs.pad_tokens`) and its forward runs as L + 1 graphs of
that bucket with attention, eager, between them:

  piece 0      embeddings, then layer 0 up to attention (norm, QKV, q/k norms, rotary, the K/V
               written into the cache)
  piece i      layer i - 1 from attention's output on (o_proj, norm, MLP), then layer i up to
               attention (1 <= i < L)
  piece L      layer L - 1 from attention's output on, the final norm

Attention itself takes the step's real metadata (its kernels choose their launch from host
ints); the K/V write needs only the slot mapping, so it stays in the pieces. Every piece reads
and writes static buffers of `max_tokens` rows (token ids, positions, slots, q, attention's
output, the residual stream, the final hidden states); what a piece allocates besides is
temporary, in one pool shared by all pieces of all buckets: safe because pieces replay one after
another on the compute stream and none keeps a temporary alive. An FP8 cache's scales are fixed
by then (calibrating steps run op by op).

With LoRA adapters each piece first groups its tokens by slot from the runner's per-token slot
buffer (`LoRABatch.prepare`, device ops only), so its adapted linears read a grouping it made
itself: no piece reads another's temporaries.

Models qualify when their `model` is photon's DecoderModel (every Llama-graph family, MoE ones
included). Steps run op by op instead with tensor parallelism or while FP8 KV scales calibrate
(the runner decides).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from photon.attention.backend import AttentionBackend, ForwardContext
from photon.attention.kv_quant import KVCacheScales, LayerKVScales
from photon.model.llama import DecoderModel
from photon.worker.cuda_graph import Captured

if TYPE_CHECKING:
    from photon.lora.layers import LoRABatch

MAX_TOKENS = 2048  # larger steps are compute-bound: their launches hide behind the GPU work


def token_buckets(max_tokens: int) -> list[int]:
    """Multiples of 16 up to 256, then eight sizes an octave (a multiple of an eighth of the
    octave's start): a step pads by at most an eighth. `max_tokens` is always one."""
    sizes, t = list(range(16, 257, 16)), 256
    while t < max_tokens:
        sizes += [t + (j + 1) * t // 8 for j in range(8)]
        t *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass
class _Static:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    q: torch.Tensor  # [N, H, D]
    attn: torch.Tensor  # [N, H * D], attention's output
    residual: torch.Tensor  # [N, hidden]
    hidden: torch.Tensor  # [N, hidden], the final norm's output


def _static(decoder: DecoderModel, n: int, device: torch.device) -> _Static:
    a = decoder.layers[0].self_attn.attn
    hidden = decoder.embed_tokens.weight.shape[1]
    dtype = decoder.embed_tokens.weight.dtype

    def buf(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    return _Static(buf(n, dtype=torch.int64), buf(n, dtype=torch.int64),
                   buf(n, dtype=torch.int64), buf(n, a.num_heads, a.head_dim),
                   buf(n, a.num_heads * a.head_dim), buf(n, hidden), buf(n, hidden))


class PiecewiseGraphs:
    def __init__(self, decoder: DecoderModel, kv_caches: list[torch.Tensor],
                 backend: AttentionBackend, kv_scales: KVCacheScales | None, max_tokens: int,
                 device: torch.device, lora: LoRABatch | None = None) -> None:
        self.decoder = decoder
        self.kv_caches = kv_caches
        self.backend = backend
        self.kv_scales = kv_scales
        self.lora = lora
        self.buckets = token_buckets(max_tokens)
        self.static = _static(decoder, self.buckets[-1], device)
        # bucket -> its L + 1 pieces; a piece is a replayable callable (a graph's replay, or
        # with `capture(eager=True)` the piece itself: the same buffers and order, uncaptured)
        self.pieces: dict[int, list[Callable[[], object]]] = {}
        self.replays = 0

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return isinstance(getattr(model, "model", None), DecoderModel)

    def bucket(self, num_tokens: int) -> int | None:
        if num_tokens > self.buckets[-1]:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def _piece(self, i: int, t: int) -> torch.Tensor:
        """Piece i of bucket t (module docstring), from and into the static buffers."""
        d, s = self.decoder, self.static
        if self.lora is not None:  # pieces always run the LoRA kernels (slot 0 adds nothing)
            self.lora.active = True
            self.lora.prepare(t)
        if i == 0:
            x, residual = d.embed_tokens(s.input_ids[:t]), None
        else:
            x, residual = d.layers[i - 1].after_attention(s.attn[:t], s.residual[:t])
        if i == len(d.layers):
            out, _ = d.norm(x, residual)
            return s.hidden[:t].copy_(out)
        q, k, v, residual = d.layers[i].before_attention(s.positions[:t], x, residual)
        a = d.layers[i].self_attn.attn
        k = k.reshape(t, a.num_kv_heads, a.head_dim)
        v = v.reshape(t, a.num_kv_heads, a.head_dim)
        self.backend.write_kv(k, v, self.kv_caches[a.layer_idx], s.slot_mapping[:t],
                              self._scales(a.layer_idx))
        s.q[:t].copy_(q)
        return s.residual[:t].copy_(residual)

    def _scales(self, layer: int) -> LayerKVScales | None:
        return None if self.kv_scales is None else self.kv_scales.layer(layer)

    def capture(self, pool: tuple | None = None, eager: bool = False) -> tuple | None:
        """Every bucket's pieces, the largest bucket first; returns the pool. `eager`: keep the
        pieces uncaptured (CPU tests)."""
        if not eager:
            torch.cuda.synchronize()
        for t in reversed(self.buckets):
            pieces: list[Callable[[], object]] = []
            for i in range(len(self.decoder.layers) + 1):
                def piece(i: int = i, t: int = t) -> torch.Tensor:
                    return self._piece(i, t)
                if eager:
                    pieces.append(piece)
                else:
                    g = Captured(piece, pool)
                    pool = g.pool
                    pieces.append(g.graph.replay)
            self.pieces[t] = pieces
        if not eager:
            torch.cuda.synchronize()
        return pool

    def run(self, t: int, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
        """The forward of a step padded to bucket t: its final hidden states [t, hidden] (a view
        of a static buffer, valid until the next run)."""
        s, pieces, meta = self.static, self.pieces[t], ctx.metadata
        s.input_ids[:t].copy_(input_ids)
        s.positions[:t].copy_(positions)
        s.slot_mapping[:t].copy_(meta.slot_mapping)
        for i, layer in enumerate(self.decoder.layers):
            pieces[i]()
            a = layer.self_attn.attn
            out = self.backend.attend(s.q[:t], self.kv_caches[a.layer_idx], meta, a.scale,
                                      self._scales(a.layer_idx))
            s.attn[:t].copy_(out.reshape(t, -1))
        pieces[-1]()
        self.replays += 1
        return s.hidden[:t]
