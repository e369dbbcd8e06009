"""The sampling graphs of speculative decode steps (photon.worker.spec_sample_graphs), with CPU
stand-ins for the graphs (each replay runs the captured function on the static buffers): the
steps they serve give the eager sampling's tokens, drafts and acceptances; the others (sampled
rows, padded batches) sample eagerly."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from photon import LLM, SamplingParams
from photon.core.inputs import StepInputs
from photon.worker import spec_sample_graphs
from photon.worker.spec_sample_graphs import SpecSampleGraphs
from tests.test_pipeline import Spec, run
from tests.test_spec_engine import GREEDY, _llm, _prompts
from tests.test_spec_graphs import _EagerReplay, _install_graphs


def _install_sample_graphs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> SpecSampleGraphs:
    graphs = _install_graphs(llm, monkeypatch)
    monkeypatch.setattr(spec_sample_graphs, "Captured", _EagerReplay)
    r = llm.engine.runner
    sample = SpecSampleGraphs(graphs.spec, r.model.compute_logits, r.spec, r.sampler,
                              r.token_pool, r.scratch_row, r.draft)
    sample.capture()
    r.sampling.graphs = sample
    return sample


def _counters(llm: LLM) -> tuple[int, int, list[int]]:
    c = llm.engine.runner.spec.counters
    return c.num_drafts, c.num_accepted_tokens, list(c.num_accepted_tokens_per_pos)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_steps_sample_through_the_graph_with_the_eager_results(
        k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [Spec(p, GREEDY) for p in _prompts(k)]
    base, _ = run(_llm(False, dtype="float32"), specs)
    eager = _llm(True, k, dtype="float32", max_num_seqs=4)
    _install_graphs(eager, monkeypatch)
    out_e, audit_e = run(eager, specs)
    llm = _llm(True, k, dtype="float32", max_num_seqs=4)
    sample = _install_sample_graphs(llm, monkeypatch)
    out, audit = run(llm, specs)
    assert out == out_e == base
    assert audit.schedule == audit_e.schedule
    assert sample.replays > 0
    assert _counters(llm) == _counters(eager) and _counters(llm)[1] > 0


def test_sampled_rows_sample_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded random rows never take the graph (its batch is greedy only); their tokens are
    those of the engine without the sampling graphs."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(3)]
    specs = [Spec(p, sp) for p, sp in zip(_prompts(5)[:3], params)]
    eager = _llm(True, 3, dtype="float32", max_num_seqs=4)
    _install_graphs(eager, monkeypatch)
    out_e, _ = run(eager, specs)
    llm = _llm(True, 3, dtype="float32", max_num_seqs=4)
    sample = _install_sample_graphs(llm, monkeypatch)
    out, _ = run(llm, specs)
    assert out == out_e
    assert sample.replays == 0 and llm.engine.runner.graphs.spec_replays > 0


def test_padded_batches_sample_in_the_graph_on_the_scratch_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """3 rows in the graph of 4, then 2 and 1 as requests finish: every speculative graph step
    samples in its graph, the padding rows on the scratch row. Tokens, drafts and acceptances
    are the eager sampling's, and no request's state is touched by the padding: the scratch
    row is the only one past the scheduler's indices, and the padding wrote it."""
    reqs = [Spec(p, GREEDY) for p in _prompts(5)[:3]]
    eager = _llm(True, 3, dtype="float32", max_num_seqs=4)
    _install_graphs(eager, monkeypatch)
    out_e, audit_e = run(eager, reqs)
    llm = _llm(True, 3, dtype="float32", max_num_seqs=4)
    sample = _install_sample_graphs(llm, monkeypatch)
    r = llm.engine.runner
    assert r.scratch_row == r.token_pool.shape[0] - 1 == len(llm.engine.scheduler.by_index)
    choices = []  # (graph batch, rows) of every speculative graph's step
    key = sample.key
    sample.key = lambda g, host, n, *a: (choices.append((g.batch, n)), key(g, host, n, *a))[1]
    before = sample.replays
    out, audit = run(llm, reqs)
    assert out == out_e == run(_llm(False, dtype="float32"), reqs)[0]
    assert audit.schedule == audit_e.schedule
    assert _counters(llm) == _counters(eager) and _counters(llm)[1] > 0
    padded = sum(b != n for b, n in choices)
    assert padded > 0 and sample.replays - before == len(choices)
    assert r.spec.dev_len[r.scratch_row] <= r.spec.k + 2
    assert r.token_pool[r.scratch_row, 1:r.spec.k + 2].ne(0).any()  # the padding's tokens


