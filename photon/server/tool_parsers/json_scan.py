"""Incremental reading of tool-call JSON: `{"name": ..., "arguments": {...}}` objects, alone or
in a sequence (`[a, b]` or `a; b`), from text that may still be growing.

A scan never guesses: `name` is set once its string is complete, `args` is the raw JSON text of
the arguments object (a prefix of it while the object is still open), `end` once the call object
is closed. Raw text only grows, so what has been streamed of `args` stays a prefix of the final
value. Malformed text simply never completes; callers judge it once the text is final (or a
closing marker arrived).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def skip_ws(text: str, i: int) -> int:
    match = _WS.match(text, i)
    return match.end() if match else i


def _decode(text: str, i: int) -> tuple[Any, int] | None:
    """The complete JSON value at text[i:] and the index after it; None if it is incomplete or
    invalid."""
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


@dataclass
class CallScan:
    name: str | None = None
    args: str | None = None  # raw JSON text of the arguments object (a prefix while open)
    args_done: bool = False
    end: int | None = None  # index after the call object's closing brace, once closed

    @property
    def valid(self) -> bool:
        return self.end is not None and self.name is not None and self.args_done


def scan_call(text: str, pos: int, arg_keys: tuple[str, ...]) -> CallScan:
    """Read the call object starting (after whitespace) at text[pos:]."""
    scan, n = CallScan(), len(text)
    i = skip_ws(text, pos)
    if i >= n or text[i] != "{":
        return scan
    i = skip_ws(text, i + 1)
    if i < n and text[i] == "}":
        scan.end = i + 1  # an empty object: closed, never valid
        return scan
    while i < n:
        key = _decode(text, i)
        if key is None or not isinstance(key[0], str):
            return scan
        i = skip_ws(text, key[1])
        if i >= n or text[i] != ":":
            return scan
        i = skip_ws(text, i + 1)
        value_end = _scan_value(text, i, key[0], arg_keys, scan)
        if value_end is None:
            return scan
        i = skip_ws(text, value_end)
        if i < n and text[i] == "}":
            scan.end = i + 1
            return scan
        if i >= n or text[i] != ",":
            return scan
        i = skip_ws(text, i + 1)
    return scan


def _scan_value(text: str, i: int, key: str, arg_keys: tuple[str, ...], scan: CallScan
                ) -> int | None:
    """Record the value of `key` at text[i:] in `scan`; the index after it, or None while it is
    incomplete (or unusable)."""
    if i >= len(text):
        return None
    if key in arg_keys:
        if text[i] != "{":  # arguments are a JSON object
            return None
        value = _decode(text, i)
        scan.args = text[i:value[1]] if value else text[i:]
        scan.args_done = value is not None
        return value[1] if value else None
    value = _decode(text, i)
    if value is None:
        return None
    if key == "name":
        if not isinstance(value[0], str) or not value[0]:
            return None
        scan.name = value[0]
    return value[1]


@dataclass(frozen=True)
class SequenceFormat:
    """How calls are laid out: inside `opener`...`closer` (a JSON array) or bare, separated by
    `separator`; `arg_keys` name the arguments field (the first one present is used)."""

    separator: str
    arg_keys: tuple[str, ...]
    opener: str = ""
    closer: str = ""


@dataclass
class SequenceScan:
    calls: list[CallScan] = field(default_factory=list)
    end: int | None = None  # index after the sequence, once it is known to be over
    bad: bool = False  # can no longer be a well-formed sequence of calls


def scan_sequence(text: str, pos: int, fmt: SequenceFormat, final: bool) -> SequenceScan:
    seq, n = SequenceScan(), len(text)
    i = skip_ws(text, pos)
    if fmt.opener:
        if i >= n:
            seq.bad = final
            return seq
        if text[i] != fmt.opener:
            seq.bad = True
            return seq
        i = skip_ws(text, i + 1)
    while True:
        if i >= n:  # nothing yet, or a separator at the very end
            if final and seq.calls and not fmt.closer:
                seq.end = n
            else:
                seq.bad = final
            return seq
        call = scan_call(text, i, fmt.arg_keys)
        seq.calls.append(call)
        if call.end is None or not call.valid:
            seq.bad = final or call.end is not None or text[i] != "{"
            return seq
        j = skip_ws(text, call.end)
        if j < n and text[j] == fmt.separator:
            i = skip_ws(text, j + 1)
            continue
        if fmt.closer:
            if j < n and text[j] == fmt.closer:
                seq.end = j + 1
            else:
                seq.bad = final or j < n
            return seq
        if j < n or final:  # bare calls: any other text (or the end) ends the sequence
            seq.end = call.end
        return seq
