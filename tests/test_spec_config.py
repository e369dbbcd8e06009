"""--speculative-config / LLM(speculative_config=...): parsing, vLLM's defaults, the errors."""

from __future__ import annotations

import argparse
import re

import pytest

from photon.cli import add_engine_args, engine_args_from
from photon.config import ConfigError
from photon.engine_args import EngineArgs
from photon.spec import check_supported
from photon.spec.config import SpeculativeConfig, parse_speculative_config


def test_ngram_defaults_follow_vllm() -> None:
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert cfg == SpeculativeConfig("ngram", 3, None, 5, 5)
    assert cfg is not None and cfg.k == 3
    only_max = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_max": 4})
    assert only_max is not None and (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_min": 2})
    assert only_min is not None and (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_json_string_dict_and_config_are_accepted() -> None:
    text = ('{"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}')
    want = SpeculativeConfig("draft_model", 4, "/models/draft")
    assert parse_speculative_config(text) == want
    assert parse_speculative_config(want) is want
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("values,method", [
    ({"model": "[ngram]", "num_speculative_tokens": 2}, "ngram"),
    ({"model": "ngram", "num_speculative_tokens": 2}, "ngram"),
    ({"model": "/models/draft", "num_speculative_tokens": 2}, "draft_model"),
    ({"method": "[ngram]", "num_speculative_tokens": 2}, "ngram"),
])
def test_method_is_inferred_as_vllm_does(values: dict, method: str) -> None:
    cfg = SpeculativeConfig.from_dict(values)
    assert cfg.method == method
    assert cfg.model == (None if method == "ngram" else values["model"])


@pytest.mark.parametrize("value,message", [
    ("{not json", "must be a JSON object such as"),
    ("[1, 2]", "must be a JSON object (a dict in Python)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "unknown key 'draft_tensor_parallel_size'; allowed keys: method, model, "
     "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 2},
     "method must be one of draft_model, ngram; got 'eagle'"),
    ({"method": 3, "num_speculative_tokens": 2}, "method must be one of draft_model, ngram"),
    ({"num_speculative_tokens": 2}, "method is required (one of draft_model, ngram)"),
    ({"method": "ngram"}, "num_speculative_tokens is required: an integer from 1 to 16"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "num_speculative_tokens must be an integer from 1 to 16, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "from 1 to 16, got 17"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "from 1 to 16, got '3'"),
    ({"method": "ngram", "num_speculative_tokens": True}, "from 1 to 16, got True"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "from 1 to 16, got 2.0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min must be an integer from 1 to 64, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 65},
     "prompt_lookup_max must be an integer from 1 to 64, got 65"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 3}, "prompt_lookup_min=4 must be <= prompt_lookup_max=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/models/draft"},
     "model is only read by method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "model is required by method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": " "},
     "model is required by method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 5},
     "model must be a string (a directory or hub id), got 5"),
    ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "prompt_lookup_max is only read by method ngram"),
])
def test_bad_values_name_the_field_and_what_is_allowed(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        parse_speculative_config(value)
    assert str(info.value).startswith("speculative_config (--speculative-config)")


def test_a_hand_built_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer"):
        SpeculativeConfig("ngram", 40)
    with pytest.raises(ConfigError, match="model is required by method draft_model"):
        SpeculativeConfig("draft_model", 2)


def _cli(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from(parser.parse_args(list(argv)))


def test_cli_flag_reaches_the_engine_config_check() -> None:
    args = _cli("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert args.speculative_config == '{"method": "ngram", "num_speculative_tokens": 3}'
    config = args._build_config()
    assert config.speculative_config == SpeculativeConfig("ngram", 3, None, 5, 5)
    assert _cli()._build_config().speculative_config is None
    check_supported(_cli()._build_config())  # no speculation: accepted


def test_the_engine_refuses_unsupported_speculation_in_one_place() -> None:
    config = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3}
                        ).create_config()
    assert config.speculative_config == SpeculativeConfig("ngram", 3, None, 5, 5)
    # draft_model is supported: its draft is checked at start-up
    with pytest.raises(ConfigError, match=re.escape(
            "speculative_config (--speculative-config): draft model 'x': model 'x'")):
        EngineArgs(speculative_config={"method": "draft_model", "model": "x",
                                       "num_speculative_tokens": 3}).create_config()
    with pytest.raises(ConfigError, match=re.escape(
            "num_speculative_tokens=5 needs max_num_batched_tokens (--max-num-batched-tokens) "
            ">= 6")):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 5},
                   max_num_batched_tokens=4, max_model_len=4).create_config()
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 99}
                   ).create_config()


def test_adaptive_is_photons_key_and_must_be_a_bool() -> None:
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}).adaptive
    off = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                    "adaptive": False})
    assert off.adaptive is False
    with pytest.raises(ConfigError, match="adaptive must be true or false, got 'no'"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "adaptive": "no"})
