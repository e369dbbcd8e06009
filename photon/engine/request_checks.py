"""The checks every request passes at the edge, wherever the edge is: `EngineCore.add_request` in
process, or the front end (`AsyncLLM`) before a request is sent to the engine-core process, so a
request the core receives never fails them."""

from __future__ import annotations

from collections.abc import Sequence

from photon.config import EngineConfig
from photon.core.sampling import derive_key, pack_sampling
from photon.errors import ParamError
from photon.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from photon.sampling_params import SamplingParams
from photon.tokenizer import Tokenizer


class RequestChecks:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, ids

    def max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """The request's output budget: max_tokens, never past max_model_len."""
        max_len = self.config.model.max_model_len
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_prompt >= max_len:
            raise ValueError(f"prompt is {num_prompt} tokens long, but max_model_len is {max_len} "
                             f"(prompt plus at least one output token must fit)")
        # The KV cache holds one max_model_len request (checked at startup): this always fits.
        room = max_len - num_prompt
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def check_fits(self, num_prompt: int, max_tokens: int | None) -> None:
        """The server's rule (as vLLM's server): prompt + max_tokens must fit max_model_len.
        Offline, add_request clamps max_tokens instead."""
        max_len = self.config.model.max_model_len
        if max_tokens is not None and num_prompt + max_tokens > max_len:
            raise ValueError(
                f"this model's maximum context length is {max_len} tokens, but the request asks "
                f"for {num_prompt + max_tokens} ({num_prompt} in the prompt + {max_tokens} for the "
                f"completion); reduce the prompt or max_tokens")

    def check(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Every check add_request makes on a tokenized prompt; returns the resolved max_tokens."""
        params.validate_token_ids(self.config.model.vocab_size)
        self.tokenize_prompt(prompt_ids)
        max_tokens = self.max_tokens(len(prompt_ids), params)
        pack_sampling(params, derive_key(0), len(prompt_ids), max_tokens,
                      self.config.model.vocab_size, self.tokenizer.eos_token_ids)
        return max_tokens

    def kv_transfer_params(self, values: object, n: int) -> KVTransferParams | None:
        """A request's kv_transfer_params, checked against this instance (ParamError naming
        the key and what is allowed)."""
        kvp = parse_kv_transfer_params(values)
        if kvp is None or not (kvp.do_remote_decode or kvp.do_remote_prefill):
            return kvp
        kvt = self.config.kv_transfer_config
        if kvt is None:
            raise ParamError("kv_transfer_params", "kv_transfer_params: this instance was "
                             "started without --kv-transfer-config")
        if n != 1:
            raise ParamError("kv_transfer_params", "kv_transfer_params: needs n=1")
        kvt.check_request(kvp, self.config.parallel.tensor_parallel_size)
        return kvp
