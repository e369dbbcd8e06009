"""The frozen configuration: each setting stored once, checked once, read from the environment only
by `EngineArgs.create_config` (never at import), and every registry in one style."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

import photon.kernels
from photon.config import ConfigError, SchedulerConfig, StructuredOutputsConfig
from photon.engine_args import EngineArgs, resolve_use_triton
from photon.registry import Registry

# ---------------------------------------------------------------------------- one place each


def test_max_model_len_is_stored_once() -> None:
    assert "max_model_len" not in {f.name for f in dataclasses.fields(SchedulerConfig)}
    config = EngineArgs(max_model_len=48).create_config()
    assert config.model.max_model_len == 48


def test_structured_outputs_config_carries_the_engine_arguments() -> None:
    args = EngineArgs(structured_outputs_timeout=7, structured_outputs_threads=3,
                      structured_outputs_worker="inline", structured_outputs_mask_wait="host",
                      structured_outputs_max_chars=9, structured_outputs_max_choices=2,
                      structured_outputs_cache_mb=5)
    config = args.create_config().structured_outputs
    assert config == StructuredOutputsConfig(backend="xgrammar", timeout_s=7.0, threads=3,
                                             worker="inline", mask_wait="host", max_chars=9,
                                             max_choices=2, cache_mb=5)
    assert isinstance(config.timeout_s, float)
    assert (config.cache_bytes, config.limits.max_chars, config.limits.max_choices) == (5 << 20, 9, 2)
    # The defaults are the engine arguments' and nothing else's (the grammar worker process).
    assert EngineArgs().structured_outputs_config().worker == "process"
    assert not any(f.default is not dataclasses.MISSING
                   for f in dataclasses.fields(StructuredOutputsConfig))


@pytest.mark.parametrize(("field", "value", "msg"), [
    ("backend", "outlines",
     "structured_outputs_backend: unknown structured outputs backend 'outlines'; available: "
     "xgrammar"),
    ("timeout_s", 0, "structured_outputs_timeout must be a number of seconds > 0, got 0"),
    ("timeout_s", True, "structured_outputs_timeout must be a number of seconds > 0, got True"),
    ("threads", 0, "structured_outputs_threads must be a positive integer, got 0"),
    ("worker", "thread", "structured_outputs_worker must be one of process, inline; got 'thread'"),
    ("cache_mb", -1, "structured_outputs_cache_mb must be an integer >= 0, got -1"),
])
def test_a_hand_built_structured_outputs_config_is_checked(field: str, value: object,
                                                           msg: str) -> None:
    good = dataclasses.asdict(EngineArgs().structured_outputs_config())
    with pytest.raises(ConfigError, match=re.escape(msg)):
        StructuredOutputsConfig(**{**good, field: value})


def test_an_unknown_grammar_backend_fails_at_startup() -> None:
    """Checked by create_config, not when the first grammar request arrives."""
    with pytest.raises(ConfigError, match="unknown structured outputs backend 'outlines'"):
        EngineArgs(structured_outputs_backend="outlines").create_config()


def test_attention_backend_is_resolved_once() -> None:
    assert EngineArgs(device="cpu").create_config().attention_backend == "torch"
    with pytest.raises(ConfigError, match=re.escape(
            "attention_backend: unknown attention backend 'flash'; available: auto, torch, "
            "triton")):
        EngineArgs(attention_backend="flash").create_config()


# ---------------------------------------------------------------------------- Triton switch


def test_importing_photon_reads_no_triton_setting() -> None:
    """No module branches on triton at import: the kernel modules (and triton) are imported only
    for a model built with use_triton or a fused sampler call."""
    code = ("import sys, photon, photon.llm, photon.kernels, photon.model.layers, "
            "photon.worker.sampler, photon.attention.backend, photon.engine.engine_core\n"
            "assert not hasattr(photon.kernels, 'USE_TRITON')\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('photon.kernels.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture
def cuda_with_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """create_config as on a CUDA machine with triton (nothing here touches a device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(photon.kernels, "has_triton", lambda: True)


def test_photon_triton_is_read_by_create_config(cuda_with_triton: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment as it is when the engine is configured counts, not as it was when photon
    was imported (this module imported photon.kernels before the variable changes)."""
    monkeypatch.setenv("PHOTON_TRITON", "0")
    assert EngineArgs(device="cuda").create_config().model.use_triton is False
    monkeypatch.setenv("PHOTON_TRITON", "1")
    assert EngineArgs(device="cuda").create_config().model.use_triton is True
    monkeypatch.delenv("PHOTON_TRITON")
    assert EngineArgs(device="cuda").create_config().model.use_triton is True


def test_triton_kernels_only_on_cuda_with_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHOTON_TRITON", raising=False)
    monkeypatch.setattr(photon.kernels, "has_triton", lambda: True)
    assert (resolve_use_triton("cuda"), resolve_use_triton("cpu")) == (True, False)
    monkeypatch.setattr(photon.kernels, "has_triton", lambda: False)
    assert resolve_use_triton("cuda") is False
    assert EngineArgs(device="cpu").create_config().model.use_triton is False


# ---------------------------------------------------------------------------- registries


def test_registry_lazy_entries_import_on_first_get() -> None:
    reg: Registry[type] = Registry("widget", lazy={"ordered": "collections:OrderedDict"})

    @reg.register("plain")
    class Plain:
        pass

    assert reg.names() == ["ordered", "plain"] and "ordered" in reg and "other" not in reg
    assert reg.get("ordered") is OrderedDict and reg.get("plain") is Plain
    assert Plain.name == "plain"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=re.escape(
            "unknown widget 'other'; available: ordered, plain")):
        reg.get("other")
    assert str(reg.unknown("x", also=("auto",))) == \
        "unknown widget 'x'; available: auto, ordered, plain"
    with pytest.raises(ValueError, match="target must be 'module:Class'"):
        reg.register_lazy("bad", "collections.OrderedDict")


def test_model_and_backend_registries_import_nothing_until_asked() -> None:
    code = ("import sys\n"
            "from photon.model.registry import MODELS\n"
            "from photon.attention.backend import ATTENTION_BACKENDS\n"
            "from photon.structured.backend import GRAMMAR_BACKENDS\n"
            "names = MODELS.names() + ATTENTION_BACKENDS.names() + GRAMMAR_BACKENDS.names()\n"
            "lazy = ['photon.model.qwen3', 'photon.attention.triton_paged', "
            "'photon.structured.xgrammar_backend']\n"
            "print(names, [m for m in lazy if m in sys.modules])\n"
            "MODELS.get('Qwen3ForCausalLM')\n"
            "print('photon.model.qwen3' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.splitlines()
    assert out == ["['LlamaForCausalLM', 'MistralForCausalLM', 'MixtralForCausalLM', "
                   "'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', 'torch', "
                   "'triton', 'xgrammar'] []", "True"]
