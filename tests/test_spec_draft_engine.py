"""Speculative decoding with a draft model in the engine: greedy gives exactly the tokens of greedy
without speculation (the committed trained pair and random pairs), pipelined equals blocking, the
draft's KV shares the target's block ids (a draft identical to the target has every draft
accepted; blocks the allocator never handed out stay untouched), and speculation combines with
preemption, aborts, prefix caching, n > 1 and seeded sampling. Every run ends with a drain audit
(no KV block used: the draft's KV lives in the same blocks)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from photon import LLM, SamplingParams
from photon.config import ConfigError
from photon.engine_args import EngineArgs
from tests.hf_models import make_engine_model
from tests.test_pipeline import _shared_prefix_specs, run
from tests.test_spec_engine import _mixed_specs

ASSETS = Path(__file__).resolve().parent.parent / "photon" / "assets"
TARGET, DRAFT = str(ASSETS / "photon-tiny"), str(ASSETS / "photon-tiny-draft")
# Held-out-looking Python (the trained pair writes Python).
CODE = ["def read_config(path):\n    with open(path", "class Stack:\n    def __init__(self):\n",
        "    for key, value in sorted(items.items()):\n        if"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llm(model: str, draft: str | None, k: int = 3, pipelined: bool = True,
         **kw: object) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": draft,
                                       "num_speculative_tokens": k, "adaptive": False}
    return LLM(**{"model": model, "dtype": "float32", "pipelined": pipelined,
                  "max_model_len": 128, "speculative_config": spec, **kw})


def _greedy(llm: LLM, prompts: list[str] | list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.engine.assert_drained()
    return [o.outputs[0].token_ids for o in outs]


def _counters(llm: LLM) -> tuple[int, int]:
    c = llm.engine.runner.spec.counters
    return c.num_drafts, c.num_accepted_tokens


@pytest.fixture(scope="module")
def trained_base() -> list[list[int]]:
    return _greedy(_llm(TARGET, None), CODE)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_trained_pair_greedy_equals_greedy_without_speculation(
        trained_base: list[list[int]], k: int) -> None:
    llm = _llm(TARGET, DRAFT, k)
    assert _greedy(llm, CODE) == trained_base
    rows, accepted = _counters(llm)
    assert rows > 0 and accepted > 0  # the trained draft predicts the target often
    if k == 3:
        blocking = _llm(TARGET, DRAFT, k, pipelined=False)
        assert _greedy(blocking, CODE) == trained_base
        assert _counters(blocking) == (rows, accepted)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A random target and a random draft of another shape (layers, heads, head_dim) sharing
    its tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    target = make_engine_model(str(root / "target"), "Qwen3ForCausalLM", hidden_size=64,
                               num_layers=2, num_heads=4, num_kv_heads=2, seed=1)
    draft = make_engine_model(str(root / "draft"), "LlamaForCausalLM", hidden_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, seed=2)
    return target, draft


PROMPTS = [[5, 9, 17, 400, 33] * 3, [700, 3, 3, 81], [42], list(range(100, 137))]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_pair_greedy_equals_greedy_without_speculation(pair: tuple[str, str],
                                                              k: int) -> None:
    target, draft = pair
    base = _greedy(_llm(target, None), PROMPTS)
    pipelined, blocking = _llm(target, draft, k), _llm(target, draft, k, pipelined=False)
    assert _greedy(pipelined, PROMPTS) == base
    assert _greedy(blocking, PROMPTS) == base
    assert _counters(pipelined) == _counters(blocking)


def _track_blocks(llm: LLM) -> set[int]:
    """Every block id the allocator hands out from now on."""
    kv, handed = llm.engine.kv, set()
    take = kv._take_free_block

    def tracked() -> int:
        block = take()
        handed.add(block)
        return block

    kv._take_free_block = tracked
    return handed


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_draft_equal_to_the_target_has_every_draft_accepted(pair: tuple[str, str],
                                                               pipelined: bool) -> None:
    """The draft's KV is right at every position it attends (catch-up on the target's inputs,
    its own steps in the row's blocks): a draft that is the target proposes the target's
    tokens, so every speculative row accepts all K drafts. Its KV is written only into blocks
    the allocator handed out (and the null block)."""
    target, _ = pair
    k = 3
    llm = _llm(target, target, k, pipelined, block_size=4, num_gpu_blocks_override=400)
    handed = _track_blocks(llm)
    base = _greedy(_llm(target, None, block_size=4), PROMPTS)
    assert _greedy(llm, PROMPTS) == base
    rows, accepted = _counters(llm)
    assert rows > 0 and accepted == k * rows
    never = torch.ones(llm.engine.runner.num_blocks, dtype=torch.bool)
    never[[0, *handed]] = False
    assert never.sum() > 0
    for cache in llm.engine.runner.draft.kv_caches:
        assert cache[:, never].abs().sum() == 0


def test_features_under_preemption_with_a_draft_model(pair: tuple[str, str]) -> None:
    """Seeded sampled runs repeat exactly, pipelined equals blocking (schedules included), with
    preemption, aborts, n > 1, stop ids and strings, penalties, logprobs."""
    target, _ = pair
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=48)
    specs = _mixed_specs(17)
    runs = [run(_llm(target, target, 3, pipelined, **kw), specs)
            for pipelined in (True, True, False)]
    (first, audit), (again, _), (blocking, audit_b) = runs
    assert first == again == blocking
    assert audit.schedule == audit_b.schedule
    assert audit.core.scheduler.num_preemptions > 0
    assert audit.zombie_rows > 0
    assert audit.core.runner.spec.counters.num_accepted_tokens > 0
    assert len({tuple(t) for t, _ in first["r1"]}) == 3  # n = 3: three samples
    assert first["r5"][0][1] == "abort" and first["r6"][0][1] == "abort"


def test_prefix_caching_with_a_draft_model(pair: tuple[str, str]) -> None:
    """Prefix hits reuse the draft's KV with the target's (a draft equal to the target keeps
    accepting every draft after a hit)."""
    target, _ = pair
    specs = _shared_prefix_specs()
    kw = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=3)
    base, _ = run(_llm(target, None, **kw), specs)
    pipelined, audit_p = run(_llm(target, target, 2, True, **kw), specs)
    blocking, audit_b = run(_llm(target, target, 2, False, **kw), specs)
    assert audit_p.schedule == audit_b.schedule
    assert pipelined == blocking
    greedy = [f"r{i}" for i, s in enumerate(specs) if s.params.temperature == 0]
    assert greedy and all(pipelined[r] == base[r] for r in greedy)
    assert audit_p.core.kv.prefix_hits > 0


def test_kv_budget_counts_target_and_draft_blocks(pair: tuple[str, str]) -> None:
    target, draft = pair
    budget = 1 << 20
    plain = _llm(target, None, kv_cache_memory_bytes=budget).engine.runner
    both = _llm(target, draft, kv_cache_memory_bytes=budget).engine.runner
    # K and V x layers x 16 positions x kv heads x head_dim x 4 bytes: target 2 layers x 2 kv
    # heads, draft 1 layer x 1 kv head of 8 dims
    assert plain.kv_bytes_per_block() == 2 * 2 * 16 * 2 * plain.config.model.head_dim * 4
    assert both.kv_bytes_per_block() == plain.kv_bytes_per_block() + 2 * 1 * 16 * 1 * 8 * 4
    assert both.num_blocks - 1 == budget // both.kv_bytes_per_block() - 1
    assert [c.shape[1] for c in both.draft.kv_caches] == [both.num_blocks]


def _args(target: str, draft: str, **kw: object) -> EngineArgs:
    return EngineArgs(model=target, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 2}, **kw)


def test_a_draft_with_another_vocabulary_is_refused(pair: tuple[str, str], tmp_path: Path
                                                    ) -> None:
    target, draft = pair
    other = make_engine_model(str(tmp_path / "v"), "LlamaForCausalLM", hidden_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1)
    cfg = json.loads((Path(other) / "config.json").read_text())
    cfg["vocab_size"] = 2048
    (Path(other) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"vocab_size 2048, the target 1024.*share"):
        _args(target, other).create_config()


def test_a_draft_with_another_tokenizer_is_refused(pair: tuple[str, str], tmp_path: Path
                                                   ) -> None:
    target, draft = pair
    other = str(tmp_path / "t")
    shutil.copytree(draft, other)
    tok = json.loads((Path(other) / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (Path(other) / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="different tokenizer.*id 100 in the target's, 101"):
        _args(target, other).create_config()
    os.remove(os.path.join(other, "tokenizer.json"))  # no tokenizer: the target's is used
    assert _args(target, other).create_config().speculative_config.model == other


def test_a_draft_with_a_shorter_context_is_refused(pair: tuple[str, str], tmp_path: Path
                                                    ) -> None:
    target, draft = pair
    short = str(tmp_path / "s")
    shutil.copytree(draft, short)
    cfg = json.loads((Path(short) / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (Path(short) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="draft model supports 64 positions.*max_model_len=128"):
        _args(target, short, max_model_len=128).create_config()
    with pytest.raises(ConfigError, match="draft model '/nonexistent/draft'.*does not exist"):
        _args(target, "/nonexistent/draft").create_config()


def test_an_index_released_by_a_preemption_is_reused_in_the_same_plan() -> None:
    """A request preempted while planning, with no step in flight, releases its index at once
    and admission may hand the index to a new request in the same plan: the runner drops the
    old occupant first (before this was fixed, the new request failed with "request index ...
    is already in use" on this workload)."""
    kw = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=40)
    _, audit = run(_llm(TARGET, DRAFT, 3, **kw), _mixed_specs(500))  # `run` asserts no errors
    assert audit.core.scheduler.num_preemptions > 0


