"""Photon models vs Hugging Face transformers on tiny random checkpoints (CPU, float32)."""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from photon.attention.backend import AttentionMetadata, ForwardContext
from photon.attention.torch_ref import TorchReferenceBackend
from photon.config import ConfigError, ModelConfig
from photon.kernels import has_triton
from photon.model.hf_config import load_hf_config
from photon.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from photon.model.layers.rotary import rope_settings
from photon.model.loader import load_model
from photon.model.registry import get_model_class, supported_architectures
from tests.hf_models import MIXTRAL, QWEN3_MOE, build_hf_model, make_hf_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64  # block 0 is the reserved dummy block
PROMPT_LENS = [5, 11, 8]
NUM_GENERATED = 4


def model_config(path: str, dtype: torch.dtype = torch.float32,
                 use_triton: bool = False) -> ModelConfig:
    hf = load_hf_config(path)
    return ModelConfig(model=path, hf_config=hf, architecture=hf["architectures"][0], dtype=dtype,
                       max_model_len=int(hf["max_position_embeddings"]),
                       vocab_size=int(hf["vocab_size"]), seed=0, served_model_name="test",
                       use_triton=use_triton)


@dataclass
class PagedRun:
    """Drives a photon model step by step over a paged KV cache, like the model runner would."""

    model: torch.nn.Module
    seqs: list[list[int]]  # full token lists (prompt + teacher-forced outputs)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        cfg = self.model.hf_config
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, cfg["num_key_value_heads"], head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype)
                          for _ in range(cfg["num_hidden_layers"])]
        # Interleaved, non-contiguous blocks: sequence i owns blocks i+1, i+1+n, i+1+2n, ...
        n = len(self.seqs)
        self.tables = [[1 + i + n * j for j in range(-(-len(s) // BLOCK_SIZE))]
                       for i, s in enumerate(self.seqs)]
        self.done = [0] * n
        self.backend = TorchReferenceBackend()

    def metadata(self, plan: list[tuple[int, int]], decode_only: bool) -> AttentionMetadata:
        slots, seq_lens = [], []
        for i, n in plan:
            start = self.done[i]
            slots += [self.tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, start + n)]
            seq_lens.append(start + n)
        width = max(len(self.tables[i]) for i, _ in plan) + 2  # extra zero padding columns
        tables = [self.tables[i] + [0] * (width - len(self.tables[i])) for i, _ in plan]
        q_lens = [n for _, n in plan]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens_host=seq_lens, query_lens_host=q_lens, decode_only=decode_only)

    def step(self, plan: list[tuple[int, int]],
             decode_only: bool = False) -> list[tuple[int, int, torch.Tensor]]:
        """Run one step; returns (seq, position, logits) for every token processed."""
        meta = self.metadata(plan, decode_only)
        ids, pos, owners = [], [], []
        for i, n in plan:
            ids += self.seqs[i][self.done[i]:self.done[i] + n]
            pos += list(range(self.done[i], self.done[i] + n))
            owners += [i] * n
            self.done[i] += n
        ctx = ForwardContext(metadata=meta, kv_caches=self.kv_caches, backend=self.backend)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), ctx)
            logits = self.model.compute_logits(hidden)
        return [(owners[t], pos[t], logits[t]) for t in range(len(ids))]

    def run_all(self) -> list[tuple[int, int, torch.Tensor]]:
        """Chunked prefill in two steps (the second mixes in a decode), then decode-only steps."""
        out = self.step([(0, PROMPT_LENS[0]), (1, 6), (2, 3)])
        out += self.step([(0, 1), (1, PROMPT_LENS[1] - 6), (2, PROMPT_LENS[2] - 3)])
        while True:
            plan = [(i, 1) for i, s in enumerate(self.seqs) if self.done[i] < len(s)]
            if not plan:
                return out
            out += self.step(plan, decode_only=True)


