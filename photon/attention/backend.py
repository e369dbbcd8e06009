"""Attention backend interface, per-step metadata and the backend registry.

KV cache layout (one tensor per layer, allocated by the model runner):
    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]; [0] = K, [1] = V.
An FP8 cache (float8_e4m3fn, --kv-cache-dtype fp8) comes with the layer's per-KV-head scales
(photon.attention.kv_quant): the backend stores x / scale saturated to e4m3 and reads c * scale.
A token's cache slot is `block_id * block_size + offset`; `slot_mapping` gives it for every token of
the step. A backend first writes the step's K/V into the cache at `slot_mapping`, then attends each
query token to every cached position of its sequence up to and including its own (causal).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from photon.attention.kv_quant import KVCacheScales, LayerKVScales
from photon.kernels import has_triton
from photon.registry import Registry


@dataclass
class AttentionMetadata:
    """One step's batch layout. Sequences are laid out back to back in token order.

    Device tensors are what kernels read. The `*_host` mirrors carry the same values as Python ints
    so that host-side code never reads a device tensor (that would be a hidden sync). In steps with
    speculative rows (`seq_lens_exact` False) the device resolves those rows' seq_lens: their
    host values are upper bounds, and kernels must read `seq_lens` (bounding loops with the host
    values only).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens_host: list[int]
    query_lens_host: list[int]
    decode_only: bool  # every sequence has exactly one query token
    seq_lens_exact: bool = True  # seq_lens_host equals seq_lens (else: upper bounds)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


@dataclass
class ForwardContext:
    """What the model's attention layers need for one forward; passed down explicitly."""

    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
    kv_scales: KVCacheScales | None = None  # an FP8 cache's scales; None: unquantized cache


class AttentionBackend(ABC):
    """A backend supplies three kernels; `forward` sequences them the same way for every backend:
    the step's K/V are written first, so attention reads them (and earlier chunks, prefix-cache
    hits) from the pages. `decode` must not read device values on the host (CUDA graphs)."""

    name: str = ""
    # Whether `prefill` may run inside a CUDA graph (speculative decode steps): it reads no
    # device value on the host, and of the host fields only `query_lens_host` (the longest query:
    # the grid) and the number of sequences, so a captured call passes static bounds
    # (`seq_lens_exact` False: the kernel reads `seq_lens` from the device).
    varlen_capturable: bool = False

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: LayerKVScales | None = None,  # required for an FP8 cache
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self.write_kv(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        return self.attend(q, kv_cache, metadata, scale, kv_scales)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, kv_scales: LayerKVScales | None = None) -> torch.Tensor:
        """`forward` once the step's K/V are in the cache: q [num_tokens, num_heads, head_dim]
        attends to the cached positions of its sequence."""
        if metadata.decode_only:
            return self.decode(q, kv_cache, metadata.block_tables, metadata.seq_lens, scale,
                               kv_scales)
        return self.prefill(q, kv_cache, metadata, scale, kv_scales)

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: LayerKVScales | None = None) -> None:
        """Store the step's K/V at their cache slots (FP8: x / scale, saturated)."""

    @abstractmethod
    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float,
               kv_scales: LayerKVScales | None = None) -> torch.Tensor:
        """One query token per sequence, attending to its first seq_len cached positions."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, kv_scales: LayerKVScales | None = None) -> torch.Tensor:
        """Varlen causal attention (prefill, chunked prefill, mixed batches) over the pages."""

    def supports(self, device: torch.device) -> bool:
        return True


# Imported lazily: optional backends (triton) cost nothing when unused.
ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend", lazy={
    "torch": "photon.attention.torch_ref:TorchReferenceBackend",
    "triton": "photon.attention.triton_paged:TritonPagedBackend",
})


def resolve_backend_name(name: str, device: str) -> str:
    """`auto` -> triton on CUDA when triton imports, else torch; other names are checked."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") and has_triton() else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ATTENTION_BACKENDS.unknown(name, also=("auto",))
    return name


def create_backend(name: str, device: str) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(resolve_backend_name(name, device))()
