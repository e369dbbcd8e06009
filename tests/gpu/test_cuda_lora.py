"""Multi-LoRA on CUDA: adapters mixed with the base model under CUDA graphs (slot ids are graph
inputs) equal transformers + peft with the adapter merged, pipelined and blocking; slots reloaded
on the copy stream while the previous step runs (one slot for three adapters) keep the outputs
exact; no host sync inside a step with an adapter load."""

from __future__ import annotations

import pytest
import torch

from photon import LLM, SamplingParams
from tests.gpu.test_cuda_pipeline import sync_debug_error  # noqa: F401  (fixture)
from tests.test_lora import ENGINE, MAX_NEW, _expected, setup  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(setup: dict, pipelined: bool, **kw: object) -> LLM:  # noqa: F811
    return LLM(setup["model"], device="cuda", dtype="float32", pipelined=pipelined,
               **{**ENGINE, **kw})


def _tokens(llm: LLM, setup: dict, choice: list) -> list[list[int]]:  # noqa: F811
    outs = llm.generate(setup["prompts"], GREEDY, use_tqdm=False, lora_request=choice)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_adapters_under_cuda_graphs_match_peft(setup: dict, pipelined: bool) -> None:  # noqa: F811
    llm = _llm(setup, pipelined)
    assert llm.engine.runner.graphs is not None
    assert _tokens(llm, setup, setup["choice"]) == _expected(setup, setup["choice"])
    assert llm.engine.runner.graphs.replays > 0
    assert llm.engine.runner.piecewise.replays > 0  # the prompts' steps: pieces with adapters
    llm.engine.assert_drained()


def test_slot_churn_on_the_copy_stream(setup: dict) -> None:  # noqa: F811
    """One slot, three adapters and the base model interleaved: every adapter switch reloads the
    slot (on the copy stream, beside the step in flight); the tokens stay exact."""
    llm = _llm(setup, True, max_loras=1)
    assert _tokens(llm, setup, setup["choice"]) == _expected(setup, setup["choice"])
    assert llm.engine.lora.stats().num_slot_loads >= 3
    llm.engine.assert_drained()


def test_no_hidden_sync_with_adapter_loads(setup: dict, sync_debug_error: list[int]  # noqa: F811
                                           ) -> None:
    """Steps that load adapters into the one slot (from the host cache) never synchronise."""
    torch.cuda.set_sync_debug_mode(0)
    llm = _llm(setup, True, max_loras=1)
    _tokens(llm, setup, setup["choice"])  # graphs captured, every adapter in the host cache
    core = llm.engine
    for prompt, lora in zip(setup["prompts"], setup["choice"]):
        core.add_request(prompt, GREEDY, lora_request=lora)
    loads = core.lora.stats().num_slot_loads
    torch.cuda.set_sync_debug_mode("error")
    while core.has_unfinished():
        core.step()
    torch.cuda.set_sync_debug_mode(0)
    assert core.lora.stats().num_slot_loads > loads and sync_debug_error[0] > 0
    core.assert_drained()
