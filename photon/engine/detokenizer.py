"""Per-request incremental detokenization and stop-string detection.

Decoding uses vLLM's prefix/read offsets: each step decodes only a short window of tokens,
`ids[prefix_offset:]`, and emits what it adds beyond `ids[prefix_offset:read_offset]`. The
offsets advance only when the window's text does not end in U+FFFD, i.e. when the decoded text
ends on a complete character, so a multi-byte character split across tokens is never emitted
half-way (the replacement char appears only once the bytes are known to be invalid).

Invariants:
- `output_text == self._text + self._held`: `_text` is confirmed text; `_held` is the decoded
  text of tokens after `read_offset` that still ends in U+FFFD (it may complete next step).
- `_sent <= len(_text)`, and while unfinished `_sent <= len(_text) - (max_stop_len - 1)`, so a
  stop string (which always ends in newly confirmed text) never starts before `_sent`.
"""

from __future__ import annotations

from photon.sampling_params import SamplingParams
from photon.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context (SentencePiece leading spaces)
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Detokenizing is skipped only when nothing needs text (no output text, no stop strings).
        self._active = params.detokenize or bool(self._stops)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._held = ""
        self._sent = 0
        self._stopped = False
        self._lazy = 0  # tokens appended but not yet decoded (only without stop strings)

    @property
    def output_text(self) -> str:
        self._catch_up()
        return self._text + self._held

    def update(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one output token; return the stop string it completed, else None.

        `check_stop=False` (the request has fewer than `min_tokens` outputs): stop strings are
        not looked for in this token's text, and a stop string there neither ends nor truncates
        the output (as vLLM, which checks them only from `min_tokens` on).

        Without stop strings nothing needs the text at commit time, so decoding is deferred to
        the next read of the text (one decode for all pending tokens, off the per-step path)."""
        if not self._active or self._stopped:
            return None
        self._ids.append(token_id)
        if not self._stops:
            self._lazy += 1
            return None
        return self._add_decoded(check_stop)

    def _catch_up(self) -> None:
        if self._lazy:
            self._lazy = 0
            self._add_decoded()

    def _add_decoded(self, check_stop: bool = True) -> str | None:
        new_text = self._decode_new()
        if not new_text:
            return None
        start = len(self._text)
        self._text += new_text
        return self._check_stop(start, len(new_text)) if check_stop else None

    def _decode_new(self) -> str:
        """Decode the window; return newly confirmed text (possibly ""), updating `_held`."""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        full = decode(self._ids[self._prefix_offset:], self._skip_special)
        if len(full) <= len(prefix):
            return ""  # e.g. a skipped special token: nothing new yet
        if full.endswith(_REPLACEMENT):  # maybe a partial UTF-8 char: wait for the next token
            self._held = full[len(prefix):]
            return ""
        self._held = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]

    def _check_stop(self, start: int, new_len: int) -> str | None:
        """Find the earliest stop string ending in the newly added text and truncate there."""
        if not self._stops:
            return None
        # A new match must end after `start`, so it begins at or after this position.
        lo = max(0, start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = self._text.find(stop, lo)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self._text = self._text[: idx + len(stop) if self._include_stop else idx]
        self._held = ""
        self._stopped = True
        return stop

    def get_delta(self, finished: bool = False) -> str:
        """Text not returned by earlier calls; holds back a possible stop-string prefix.

        While unfinished, the last `max_stop_len - 1` characters (and any partial character) are
        withheld so a stop string that is later matched and removed is never streamed.
        `finished=True` flushes everything.
        """
        self._catch_up()
        text = self.output_text if (finished or self._stopped) else self._text
        end = len(text)
        if not (finished or self._stopped) and self._max_stop_len > 1:
            end = max(self._sent, end - (self._max_stop_len - 1))
        delta = text[self._sent:end]
        self._sent = end
        return delta

    @property
    def finished_by_stop(self) -> bool:
        return self._stopped
