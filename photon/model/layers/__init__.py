"""Building blocks shared by the model definitions."""

from __future__ import annotations

from photon.model.layers.activation import SiluAndMul
from photon.model.layers.attention import Attention
from photon.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from photon.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from photon.model.layers.norm import RMSNorm
from photon.model.layers.rotary import RotaryEmbedding, get_rope, rope_settings

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "get_rope",
    "rope_settings",
]
