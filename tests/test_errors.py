"""Every bad input gets a clear error: ValueError/ConfigError/TypeError from the Python API, and
exit code 2 with the same message (and no traceback) from the CLI."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from photon import LLM, SamplingParams
from photon.cli import main
from photon.config import ConfigError
from photon.errors import ParamError
from photon.model.tiny import ensure_photon_tiny_random

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
             "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
VOCAB = 1024  # photon-tiny's vocab_size (tokenizer padded to a multiple of 64)
MAX_POS = 4096  # photon-tiny's max_position_embeddings


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("photon-tiny-random", max_model_len=32)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run `photon generate ...` in-process; return (exit code, stderr).

    --max-model-len 64 keeps the CPU KV cache small (fast); a later flag in `args` overrides it.
    """
    code = main(["generate", "--no-progress", "--model", "photon-tiny-random", "--max-tokens", "2",
                 "--max-model-len", "64", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, err = run_cli(capsys, *args)
    assert code == 2, err
    assert "photon generate: error: " in err
    return err


def copy_tiny(tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(ensure_photon_tiny_random(), dst)
    return dst


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# ---- model directory --------------------------------------------------------------------------

def test_missing_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=re.escape(f"model directory {missing!r} does not exist")):
        LLM(missing)
    err = cli_error(capsys, "--model", missing, "hi")
    assert f"model directory {missing!r} does not exist" in err


def test_directory_without_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = copy_tiny(tmp_path)
    (model / "config.json").unlink()
    msg = f"model directory {str(model)!r} has no config.json"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        LLM(str(model))
    assert msg in cli_error(capsys, "--model", str(model), "hi")


def test_directory_without_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = copy_tiny(tmp_path)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"not loaded")
    msg = f"model directory {str(model)!r} has no *.safetensors files"
    with pytest.raises(ConfigError, match=re.escape(msg)) as info:
        LLM(str(model))
    assert ".bin/.pt pickle checkpoints are not loaded" in str(info.value)
    err = cli_error(capsys, "--model", str(model), "hi")
    assert msg in err and ".bin/.pt pickle checkpoints are not loaded" in err


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = copy_tiny(tmp_path)
    edit_config(model, architectures=["GPT2LMHeadModel"])
    msg = f"unsupported architecture ['GPT2LMHeadModel']; supported: {', '.join(SUPPORTED)}"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        LLM(str(model))
    assert msg in cli_error(capsys, "--model", str(model), "hi")


def test_config_json_not_an_object_or_missing_fields(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = copy_tiny(tmp_path)
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object, got list"):
        LLM(str(model))
    del cfg["vocab_size"]
    cfg_path.write_text(json.dumps(cfg))
    msg = f"{cfg_path} lacks integer fields vocab_size"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        LLM(str(model))
    assert msg in cli_error(capsys, "--model", str(model), "hi")


def test_corrupt_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = copy_tiny(tmp_path)
    (model / "model.safetensors").write_bytes(b"garbage")
    msg = f"{model / 'model.safetensors'} is not a readable safetensors file"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        LLM(str(model))
    assert msg in cli_error(capsys, "--model", str(model), "hi")


# ---- prompts ----------------------------------------------------------------------------------

def test_prompt_longer_than_max_model_len(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    msg = "prompt is 40 tokens long, but max_model_len is 32"
    with pytest.raises(ValueError, match=msg):
        llm.generate([7] * 40, SamplingParams(max_tokens=2), use_tqdm=False)
    text = "hello world " * 30
    n = len(llm.get_tokenizer().encode(text))
    assert n > 32
    err = cli_error(capsys, "--max-model-len", "32", text)
    assert f"prompt is {n} tokens long, but max_model_len is 32" in err


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 5000])
def test_prompt_token_ids_outside_vocabulary(llm: LLM, bad: int) -> None:
    msg = re.escape(f"prompt token ids [{bad}] are outside the vocabulary [0, {VOCAB})")
    with pytest.raises(ValueError, match=msg):
        llm.generate([1, 2, bad, 3], SamplingParams(max_tokens=2), use_tqdm=False)


def test_empty_prompt(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    msg = "the prompt is empty; give at least one token"
    with pytest.raises(ValueError, match=msg):
        llm.generate([[]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert msg in cli_error(capsys, "")


def test_stop_token_ids_outside_vocabulary(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(
            f"stop_token_ids [{VOCAB}] are outside the vocabulary [0, {VOCAB})")):
        llm.generate("hi", SamplingParams(stop_token_ids=[5, VOCAB]), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape(
            "stop_token_ids must be non-negative integers, got [-1]")):
        SamplingParams(stop_token_ids=[-1])
    err = cli_error(capsys, "hi", "--stop-token-ids", str(VOCAB + 1))
    assert f"stop_token_ids [{VOCAB + 1}] are outside the vocabulary [0, {VOCAB})" in err
    err = cli_error(capsys, "hi", "--stop-token-ids", "-1")
    assert "stop_token_ids must be non-negative integers, got [-1]" in err


# ---- sampling params --------------------------------------------------------------------------

# (SamplingParams kwargs, the same as CLI flags, expected message)
BAD_SAMPLING: list[tuple[dict[str, Any], list[str], str]] = [
    ({"temperature": -1}, ["--temperature", "-1"],
     "temperature must be a number in [0, 100] (0 = greedy), got -1"),
    ({"temperature": float("inf")}, ["--temperature", "inf"],
     "temperature must be a number in [0, 100] (0 = greedy), got inf"),
    ({"top_p": 0}, ["--top-p", "0"], "top_p must be a number in (0, 1], got 0"),
    ({"top_p": 1.5}, ["--top-p", "1.5"], "top_p must be a number in (0, 1], got 1.5"),
    ({"top_k": -5}, ["--top-k", "-5"],
     "top_k must be -1 or 0 (disabled) or an integer >= 1, got -5"),
    ({"min_p": 2}, ["--min-p", "2"], "min_p must be a number in [0, 1], got 2"),
    ({"n": 0}, ["--n", "0"], "n must be an integer >= 1, got 0"),
    ({"max_tokens": 0}, ["--max-tokens", "0"],
     "max_tokens must be an integer >= 1 or None, got 0"),
    ({"min_tokens": 5, "max_tokens": 3}, ["--min-tokens", "5", "--max-tokens", "3"],
     "min_tokens (5) must be <= max_tokens (3)"),
    ({"presence_penalty": 3}, ["--presence-penalty", "3"],
     "presence_penalty must be a number in [-2, 2], got 3"),
    ({"frequency_penalty": -2.5}, ["--frequency-penalty", "-2.5"],
     "frequency_penalty must be a number in [-2, 2], got -2.5"),
    ({"repetition_penalty": 0}, ["--repetition-penalty", "0"],
     "repetition_penalty must be a number in [0.01, 100] (1 = off; "),
    ({"repetition_penalty": 1e-45}, ["--repetition-penalty", "1e-45"],
     "repetition_penalty must be a number in [0.01, 100] (1 = off; repeated tokens' logits are "
     "divided or multiplied by it, so values further from 1 overflow or erase them), got 1e-45"),
    ({"logprobs": 21}, ["--logprobs", "21"],
     "logprobs must be an integer in [0, 20] or None, got 21"),
    ({"stop": ""}, ["--stop", ""],
     "stop must be a non-empty string or a list of non-empty strings, got ['']"),
]


@pytest.mark.parametrize(("kwargs", "cli_args", "msg"), BAD_SAMPLING,
                         ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))
                              for k, _, _ in BAD_SAMPLING])
def test_invalid_sampling_params(kwargs: dict[str, Any], cli_args: list[str], msg: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ParamError, match=re.escape(msg)) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs))
    assert msg in cli_error(capsys, "hi", *cli_args)


