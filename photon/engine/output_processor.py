"""The front end's half of a request's outputs: detokenization, stop strings, logprob texts.

An engine-core process sends token ids only (photon.engine.messages). `OutputProcessor` keeps,
per request, an incremental detokenizer per sequence and turns each `RequestDelta` into the delta
`RequestOutput` the in-process engine would have produced: the text since the last output (a
possible stop-string prefix withheld), logprob entries with their token texts. A stop string
finishes its sequence here, as the in-process scheduler's check would (only once the sequence has
`min_tokens` outputs); the caller aborts that sequence in the core, whose later tokens for it are
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from photon.engine.detokenizer import IncrementalDetokenizer
from photon.engine.logprobs import TokenTexts
from photon.engine.messages import ChildDelta, RequestDelta
from photon.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from photon.sampling_params import SamplingParams
from photon.tokenizer import Tokenizer


@dataclass
class _Sequence:
    detokenizer: IncrementalDetokenizer | None
    num_tokens: int = 0
    finished: bool = False


@dataclass
class _Request:
    user_id: str  # the caller's request id (the core knows the request by another)
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[_Sequence] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, user_id: str, prompt_ids: list[int], params: SamplingParams,
            arrival_time: float) -> None:
        """`request_id`: the core's id of the request; its outputs carry `user_id`."""
        text = params.detokenize or bool(params.stop)
        seqs = [_Sequence(IncrementalDetokenizer(self.tokenizer, prompt_ids, params) if text
                          else None) for _ in range(params.n)]
        self.requests[request_id] = _Request(user_id, prompt_ids, params, arrival_time, seqs)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, delta: RequestDelta) -> tuple[RequestOutput | None, list[str]]:
        """The request's output for this delta (None: unknown or already finished here) and
        the child ids a stop string finished (to abort in the core)."""
        req = self.requests.get(delta.request_id)
        if req is None:
            return None, []
        stopped: list[str] = []
        outs = []
        for child in delta.children:
            seq = req.sequences[child.index]
            out = self._child_output(req, seq, child)
            if out.finish_reason == "stop" and child.finish_reason is None:
                stopped.append(delta.request_id if req.params.n == 1
                               else f"{delta.request_id}-{child.index}")
            outs.append(out)
        finished = delta.finished or all(s.finished for s in req.sequences)
        if finished:
            del self.requests[delta.request_id]
        if delta.error is not None and not outs:  # rejected by the core before it ran
            outs = [CompletionOutput(i, "", [], finish_reason="abort") for i in
                    range(req.params.n)]
        prompt_lps = _with_texts(delta.prompt_logprobs, self._texts(req))
        return RequestOutput(req.user_id, None, req.prompt_token_ids, outs, finished,
                             RequestMetrics(req.arrival_time, delta.first_scheduled_time,
                                            delta.first_token_time),
                             prompt_lps, delta.num_cached_tokens, delta.error,
                             delta.kv_transfer_params), stopped

    def _texts(self, req: _Request) -> TokenTexts | None:
        return self.texts if req.params.detokenize else None

    def _child_output(self, req: _Request, seq: _Sequence, child: ChildDelta
                      ) -> CompletionOutput:
        if seq.finished:  # stopped here earlier: the core's later tokens are dropped
            return CompletionOutput(child.index, "", [])
        tokens: list[int] = []
        finish, stop_reason = child.finish_reason, child.stop_reason
        for tok in child.token_ids:
            tokens.append(tok)
            seq.num_tokens += 1
            check = seq.num_tokens >= req.params.min_tokens
            stop = seq.detokenizer.update(tok, check) if seq.detokenizer is not None else None
            if stop is not None:
                if finish in (None, "length"):  # EOS and stop ids are checked first in-process
                    finish, stop_reason = "stop", stop
                break
        seq.finished = finish is not None
        det = seq.detokenizer
        lps = child.logprobs[:len(tokens)] if child.logprobs is not None else None
        return CompletionOutput(
            index=child.index,
            text=det.get_delta(finished=seq.finished) if det is not None else "",
            token_ids=tokens,
            cumulative_logprob=child.cumulative_logprob,
            logprobs=_with_texts(lps, self._texts(req)),
            finish_reason=finish,
            stop_reason=stop_reason if finish is not None else None)


def _with_texts(entries: list[dict[int, Logprob] | None] | None, texts: TokenTexts | None
                ) -> list[dict[int, Logprob] | None] | None:
    """Fill each Logprob's `decoded_token` (the core sends none)."""
    if entries is None or texts is None:
        return entries
    for entry in entries:
        if entry is not None:
            for tid, lp in entry.items():
                lp.decoded_token = texts(tid)
    return entries