def test_draft_graphs_run_the_k_steps_of_a_proposal_in_one_replay(
        trained_base: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft graphs (CPU stand-ins replaying the captured function): a proposal of K steps
    is one replay, padding rows included, and proposes what the eager steps propose (same
    drafts: the same acceptance counts)."""
    from photon.worker import draft_graphs
    from tests.test_spec_graphs import _EagerReplay

    monkeypatch.setattr(draft_graphs, "Captured", _EagerReplay)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    eager = _llm(TARGET, DRAFT, 3)
    assert _greedy(eager, CODE) == trained_base
    llm = _llm(TARGET, DRAFT, 3, max_num_seqs=8)
    runner = llm.engine.runner
    runner.draft.capture_graphs(8, runner.table.block_tables.shape[1], 3)
    graphs = runner.draft.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    proposer, proposals = runner.spec.proposer, []
    propose = proposer.propose
    proposer.propose = lambda ctx: proposals.append(ctx.pool_rows.numel()) or propose(ctx)
    assert _greedy(llm, CODE) == trained_base
    # one replay per proposal, whatever its rows (3 prompts: a bucket of 4, one padding row)
    assert graphs.replays == len(proposals) > 0 and 3 in proposals
    assert _counters(llm) == _counters(eager)
    with pytest.raises(ValueError, match="run 3 steps"):  # a bound step refuses another K
        graphs.bind(graphs.tables[:1, :4], 1).greedy(torch.zeros(1, dtype=torch.long),
                                                     torch.zeros(1, dtype=torch.long), 2)