def hf_greedy(hf_model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """Prompt + NUM_GENERATED greedy tokens, each sequence run alone through HF."""
    seqs = []
    with torch.no_grad():
        for prompt in prompts:
            toks = list(prompt)
            for _ in range(NUM_GENERATED):
                toks.append(int(hf_model(torch.tensor([toks])).logits[0, -1].argmax()))
            seqs.append(toks)
    return seqs


def make_prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def compare_with_hf(path: str, hf_model: torch.nn.Module, dtype: torch.dtype,
                    atol: float, rtol: float) -> None:
    model = load_model(model_config(path, dtype), "cpu")
    seqs = hf_greedy(hf_model, make_prompts(model.hf_config["vocab_size"]))
    with torch.no_grad():
        ref = [hf_model(torch.tensor([s])).logits[0].float() for s in seqs]
    results = PagedRun(model, seqs, dtype).run_all()
    assert len(results) == sum(len(s) for s in seqs)  # every position was processed once
    got = torch.stack([lg for _, _, lg in results])
    want = torch.stack([ref[i][p] for i, p, _ in results])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


CASES = {
    "llama": dict(arch="LlamaForCausalLM"),
    "llama-tied": dict(arch="LlamaForCausalLM", tied=True),
    "llama3-rope": dict(arch="LlamaForCausalLM", rope_scaling_llama3=True),
    "mistral": dict(arch="MistralForCausalLM"),
    "qwen2": dict(arch="Qwen2ForCausalLM"),
    "qwen2-tied": dict(arch="Qwen2ForCausalLM", tied=True),
    "qwen3": dict(arch="Qwen3ForCausalLM", head_dim=32),
    "qwen3-tied-mha": dict(arch="Qwen3ForCausalLM", tied=True, head_dim=32, num_kv_heads=4),
    "qwen3-moe": dict(arch="Qwen3MoeForCausalLM", head_dim=32, num_layers=3, extra=QWEN3_MOE),
    "mixtral": dict(arch="MixtralForCausalLM", num_layers=3, extra=MIXTRAL),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_float32(tmp_path: os.PathLike, case: str) -> None:
    kwargs = CASES[case]
    path = make_hf_model(str(tmp_path), **kwargs)
    hf_model = build_hf_model(**kwargs)  # same seed -> same weights as the checkpoint
    compare_with_hf(path, hf_model, torch.float32, atol=1e-4, rtol=1e-4)


def test_bf16_checkpoint(tmp_path: os.PathLike) -> None:
    from transformers import AutoModelForCausalLM

    path = make_hf_model(str(tmp_path), "Qwen2ForCausalLM", dtype=torch.bfloat16)
    hf_model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    model = load_model(model_config(path, torch.bfloat16), "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    compare_with_hf(path, hf_model, torch.bfloat16, atol=0.15, rtol=0.05)


def test_sharded_checkpoint_loads_identically(tmp_path: os.PathLike) -> None:
    single = make_hf_model(str(tmp_path / "single"), "LlamaForCausalLM")
    sharded = make_hf_model(str(tmp_path / "sharded"), "LlamaForCausalLM", shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len(glob.glob(os.path.join(sharded, "*.safetensors"))) > 1
    a = load_model(model_config(single), "cpu").state_dict()
    b = load_model(model_config(sharded), "cpu").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_no_safetensors_is_a_clear_error(tmp_path: os.PathLike) -> None:
    path = make_hf_model(str(tmp_path), "LlamaForCausalLM")
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        os.remove(f)
    with pytest.raises(ConfigError, match=r"no \*\.safetensors files.*\.bin"):
        load_model(model_config(path), "cpu")


def test_missing_shard_is_named(tmp_path: os.PathLike) -> None:
    path = make_hf_model(str(tmp_path), "LlamaForCausalLM", shard_size="100KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(ConfigError, match=shard):
        load_model(model_config(path), "cpu")


def assert_missing_weight_named(path: str, hf_name: str, param_pattern: str) -> None:
    """Deleting `hf_name` from the checkpoint makes loading fail naming our parameter."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors[hf_name]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=param_pattern):
        load_model(model_config(path), "cpu")


def test_missing_weight_is_named(tmp_path: os.PathLike) -> None:
    path = make_hf_model(str(tmp_path), "Qwen2ForCausalLM")
    assert_missing_weight_named(path, "model.layers.1.self_attn.k_proj.bias",
                                r"model\.layers\.1\.self_attn\.qkv_proj\.bias")


def test_registry() -> None:
    assert set(supported_architectures()) >= {"LlamaForCausalLM", "Qwen3ForCausalLM"}
    assert get_model_class("MistralForCausalLM").__name__ == "MistralForCausalLM"
    with pytest.raises(ValueError, match=re.escape(
            "unknown model architecture 'GPT2LMHeadModel'; available: LlamaForCausalLM, "
            "MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
            "Qwen3MoeForCausalLM")):
        get_model_class("GPT2LMHeadModel")


def _kernels(model: torch.nn.Module) -> list[object]:
    """The Triton kernel each norm, activation and rope layer of `model` was built with."""
    found: list[object] = []
    for module in model.modules():
        if isinstance(module, RMSNorm):
            found += [module.rms_kernel, module.add_rms_kernel]
        elif isinstance(module, (SiluAndMul, RotaryEmbedding)):
            found.append(module.kernel)
    return found


@pytest.mark.skipif(not has_triton(), reason="needs triton")
def test_layers_get_the_triton_switch_from_the_model_config(tmp_path) -> None:  # noqa: ANN001
    """ModelConfig.use_triton reaches every layer at construction (no global read at import)."""
    path = make_hf_model(str(tmp_path), "Qwen3ForCausalLM")  # q/k norms too
    with_triton = _kernels(load_model(model_config(path, use_triton=True), "cpu"))
    without = _kernels(load_model(model_config(path), "cpu"))
    assert len(with_triton) == len(without) > 0
    assert all(callable(k) for k in with_triton) and all(k is None for k in without)


def test_rope_settings_both_config_formats() -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = {"rope_theta": 500000.0, "rope_scaling": dict(scaling, rope_type="llama3")}
    new = {"rope_parameters": dict(scaling, rope_type="llama3", rope_theta=500000.0)}
    assert rope_settings(old)[0] == rope_settings(new)[0] == 500000.0
    assert rope_settings(old)[1]["factor"] == rope_settings(new)[1]["factor"] == 8.0
    assert rope_settings({"rope_theta": 1e6}) == (1e6, None)
    assert rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}) == \
        (5.0, None)
    with pytest.raises(ValueError, match="yarn"):
        rope_settings({"rope_scaling": {"type": "yarn", "factor": 2.0}})


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4)])
def test_decode_path_equals_per_sequence_path(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    head_dim, seq_lens = 8, [1, 7, 13, 4]
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    width = 6  # wider than any sequence needs: padded with block 0
    tables = [perm[width * i: width * i + -(-n // BLOCK_SIZE)] for i, n in enumerate(seq_lens)]
    tables = [t + [0] * (width - len(t)) for t in tables]
    slots = [tables[i][(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for i, n in enumerate(seq_lens)]
    b = len(seq_lens)
    q = torch.randn(b, num_heads, head_dim, generator=gen)
    k = torch.randn(b, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(b, num_kv_heads, head_dim, generator=gen)
    outs = []
    for decode_only in (True, False):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.arange(b + 1, dtype=torch.int32),
            seq_lens_host=seq_lens, query_lens_host=[1] * b, decode_only=decode_only)
        c = cache.clone()
        outs.append(TorchReferenceBackend().forward(q, k, v, c, meta, 0.3))
        assert torch.equal(c[0].view(-1, num_kv_heads, head_dim)[torch.tensor(slots)], k)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
