"""logit_bias: validated at SamplingParams, added to the logits on the device before penalties and
sampling (a +100 bias forces a token under greedy, -100 bans it), only for the rows that have
one, with the same tokens pipelined and blocking."""

from __future__ import annotations

import math
import random

import pytest
import torch

from photon import LLM, SamplingParams
from photon.errors import ParamError
from photon.worker.sampler import Sampler
from tests.test_sampler import make_batch

PROMPT = [5, 17, 300, 42, 9]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("photon-tiny-random", max_model_len=128, block_size=4, max_num_seqs=8)


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams],
            prompts: list[list[int]] | None = None) -> list[list[int]]:
    outs = llm.generate(prompts or [PROMPT], params, use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


def test_plus_100_forces_and_minus_100_bans_under_greedy(llm: LLM) -> None:
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    (plain,) = _tokens(llm, SamplingParams(**greedy))
    (forced,) = _tokens(llm, SamplingParams(**greedy, logit_bias={77: 100.0}))
    assert forced == [77] * 6 != plain
    (banned,) = _tokens(llm, SamplingParams(**greedy, logit_bias={plain[0]: -100.0}))
    assert banned[0] != plain[0]
    # A bias of 0 changes nothing; a mixed batch biases only its own rows.
    zero, biased, other = _tokens(llm, [SamplingParams(**greedy, logit_bias={plain[0]: 0.0}),
                                        SamplingParams(**greedy, logit_bias={77: 100.0}),
                                        SamplingParams(**greedy)], [PROMPT] * 3)
    assert zero == other == plain and biased == forced
    llm.engine.assert_drained()


def test_min_tokens_bans_override_a_bias(llm: LLM) -> None:
    """A stop id under min_tokens is banned (-inf) even with +100: the next-biased token wins."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, min_tokens=4,
                            stop_token_ids=[77], logit_bias={77: 100.0, 78: 99.0})
    (tokens,) = _tokens(llm, params)
    assert 77 not in tokens[:4] and tokens[:4] == [78] * 4  # min_tokens bans the stop id


def _specs(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(12):
        prompts.append([rng.randrange(3, 1000) for _ in range(rng.randrange(2, 40))])
        bias = {rng.randrange(0, 1000): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 6))}
        params.append(SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=10,
                                     ignore_eos=True, logit_bias=bias or None,
                                     presence_penalty=0.5 * (i % 3 == 0),
                                     logprobs=1 if i % 4 == 0 else None))
    return prompts, params


def test_pipelined_equals_blocking_with_biases() -> None:
    prompts, params = _specs(7)
    kw = dict(max_model_len=128, block_size=4, max_num_seqs=5, max_num_batched_tokens=24)
    results = []
    for pipelined in (True, False):
        llm = LLM("photon-tiny-random", pipelined=pipelined, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(c.token_ids, c.cumulative_logprob) for o in outs for c in o.outputs])
        llm.engine.assert_drained()
    assert results[0] == results[1]


def test_sampler_adds_the_biases_of_their_rows_only() -> None:
    logits = torch.randn(3, 20)
    batch = make_batch(3, temperature=torch.zeros(3))
    batch.any_logit_bias = True
    batch.bias_rows = torch.tensor([0, 0, 2])
    batch.bias_tokens = torch.tensor([4, 7, 7])
    batch.bias_values = torch.tensor([50.0, -50.0, 60.0])
    want = logits.clone()
    want[0, 4] += 50
    want[0, 7] -= 50
    want[2, 7] += 60
    out = Sampler()(logits.clone(), batch)
    assert out.token_ids.tolist() == want.argmax(-1).tolist() and out.token_ids[0] == 4
    batch.any_logit_bias = False  # the flag off: the arrays are not read
    assert Sampler()(logits.clone(), batch).token_ids.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(("bias", "message"), [
    ({1: 100.5}, "logit_bias values must be numbers in [-100, 100], got 100.5"),
    ({1: math.nan}, "logit_bias values must be numbers in [-100, 100]"),
    ({1: True}, "logit_bias values must be numbers"),
    ({-1: 1.0}, "logit_bias keys must be token ids"),
    ({"1": 1.0}, "logit_bias keys must be token ids"),
    ({i: 1.0 for i in range(1025)}, "at most 1024"),
    ([1, 2], "logit_bias must be a dict"),
])
def test_bad_logit_bias_names_the_field(bias: object, message: str) -> None:
    with pytest.raises(ParamError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias)
    assert message in str(e.value) and e.value.param == "logit_bias"


def test_token_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    vocab = llm.engine.config.model.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias token ids \[\d+\] are outside"):
        llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    llm.engine.assert_drained()
