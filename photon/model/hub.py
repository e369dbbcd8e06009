"""Hugging Face hub model ids (`Qwen/Qwen3-0.6B`): resolved to a local snapshot directory.

`huggingface_hub.snapshot_download` does the work: it downloads what is missing when the hub can be
reached and falls back to the local cache when it cannot; `HF_HUB_OFFLINE=1` (read when a model is
resolved, not at import) means the cache only. Only the files photon's loader reads are fetched:
the top-level safetensors weights, JSON files (config, tokenizer, generation config, index) and
Jinja chat templates; pickle checkpoints (`*.bin`, `*.pt`) never are.
"""

from __future__ import annotations

import os

from photon.config import ConfigError

ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.jinja"]
# The loader reads only the top-level folder; Mistral's native `consolidated.safetensors` repeats
# the weights of the Hugging Face shards under other names.
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]
_TRUE = ("1", "on", "yes", "true")


def is_repo_id(name: str) -> bool:
    """True when `name` is spelled like a hub id (`org/name` or `name`), not like a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but read now (it reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return value.strip().lower() in _TRUE if value is not None else bool(constants.HF_HUB_OFFLINE)


def download_model(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The local snapshot directory of `repo_id` at `revision` (default `main`), downloading the
    loader's files when they are not cached. Every failure is a one-line ConfigError."""
    from huggingface_hub import constants, snapshot_download

    revision = revision or constants.DEFAULT_REVISION
    cache_dir = os.path.abspath(os.path.expanduser(download_dir or constants.HF_HUB_CACHE))
    offline = hub_offline()
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                 local_files_only=offline)
    except Exception as e:  # noqa: BLE001 - every hub/network/disk failure becomes one line
        raise ConfigError(_failure(e, repo_id, revision, cache_dir, offline)) from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model {repo_id!r} (revision {revision!r}) has no config.json "
                          f"(snapshot at {path})")
    return path


def _failure(error: Exception, repo_id: str, revision: str, cache_dir: str,
             offline: bool) -> str:
    """What went wrong, in one line: which id, which revision, where the cache is, and why."""
    from huggingface_hub import errors
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"model {repo_id!r} (revision {revision!r})"
    # Newer huggingface_hub versions refuse a cached snapshot known to be partial.
    if isinstance(error, getattr(errors, "IncompleteSnapshotError", ())):
        return f"{what}: the cached copy in {cache_dir} is incomplete and cannot be completed " \
               f"now: {_one_line(error)}"
    if isinstance(error, LocalEntryNotFoundError):
        why = ("HF_HUB_OFFLINE is set" if offline else
               f"the Hugging Face hub could not be reached ({_one_line(error.__cause__)})")
        return (f"{what} is not a local directory and is not in the Hugging Face cache at "
                f"{cache_dir}, and {why}")
    if isinstance(error, GatedRepoError):
        return f"{what} is gated on the Hugging Face hub: accept its terms on huggingface.co " \
               f"and set HF_TOKEN"
    if isinstance(error, RevisionNotFoundError):
        return f"{what}: the Hugging Face hub has no revision {revision!r} of it"
    if isinstance(error, RepositoryNotFoundError):
        return (f"{what} is neither a local directory nor a model on the Hugging Face hub (a "
                f"private model needs HF_TOKEN)")
    return f"{what}: could not download it to {cache_dir}: {_one_line(error)}"


def _one_line(error: BaseException | None) -> str:
    if error is None:
        return "no further detail"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
