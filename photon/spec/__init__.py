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


def check_supported(config: EngineConfig) -> None:
    """Refuse an engine configuration the engine cannot run (ConfigError): the one place that
    decides which speculative configurations the engine accepts."""
    if config.speculative_config is not None:
        raise ConfigError(
            "speculative_config (--speculative-config): speculative decoding is not available "
            "in this version of photon; start the engine without speculative_config")


__all__ = ["check_supported"]
