"""Sampling behaviour through the whole engine on photon-tiny: seeds, n > 1, stops, logprobs,
preemption. Every test ends with the drain invariants."""

from __future__ import annotations

import math

import pytest

from photon import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def main():\n    return", "JSON: {\"a\": [1, 2", "Hello"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("photon-tiny-random", max_num_batched_tokens=32, block_size=8, max_num_seqs=8, max_model_len=512)


def _ids(outs: list) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16,
                        ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(["Hello", "The quick brown fox", "def f():"], [other, sp, other],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["The quick brown fox"], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    different = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=16,
                               ignore_eos=True)
    assert llm.generate(["The quick brown fox"], different,
                        use_tqdm=False)[0].outputs[0].token_ids != alone
    llm.engine.assert_drained()


def test_n_greater_than_one_gives_distinct_samples(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12,
                                               ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = {tuple(c.token_ids) for c in out.outputs}
    assert len(seqs) == 4 and all(len(s) == 12 for s in seqs)
    llm.engine.assert_drained()


def _greedy(llm: LLM, prompt: str, n: int) -> tuple[str, list[int]]:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids


def test_stop_string_truncates_text(llm: LLM) -> None:
    text, _ = _greedy(llm, "The quick brown fox", 40)
    stop = text[10:14]
    assert stop.strip(), text
    cut = text.index(stop)
    for include in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True,
                            include_stop_str_in_output=include)
        out = llm.generate("The quick brown fox", sp, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: cut + (len(stop) if include else 0)]
    llm.engine.assert_drained()


def test_stop_token_id_ends_at_first_occurrence(llm: LLM) -> None:
    _, ids = _greedy(llm, "def main():\n    return", 30)
    stop_id = ids[6]
    first = ids.index(stop_id)
    out = llm.generate("def main():\n    return",
                       SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                      ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    llm.engine.assert_drained()


def test_min_tokens_bans_stop_ids_until_reached(llm: LLM) -> None:
    _, ids = _greedy(llm, "Hello", 30)
    stop_id = ids[1]
    sp = SamplingParams(temperature=0, max_tokens=30, min_tokens=8, stop_token_ids=[stop_id],
                        ignore_eos=True)
    out = llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:8]
    assert len(out.token_ids) >= 8
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_id


def test_max_tokens_gives_length(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_logprobs_are_normalized_and_greedy_is_argmax(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for tok, entry in zip(out.token_ids, out.logprobs):
        values = [lp.logprob for lp in entry.values()]
        assert tok in entry and len(entry) >= 3
        assert entry[tok].logprob == pytest.approx(max(values)) and entry[tok].rank == 1
        assert all(lp <= 0 for lp in values)
        assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-4
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                       zip(out.token_ids, out.logprobs)))


def test_presence_penalty_reduces_repeats(llm: LLM) -> None:
    base = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    pen = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, presence_penalty=2.0,
                         frequency_penalty=1.0)
    plain = llm.generate(PROMPTS, base, use_tqdm=False)
    penalized = llm.generate(PROMPTS, pen, use_tqdm=False)

    def repeats(outs: list) -> int:
        return sum(len(ids) - len(set(ids)) for ids in _ids(outs))

    assert repeats(penalized) < repeats(plain)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_forced_preemption_gives_identical_outputs(pipelined: bool) -> None:
    prompts = [p * 3 for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)] * 2
    roomy = LLM("photon-tiny-random", block_size=4, max_num_batched_tokens=64, pipelined=pipelined)
    tight = LLM("photon-tiny-random", block_size=4, max_num_batched_tokens=64, pipelined=pipelined,
                num_gpu_blocks_override=40, max_model_len=160)
    expected = _ids(roomy.generate(prompts, params, use_tqdm=False))
    assert _ids(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert roomy.engine.scheduler.num_preemptions == 0
    tight.engine.assert_drained()
    roomy.engine.assert_drained()