@pytest.mark.parametrize("num_prompts", [2, 3], ids=["full", "padded"])
def test_a_draft_model_proposes_inside_the_sampling_graph(
        num_prompts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a draft model the sampling graph runs the draft's K steps too (over the forward
    graph's block tables; a padding row's are the null block's): the tokens, drafts and
    acceptances of the eager sampling, which proposes with the draft graphs' step."""
    from tests.test_spec_draft_engine import CODE, DRAFT, TARGET
    from tests.test_spec_draft_engine import _llm as _draft_llm

    prompts = CODE[:num_prompts]
    eager = _draft_llm(TARGET, DRAFT, 3, max_num_seqs=4)
    _install_graphs(eager, monkeypatch)
    out_e = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    llm = _draft_llm(TARGET, DRAFT, 3, max_num_seqs=4)
    sample = _install_sample_graphs(llm, monkeypatch)
    assert sample.propose_in_graph
    r, calls = llm.engine.runner, {"propose": 0, "decode": 0}
    for owner, name in ((r.spec, "propose"), (r.draft, "decode")):
        def counted(*a, _f=getattr(owner, name), _n=name):  # noqa: ANN002, ANN202
            calls[_n] += 1
            return _f(*a)
        setattr(owner, name, counted)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.engine.assert_drained()
    assert out == out_e
    # every proposal either binds the draft's step eagerly (decode) or runs inside a replay
    in_graph = calls["propose"] - calls["decode"]
    assert 0 < in_graph <= sample.replays
    assert _counters(llm) == _counters(eager) and _counters(llm)[1] > 0


class _Graph:
    """torch.cuda.CUDAGraph stood in for on CPU: `Captured` runs the capture eagerly."""

    def pool(self) -> tuple[int, int]:
        return (0, 1)


@contextlib.contextmanager
def _capture(graph: _Graph, pool: tuple | None = None) -> Iterator[None]:
    yield


def test_constant_inputs_live_as_long_as_their_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inputs a sampling graph's capture reads but its capture did not make (the constant
    step inputs and their sampling batch) stay allocated while the graphs live: on the GPU a
    freed one's memory went to other tensors, which the replays then overwrote. `Captured` is
    the real one here, with torch's capture stood in for."""
    llm = _llm(True, 3, dtype="float32", max_num_seqs=4)
    graphs = _install_graphs(llm, monkeypatch)
    for forward in graphs.spec.graphs.values():
        forward.replay()  # the stand-in's output, which the sampling reads
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    made: list[weakref.ref] = []
    inputs = SpecSampleGraphs._inputs

    def recorded(self: SpecSampleGraphs, b: int, k: int) -> StepInputs:
        consts = inputs(self, b, k)
        tensors = (getattr(consts, f.name) for f in dataclasses.fields(consts))
        made.extend(weakref.ref(t) for t in tensors if t.numel())
        return consts

    monkeypatch.setattr(SpecSampleGraphs, "_inputs", recorded)
    r = llm.engine.runner
    sample = SpecSampleGraphs(graphs.spec, r.model.compute_logits, r.spec, r.sampler,
                              r.token_pool, r.scratch_row, r.draft)
    sample.capture()
    gc.collect()
    assert sample.graphs and made
    assert all(ref() is not None for ref in made)
    del sample
    gc.collect()
    assert any(ref() is None for ref in made)


def test_a_cycling_switch_with_a_draft_model_and_padding_equals_greedy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything at once: a draft model, the switch verifying 0, 0, 3, 1, 0, 2, 3, ... drafts
    in turn (the second of two K_eff = 0 steps has plain rows and skips the draft, the next
    proposing step fills it), three requests in graphs of four, then fewer as they finish
    (padding rows on the scratch row), proposals inside the sampling graphs: greedy tokens
    equal those without speculation; drained."""
    from tests.test_spec_draft_engine import CODE, DRAFT, TARGET
    from tests.test_spec_graphs import _Cycle

    class _Flapping(_Cycle):
        CYCLE = (0, 0, 3, 1, 0, 2, 3)

    kw = dict(model=TARGET, dtype="float32", max_model_len=128, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(**kw).generate(CODE, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3,
            "adaptive": True}
    llm = LLM(speculative_config=spec, **kw)
    policy = _Flapping()
    llm.engine.scheduler.spec_policy = policy
    sample = _install_sample_graphs(llm, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(CODE, params, use_tqdm=False)]
    assert got == base
    llm.engine.assert_drained()
    assert sample.replays > 0 and len(policy.seen) == len(_Flapping.CYCLE)
    assert llm.engine.runner.graphs.lean_replays > 0  # K_eff = 0 steps skipped the draft
    assert _counters(llm)[1] > 0
