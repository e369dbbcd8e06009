"""Hugging Face hub ids resolved from a hub cache laid out on disk, offline (never the network).

The cache is written in huggingface_hub's own layout (`models--org--name/blobs/<hash>`,
`snapshots/<commit>/<file>` links to the blobs, `refs/<branch>` holding a commit), and is read
through the real `snapshot_download` with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest

from photon import LLM, SamplingParams
from photon.cli import main
from photon.config import ConfigError
from photon.engine_args import EngineArgs
from photon.model import hub
from photon.server.launch import with_model_tag
from tests.hf_models import make_engine_model

REPO = "photon-test/tiny-qwen3"
COMMIT_MAIN = "a" * 40
COMMIT_V2 = "b" * 40
PROMPT = [5, 17, 42, 99, 7]


def add_snapshot(cache: Path, repo_id: str, commit: str, model_dir: Path,
                 refs: tuple[str, ...] = ()) -> Path:
    """Put `model_dir`'s files into the cache as revision `commit` (and the branches `refs`)."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for src in sorted(model_dir.iterdir()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / src.name)
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny Qwen3 checkpoints (different weights) and a hub cache holding them: `main` is
    the first, the tag `v2` the second."""
    root = tmp_path_factory.mktemp("hub")
    first, second = root / "first", root / "second"
    for path, seed in ((first, 0), (second, 1)):
        make_engine_model(str(path), "Qwen3ForCausalLM", hidden_size=32, num_layers=1,
                          seed=seed)
    cache = root / "cache"
    add_snapshot(cache, REPO, COMMIT_MAIN, first, refs=("main",))
    add_snapshot(cache, REPO, COMMIT_V2, second, refs=("v2",))
    return {"first": first, "second": second, "cache": cache}


def greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def model_dir(models: dict[str, Path], **args: object) -> str:
    return EngineArgs(model=REPO, download_dir=str(models["cache"]), **args).create_config() \
        .model.model


def test_hub_id_loads_from_the_cache_like_its_directory(models: dict[str, Path]) -> None:
    by_id = LLM(REPO, download_dir=str(models["cache"]), max_model_len=64)
    assert by_id.config.model.model.endswith(os.path.join("snapshots", COMMIT_MAIN))
    assert by_id.config.model.served_model_name == REPO  # not the snapshot's hash
    by_dir = LLM(str(models["first"]), max_model_len=64)
    assert greedy(by_id) == greedy(by_dir)


def test_revision_picks_the_snapshot(models: dict[str, Path]) -> None:
    assert model_dir(models).endswith(COMMIT_MAIN)
    assert model_dir(models, revision="main").endswith(COMMIT_MAIN)
    assert model_dir(models, revision="v2").endswith(COMMIT_V2)  # a tag, through refs/
    assert model_dir(models, revision=COMMIT_V2).endswith(COMMIT_V2)  # a commit
    by_tag = LLM(REPO, revision="v2", download_dir=str(models["cache"]), max_model_len=64)
    assert greedy(by_tag) == greedy(LLM(str(models["second"]), max_model_len=64))
    assert greedy(by_tag) != greedy(LLM(str(models["first"]), max_model_len=64))


def offline_message(repo: str, revision: str, cache: Path) -> str:
    return (f"model {repo!r} (revision {revision!r}) is not a local directory and is not in the "
            f"Hugging Face cache at {cache}, and HF_HUB_OFFLINE is set")


def test_offline_without_a_cached_copy_says_so(tmp_path: Path, models: dict[str, Path],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-cache"
    with pytest.raises(ConfigError, match=re.escape(offline_message(REPO, "main", empty))):
        EngineArgs(model=REPO, download_dir=str(empty)).create_config()
    # Cached, but not at this revision.
    with pytest.raises(ConfigError,
                       match=re.escape(offline_message(REPO, "v3", models["cache"]))):
        model_dir(models, revision="v3")
    code = main(["generate", "--model", "org/absent", "--download-dir", str(empty), "hi"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"photon generate: error: {offline_message('org/absent', 'main', empty)}\n"


def test_serve_takes_the_model_positionally(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-cache"
    code = main(["serve", "org/absent", "--download-dir", str(empty), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"photon serve: error: {offline_message('org/absent', 'main', empty)}\n"
    code = main(["serve", "org/a", "--model", "org/b"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "the model is given twice, as MODEL 'org/a' and as --model 'org/b'" in err


def test_positional_and_flag_model() -> None:
    ns = argparse.Namespace(model_tag="org/a", model=None)
    assert with_model_tag(ns).model == "org/a"
    assert with_model_tag(argparse.Namespace(model_tag="org/a", model="org/a")).model == "org/a"
    assert with_model_tag(argparse.Namespace(model_tag=None, model="org/b")).model == "org/b"


def test_paths_are_not_hub_ids(tmp_path: Path) -> None:
    """A missing path keeps the directory error (no hub lookup); a name spelled like an id is
    looked up."""
    missing = str(tmp_path / "no-such-model")
    assert not hub.is_repo_id(missing) and not hub.is_repo_id("./model")
    assert not hub.is_repo_id("a/b/c") and hub.is_repo_id("Qwen/Qwen3-0.6B")
    with pytest.raises(ConfigError, match=re.escape(f"model directory {missing!r} does not exist")):
        EngineArgs(model=missing).create_config()


def test_only_the_loaders_files_are_fetched() -> None:
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "chat_template.jinja",
            "model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "consolidated.safetensors",
            "pytorch_model.bin", "model.pt", "original/consolidated.00.pth",
            "original/params.json", "onnx/model.onnx", "README.md", ".gitattributes"]
    fetched = set(filter_repo_objects(repo, allow_patterns=hub.ALLOW_PATTERNS,
                                      ignore_patterns=hub.IGNORE_PATTERNS))
    assert fetched == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "vocab.json", "chat_template.jinja",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors"}


def test_download_arguments_and_unreachable_hub(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """Online (HF_HUB_OFFLINE unset) the hub is asked with the loader's patterns; when it cannot
    be reached and nothing is cached, the error says so. snapshot_download is replaced: no
    network."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls: list[dict[str, object]] = []

    def unreachable(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        raise LocalEntryNotFoundError("not cached") from httpx.ConnectError("connection refused")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ConfigError) as info:
        hub.download_model("org/x", "dev", str(tmp_path))
    assert str(info.value) == (
        f"model 'org/x' (revision 'dev') is not a local directory and is not in the Hugging Face "
        f"cache at {tmp_path}, and the Hugging Face hub could not be reached (ConnectError: "
        f"connection refused)")
    assert calls == [{"repo_id": "org/x", "revision": "dev", "cache_dir": str(tmp_path),
                      "allow_patterns": hub.ALLOW_PATTERNS,
                      "ignore_patterns": hub.IGNORE_PATTERNS, "local_files_only": False}]


def test_snapshot_without_config_json(tmp_path: Path, models: dict[str, Path]) -> None:
    weights_only = tmp_path / "weights-only"
    shutil.copytree(models["first"], weights_only)
    (weights_only / "config.json").unlink()
    cache = tmp_path / "cache"
    add_snapshot(cache, "org/weights-only", COMMIT_MAIN, weights_only, refs=("main",))
    with pytest.raises(ConfigError, match=r"model 'org/weights-only' \(revision 'main'\) has no "
                                          r"config\.json"):
        EngineArgs(model="org/weights-only", download_dir=str(cache)).create_config()
