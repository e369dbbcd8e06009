"""The host side of CUDA graphs for speculative decode steps (photon.worker.spec_graphs): keys,
bucket choice, the eager fallback, and the padding of a step's staged inputs. CPU cannot
capture graphs, so the engine tests stand a replay in with the same forward run eagerly on the
graphs' static buffers: every step a graph would serve goes through the padding, the static
copies and the bounded attention metadata, and must give the tokens of the eager engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from photon import LLM
from photon.attention.torch_ref import TorchReferenceBackend
from photon.core.step import ScheduledRow
from photon.worker import cuda_graph, spec_graphs
from photon.worker.cuda_graph import GraphModel, pad_rows
from photon.worker.spec_graphs import (
    SpecGraphs,
    SpecKey,
    StepGraphs,
    captured_ks,
    spec_batch_buckets,
    uniform_spec_k,
)
from tests.test_pipeline import Spec, run
from tests.test_spec_draft_engine import DRAFT, TARGET
from tests.test_spec_engine import GREEDY, _llm, _prompts


def _row(k: int, speculative: bool = True, tokens: int | None = None) -> ScheduledRow:
    return ScheduledRow(3, 10, k + 1 if tokens is None else tokens, True, 2, [1, 2, 3],
                        spec=k, speculative=speculative)


def test_batch_buckets_are_powers_of_two_capped_by_the_token_budget() -> None:
    assert spec_batch_buckets(256, 8192, 3) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert spec_batch_buckets(256, 100, 3) == [1, 2, 4, 8, 16, 25]  # 25 * 4 <= 100 tokens
    assert spec_batch_buckets(6, 8192, 1) == [1, 2, 4, 6]
    assert spec_batch_buckets(8, 3, 3) == []  # not even one row of 4 tokens fits


def test_captured_k_values() -> None:
    assert captured_ks(3, adaptive=True) == [1, 2, 3]
    assert captured_ks(3, adaptive=False) == [3]


def test_uniform_spec_k() -> None:
    assert uniform_spec_k([_row(3), _row(3)]) == 3
    assert uniform_spec_k([_row(0)]) == 0
    assert uniform_spec_k([]) is None
    assert uniform_spec_k([_row(3), _row(2)]) is None  # K_eff differs
    assert uniform_spec_k([_row(3), _row(0, speculative=False, tokens=1)]) is None  # plain row
    assert uniform_spec_k([_row(3, speculative=False)]) is None  # a prompt chunk of 4 tokens


class _Fwd(GraphModel):
    def __init__(self) -> None:
        super().__init__(None, TorchReferenceBackend(), [], torch.zeros(1, 1))


def test_bucket_choice_and_eager_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TorchReferenceBackend, "decode_cost_depends_on_width", False,
                        raising=False)
    g = SpecGraphs(_Fwd(), [1, 3], max_batch=8, max_tokens=20, max_blocks=9, max_model_len=32,
                   device=torch.device("cpu"))
    assert g.batches == {1: [1, 2, 4, 8], 3: [1, 2, 4, 5]}
    assert g.bucket(3, 3, 4) == SpecKey(4, 9, 3)
    assert g.bucket(1, 5, 9) == SpecKey(8, 9, 1)
    assert g.bucket(3, 6, 4) is None  # more rows than the token budget's graphs
    assert g.bucket(2, 2, 4) is None  # K_eff 2 is not captured
    assert g.bucket(3, 2, 10) is None  # wider than any block table
    assert g.bucket(uniform_spec_k([_row(3), _row(1)]), 2, 4) is None  # mixed K_eff: eager
    assert g.static.pool_idx.numel() == 20 and g.static.seq_lens.numel() == 8
    meta = g.metadata(SpecKey(4, 9, 3))
    assert meta.query_lens_host == [4] * 4 and meta.seq_lens_host == [32] * 4
    assert not meta.seq_lens_exact and not meta.decode_only
    assert meta.query_start_loc.tolist() == [0, 4, 8, 12, 16]


def test_padding_rows_write_only_the_null_block() -> None:
    from photon.core.inputs import StepInputs, fields
    arrays = {f.name: np.arange(6, dtype=np.int64) + 1 for f in fields(StepInputs)}
    inputs = StepInputs(**arrays)
    inputs.seq_lens = np.array([7, 9])
    inputs.query_start_loc = np.array([0, 3, 6])
    inputs.block_tables = np.array([[5, 6], [7, 0]])
    pad_rows(inputs, 4, 3, 3)
    assert inputs.positions.tolist() == [1, 2, 3, 4, 5, 6] + [0] * 6
    assert inputs.pool_idx.tolist()[6:] == [0] * 6  # pool entry 0: read only
    assert inputs.slot_mapping.tolist()[6:] == [0] * 6  # slot 0 of the null block 0
    assert inputs.seq_lens.tolist() == [7, 9, 3, 3]
    assert inputs.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert inputs.block_tables.tolist() == [[5, 6, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]]
    # sampling fields are not padded: padding rows never sample
    assert inputs.counters.tolist() == [1, 2, 3, 4, 5, 6]
    assert inputs.spec_rows.tolist() == [1, 2, 3, 4, 5, 6]


class _EagerReplay:
    """Stands in for a captured graph on CPU: replay runs the same forward on the static
    buffers."""

    def __init__(self, forward, pool) -> None:  # noqa: ANN001
        self.forward, self.pool = forward, pool
        self.out: torch.Tensor | None = None  # the last replay's output, as a graph keeps it

    def replay(self) -> torch.Tensor:
        self.out = self.forward()
        return self.out


def _install_graphs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> StepGraphs:
    """CPU graphs for `llm`'s runner, checking each speculative replay's padding."""
    monkeypatch.setattr(cuda_graph, "Captured", _EagerReplay)
    monkeypatch.setattr(spec_graphs, "Captured", _EagerReplay)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    # The reference varlen path reads the resolved lengths with .tolist(): free on CPU.
    monkeypatch.setattr(TorchReferenceBackend, "varlen_capturable", True, raising=False)
    r = llm.engine.runner
    fwd = GraphModel(r.model, r.backend, r.kv_caches, r.token_pool, r.draft)
    graphs = StepGraphs.build(fwd, r.config, r.table.block_tables.shape[1], r.device)
    graphs.capture()
    spec_run = graphs.spec.run
    bs = r.block_size
    graphs.spec.replayed_ks = set()  # the K_eff of every speculative replay

    def checked(key, dev, num_rows):  # noqa: ANN001, ANN202
        graphs.spec.replayed_ks.add(key.k)
        real = num_rows * (key.k + 1)
        assert dev.slot_mapping[real:].lt(bs).all(), "padding writes only the null block"
        assert dev.pool_idx[real:].eq(0).all() and dev.spec_rows.lt(num_rows).all()
        return spec_run(key, dev, num_rows)

    graphs.spec.run = checked
    r.graphs = graphs
    return graphs


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_greedy_with_spec_graphs_equals_greedy(k: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [Spec(p, GREEDY) for p in _prompts(k)]
    base, _ = run(_llm(False, dtype="float32"), specs)
    results = []
    for pipelined in (True, False):
        llm = _llm(pipelined, k, dtype="float32", max_num_seqs=4)
        graphs = _install_graphs(llm, monkeypatch)
        out, audit = run(llm, specs)
        assert out == base
        assert graphs.spec_replays > 0
        assert llm.engine.runner.spec.counters.num_accepted_tokens > 0
        results.append(audit.schedule)
    assert results[0] == results[1]


class _Cycle:
    """A speculation policy verifying 0, 3, 1, 2, 3, 0, ... drafts in turn (after 0 the 3 runs
    plain rows that propose; the rows of 1, 2, 3 verify drafts)."""

    CYCLE = (0, 3, 1, 2, 3)

    def __init__(self) -> None:
        self.n = 0
        self.seen: set[int] = set()

    def choose(self, batch_size: int) -> int:
        self.n += 1
        self.seen.add(self.n % len(self.CYCLE))
        return self.CYCLE[self.n % len(self.CYCLE)]

    def committed(self, step: int, batch_size: int, k: int, decode_only: bool,
                  tokens: int) -> None:
        pass


def test_every_k_eff_with_graphs_equals_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive K_eff: 1..K replay speculative graphs, 0 the decode graphs (padded rows that
    the launch resolves)."""
    specs = [Spec(p, GREEDY) for p in _prompts(7)]
    base, _ = run(_llm(False, dtype="float32"), specs)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}
    llm = LLM("photon-tiny-random", dtype="float32", max_model_len=256, max_num_seqs=4,
              speculative_config=spec)
    policy = _Cycle()
    llm.engine.scheduler.spec_policy = policy
    graphs = _install_graphs(llm, monkeypatch)
    assert sorted(graphs.spec.batches) == [1, 2, 3]
    out, _ = run(llm, specs)
    assert out == base
    assert graphs.spec_replays > 0 and graphs.decode.replays > 0 and len(policy.seen) == 5
    assert {key.k for key in graphs.spec.graphs} == {1, 2, 3}
    assert graphs.spec.replayed_ks == {1, 2, 3}


def test_draft_model_greedy_with_graphs_equals_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = ["def read_config(path):\n    with open(path", "class Stack:\n"]
    kw = dict(model=TARGET, dtype="float32", max_model_len=128, max_num_seqs=2)
    base = [o.outputs[0].token_ids for o in
            LLM(**kw).generate(prompts, GREEDY, use_tqdm=False)]
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3,
            "adaptive": False}
    llm = LLM(speculative_config=spec, **kw)
    graphs = _install_graphs(llm, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == base
    assert graphs.spec_replays > 0
    assert llm.engine.runner.spec.counters.num_accepted_tokens > 0
    llm.engine.assert_drained()
