"""Speculative decoding: proposers guess K tokens per request, the target scores them in one
forward, and rejection sampling keeps the tokens that preserve the target's distribution.

`photon.spec.config` (the --speculative-config argument), `photon.spec.proposer` (the interface
and registry), `photon.spec.ngram` / `photon.spec.draft_model` (the proposers) and
`photon.spec.rejection` (verification) are device-side building blocks: tensors in, tensors out,
no host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from photon.config import ConfigError

if TYPE_CHECKING:
    from photon.config import EngineConfig
    from photon.spec.ngram_host import HostNgram


def check_supported(config: EngineConfig) -> None:
    """Refuse an engine configuration the engine cannot run (ConfigError): the one place that
    decides which speculative configurations the engine accepts."""
    spec = config.speculative_config
    if spec is None:
        return
    tp = config.parallel.tensor_parallel_size
    if tp > 1:
        raise ConfigError(f"speculative_config (--speculative-config) is not supported with "
                          f"tensor_parallel_size (--tensor-parallel-size) > 1 yet (got {tp})")
    if spec.method not in ("ngram", "draft_model"):
        raise ConfigError(
            f"speculative_config (--speculative-config): method {spec.method!r} is not "
            f"available in this version of photon; supported: \"ngram\" (prompt lookup) and "
            f"\"draft_model\", e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}'")
    if spec.method == "draft_model":
        from photon.spec.draft_config import draft_model_config

        draft_model_config(config)  # the draft's directory and vocabulary, checked at start-up
    budget = config.scheduler.max_num_batched_tokens
    if budget < spec.k + 1:
        raise ConfigError(
            f"speculative_config (--speculative-config): num_speculative_tokens={spec.k} needs "
            f"max_num_batched_tokens (--max-num-batched-tokens) >= {spec.k + 1} (a speculative "
            f"row scores K + 1 positions), got {budget}")


def sampling_rows(config: EngineConfig) -> int:
    """The most sampling rows (and grammar mask rows) a step has: K + 1 per speculative row."""
    spec = config.speculative_config
    return config.scheduler.max_num_seqs * (1 + (spec.k if spec is not None else 0))


def grammar_drafter(config: EngineConfig) -> HostNgram | None:
    """The host's n-gram proposal when requests with structured outputs speculate: with the
    ngram method the host knows the drafts after each commit, so it fills a grammar mask for
    every verified position. None: they run plain rows (no speculation, or a draft model, whose
    drafts only the device knows)."""
    spec = config.speculative_config
    if spec is None or spec.method != "ngram":
        return None
    from photon.spec.ngram_host import HostNgram

    return HostNgram.of(spec, config.model.max_model_len)


__all__ = ["check_supported", "grammar_drafter", "sampling_rows"]
