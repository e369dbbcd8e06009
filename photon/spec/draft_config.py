"""The draft model of method draft_model: its directory resolved, checked against the target, and
described as a `ModelConfig` the normal loader builds (same device, dtype, seed and kernels as
the target's).

A draft must share the target's vocabulary: verification compares its token ids with the
target's, so both config.json files must give the same vocab_size, and when the draft directory
has a tokenizer.json it must map every token to the same id as the target's (a draft directory
without one is taken to use the target's tokenizer).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from photon.config import ConfigError, EngineConfig, ModelConfig

if TYPE_CHECKING:
    from photon.quant.config import QuantConfig

FLAG = "speculative_config (--speculative-config)"


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """The draft's ModelConfig (ConfigError: the draft cannot serve this target)."""
    from photon.model.hf_config import architecture, check_required_fields, load_hf_config
    from photon.model.tiny import resolve_model_path

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    target = config.model
    try:
        model_dir = resolve_model_path(spec.model)
        hf_config = load_hf_config(model_dir)
        check_required_fields(hf_config, model_dir)
        arch = architecture(hf_config)
    except ConfigError as e:
        raise ConfigError(f"{FLAG}: draft model {spec.model!r}: {e}") from None
    _check_vocab(target, hf_config, model_dir)
    _check_positions(target, hf_config)
    return replace(target, model=model_dir, hf_config=hf_config, architecture=arch,
                   served_model_name=os.path.basename(model_dir.rstrip("/")),
                   generation_defaults=None, quant_config=_draft_quant(config, hf_config, arch))


def _draft_quant(config: EngineConfig, hf_config: dict, arch: str) -> QuantConfig | None:
    """The draft is quantized only as its own checkpoint says (--quantization is the
    target's)."""
    from photon.quant.config import resolve_quant_config

    try:
        return resolve_quant_config(None, hf_config, arch, config.device,
                                    config.model.use_triton)
    except ConfigError as e:
        raise ConfigError(f"{FLAG}: draft model: {e}") from None


def _check_vocab(target: ModelConfig, hf_config: dict, model_dir: str) -> None:
    draft_vocab = int(hf_config["vocab_size"])
    if draft_vocab != target.vocab_size:
        raise ConfigError(
            f"{FLAG}: the draft model {model_dir!r} has vocab_size {draft_vocab}, the target "
            f"{target.vocab_size}; a draft model must share the target's tokenizer and "
            f"vocabulary (the same vocab_size and token ids)")
    difference = _tokenizer_difference(target.model, model_dir)
    if difference is not None:
        raise ConfigError(
            f"{FLAG}: the draft model {model_dir!r} has a different tokenizer than the target "
            f"({difference}); a draft model must share the target's tokenizer (the same "
            f"token ids), or have no tokenizer.json of its own")


def _tokenizer_difference(target_dir: str, draft_dir: str) -> str | None:
    """How the two directories' tokenizers differ (None: the same token -> id map, or the draft
    has no tokenizer.json)."""
    from tokenizers import Tokenizer

    paths = [os.path.join(d, "tokenizer.json") for d in (target_dir, draft_dir)]
    if not all(os.path.isfile(p) for p in paths):
        return None
    target, draft = (Tokenizer.from_file(p).get_vocab(with_added_tokens=True) for p in paths)
    if len(target) != len(draft):
        return f"{len(draft)} tokens, the target's has {len(target)}"
    for token, i in sorted(target.items(), key=lambda item: item[1]):
        if draft.get(token) != i:
            return f"token {token!r} is id {i} in the target's, {draft.get(token)} in the draft's"
    return None


def _check_positions(target: ModelConfig, hf_config: dict) -> None:
    limit = hf_config.get("max_position_embeddings")
    if isinstance(limit, int) and limit < target.max_model_len:
        raise ConfigError(
            f"{FLAG}: the draft model supports {limit} positions (max_position_embeddings), "
            f"fewer than max_model_len={target.max_model_len}; lower max_model_len "
            f"(--max-model-len) to at most {limit} or use a draft with a longer context")
