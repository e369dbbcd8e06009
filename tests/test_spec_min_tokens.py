"""min_tokens with speculative decoding: the stop-token bans apply per verified position from the
device's output index, so min_tokens requests speculate, stop exactly where the engine without
speculation stops, and never end before min_tokens."""

from __future__ import annotations

import random

import pytest

from photon import SamplingParams
from tests.test_pipeline import Spec, run
from tests.test_spec_engine import _accepted, _llm

MIN = 12


def _greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("k", [3, 5])
def test_min_tokens_requests_speculate_and_stop_exactly_as_without_speculation(k: int) -> None:
    rng = random.Random(12)
    pattern = [rng.randrange(3, 1000) for _ in range(5)]
    prompt = pattern * 8
    probe, _ = run(_llm(False), [Spec(prompt, _greedy(30, ignore_eos=True))])
    free = probe["r0"][0][0]  # the model repeats a token here: the drafts get accepted
    # The first new token after a run of accepted drafts: as a stop id with min_tokens = its
    # index, the ban lifts exactly there, on the device, inside a speculative row.
    at = next(i for i in range(4, len(free)) if free[i] not in free[:i])
    specs = [Spec(prompt, _greedy(30, min_tokens=at, stop_token_ids=[free[at]])),
             Spec(prompt, _greedy(30, min_tokens=MIN, stop_token_ids=[free[0]])),
             Spec(pattern * 5, SamplingParams(temperature=0.8, seed=5, max_tokens=30,
                                              min_tokens=MIN, stop_token_ids=[free[0]])),
             Spec(pattern * 7, _greedy(20, ignore_eos=True))]
    base, _ = run(_llm(False), specs)
    assert base["r0"] == [(free[:at + 1], "stop")]
    llm_p, llm_b = _llm(True, k), _llm(False, k)
    pipelined, audit_p = run(llm_p, specs)
    blocking, audit_b = run(llm_b, specs)
    assert pipelined == blocking
    assert audit_p.schedule == audit_b.schedule
    assert all(r.spec_k == k for r in audit_p.requests.values())  # every request speculated
    assert _accepted(llm_p) == _accepted(llm_b) > 0
    for rid in ("r0", "r1", "r3"):  # greedy: the tokens of the engine without speculation
        assert pipelined[rid] == base[rid]
    for rid in ("r1", "r2"):  # the model's first choice is their stop id: held off until MIN
        (toks, _), = pipelined[rid]
        assert len(toks) >= MIN and free[0] not in toks[:MIN - 1]