# (field, value, start of the message): every numeric field is bounded, so that an accepted value
# always fits the engine's int64 / float32 sampling inputs.
OUT_OF_RANGE: list[tuple[str, Any, str]] = [
    ("temperature", 1e308, "temperature must be a number in [0, 100]"),
    ("temperature", float("nan"), "temperature must be a number in [0, 100]"),
    ("temperature", 10**400, "temperature must be a number in [0, 100]"),
    ("top_p", float("nan"), "top_p must be a number in (0, 1]"),
    ("min_p", float("-inf"), "min_p must be a number in [0, 1]"),
    ("presence_penalty", float("nan"), "presence_penalty must be a number in [-2, 2]"),
    ("repetition_penalty", float("inf"), "repetition_penalty must be a number in [0.01, 100]"),
    ("repetition_penalty", 101, "repetition_penalty must be a number in [0.01, 100]"),
    ("top_k", 2.5, "top_k must be -1 or 0 (disabled) or an integer >= 1"),
    ("top_k", True, "top_k must be -1 or 0 (disabled) or an integer >= 1"),
    ("seed", 2**64, "seed must be an integer in [-2**63, 2**64 - 1] or None, got 18446744073709551616"),
    ("seed", -(2**63) - 1, "seed must be an integer in [-2**63, 2**64 - 1]"),
    ("seed", 1.5, "seed must be an integer in [-2**63, 2**64 - 1]"),
    ("n", 1.0, "n must be an integer >= 1"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("logprobs", 2**63, "logprobs must be an integer in [0, 20] or None"),
    ("stop_token_ids", [2**63], None),  # fine here; outside the vocabulary at add_request
]


@pytest.mark.parametrize(("field", "value", "msg"), OUT_OF_RANGE,
                         ids=[f"{f}={v!r:.20}" for f, v, _ in OUT_OF_RANGE])
def test_sampling_values_out_of_range_name_the_field(llm: LLM, field: str, value: Any,
                                                     msg: str | None) -> None:
    with pytest.raises(ParamError) as e:
        llm.generate("hi", SamplingParams(**{field: value}), use_tqdm=False)
    assert e.value.param == field
    assert msg is None or str(e.value).startswith(msg), str(e.value)
    llm.engine.assert_drained()


def test_sampling_values_at_their_limits_are_accepted(llm: LLM) -> None:
    """The bounds are inclusive where documented; seeds use all 64 bits (signed or unsigned:
    -1 and 2**64 - 1 are the same seed)."""
    edge = [SamplingParams(temperature=100, top_p=1e-9, min_p=1, presence_penalty=-2,
                           frequency_penalty=2, repetition_penalty=0.01, logprobs=20, seed=0),
            SamplingParams(temperature=1e-300, repetition_penalty=100, seed=-(2**63)),
            SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=6),
            SamplingParams(temperature=1.0, seed=-1, max_tokens=6)]
    outs = llm.generate(["hi"] * len(edge), edge, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    assert outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids
    llm.engine.assert_drained()


# ---- engine args ------------------------------------------------------------------------------

BAD_ENGINE: list[tuple[dict[str, Any], list[str], str]] = [
    ({"max_num_seqs": 0}, ["--max-num-seqs", "0"], "max_num_seqs must be a positive integer, got 0"),
    ({"max_num_batched_tokens": 0}, ["--max-num-batched-tokens", "0"],
     "max_num_batched_tokens must be a positive integer, got 0"),
    ({"block_size": -1}, ["--block-size", "-1"], "block_size must be a positive integer, got -1"),
    ({"dtype": "int8"}, ["--dtype", "int8"],
     "dtype must be one of auto, float32, float, bfloat16, float16, half; got 'int8'"),
    ({"device": "tpu"}, ["--device", "tpu"], "device must be one of auto, cuda, cpu; got 'tpu'"),
    ({"gpu_memory_utilization": 1.5}, ["--gpu-memory-utilization", "1.5"],
     "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"max_model_len": MAX_POS + 1}, ["--max-model-len", str(MAX_POS + 1)],
     f"max_model_len={MAX_POS + 1} is larger than the model's max_position_embeddings={MAX_POS}"),
    ({"max_model_len": 0}, ["--max-model-len", "0"],
     "max_model_len must be a positive integer, got 0"),
    ({"num_gpu_blocks_override": 0}, ["--num-gpu-blocks-override", "0"],
     "num_gpu_blocks_override must be a positive integer, got 0"),
    ({"structured_outputs_threads": 0}, ["--structured-outputs-threads", "0"],
     "structured_outputs_threads must be a positive integer, got 0"),
    ({"structured_outputs_worker": "thread"}, ["--structured-outputs-worker", "thread"],
     "structured_outputs_worker must be one of process, inline; got 'thread'"),
    ({"structured_outputs_mask_wait": "gpu"}, ["--structured-outputs-mask-wait", "gpu"],
     "structured_outputs_mask_wait must be one of device, host; got 'gpu'"),
    ({"attention_backend": "nope"}, ["--attention-backend", "nope"],
     "attention_backend: unknown attention backend 'nope'; available: auto, torch, triton"),
]


@pytest.mark.parametrize(("kwargs", "cli_args", "msg"), BAD_ENGINE,
                         ids=[next(iter(k)) for k, _, _ in BAD_ENGINE])
def test_invalid_engine_args(kwargs: dict[str, Any], cli_args: list[str], msg: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(msg)):
        LLM("photon-tiny-random", **kwargs)
    assert msg in cli_error(capsys, "hi", *cli_args)


def test_unknown_engine_kwarg(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TypeError, match=re.escape("unknown engine arguments ['max_num_seq']")) as e:
        LLM("photon-tiny-random", max_num_seq=4)
    assert "valid: model, dtype, max_model_len, max_num_seqs," in str(e.value)
    # The CLI rejects an unknown flag in argparse (usage error, exit code 2).
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--max-num-sequences", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-num-sequences 4" in err
    assert "Traceback" not in err


# ---- KV cache capacity ------------------------------------------------------------------------

def test_kv_cache_smaller_than_one_request_refuses_to_start(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A cache that cannot hold one max_model_len request refuses to start, giving both numbers
    and what to change, instead of starting and then failing every long request."""
    msg = ("the KV cache has 40 blocks of 16 tokens (640 tokens), but one request of "
           f"max_model_len={MAX_POS} tokens needs {MAX_POS // 16} blocks; raise "
           "num_gpu_blocks_override (--num-gpu-blocks-override), or lower max_model_len "
           "(--max-model-len) to at most 640")
    with pytest.raises(ConfigError, match=re.escape(msg)):
        LLM("photon-tiny-random", num_gpu_blocks_override=40, block_size=16)
    err = cli_error(capsys, "--num-gpu-blocks-override", "2", "--block-size", "16", "hi")
    assert ("the KV cache has 2 blocks of 16 tokens (32 tokens), but one request of "
            "max_model_len=64 tokens needs 4 blocks") in err
    with pytest.raises(ConfigError, match=re.escape(
            "raise kv_cache_memory_bytes (--kv-cache-memory-bytes)")):
        LLM("photon-tiny-random", kv_cache_memory_bytes=1, block_size=16)
    # At the limit it starts, and a max_model_len request runs.
    llm = LLM("photon-tiny-random", num_gpu_blocks_override=2, block_size=16, max_model_len=32)
    out = llm.generate([5] * 10, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 22
    llm.engine.assert_drained()


# ---- the engine survives bad requests ---------------------------------------------------------

def test_engine_survives_bad_request_in_batch(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    expected = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(expected) == 4
    batches: list[list[Any]] = [
        [[1, 2, 3], [4, 5, VOCAB]],  # second prompt has an out-of-vocabulary id
        [[1, 2, 3], [9] * 40],  # second prompt is longer than max_model_len=32
        [[1, 2, 3], []],  # second prompt is empty
    ]
    for batch in batches:
        with pytest.raises(ValueError):
            llm.generate(batch, greedy, use_tqdm=False)
        llm.engine.assert_drained()
        assert llm.engine.parents == {}  # the aborted good prompt is not left behind
        outs = llm.generate([[1, 2, 3], "hello"], greedy, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
        assert outs[0].outputs[0].token_ids == expected
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        llm.engine.assert_drained()
        assert llm.engine.parents == {}
    with pytest.raises(ValueError, match="got 3 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [greedy] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="each prompt must be a string or a list of token ids"):
        llm.generate(["a", 3.5], greedy, use_tqdm=False)  # type: ignore[list-item]
    assert llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    llm.engine.assert_drained()
