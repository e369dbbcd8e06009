"""Validators for request fields that JSON can spell but photon cannot use (pydantic hooks).

Each raises ValueError with a message that says what is wrong and what is allowed; the request
models attach the field's location, and the server answers 400 naming the field. Messages never
quote the offending text itself (it may not be encodable).
"""

from __future__ import annotations

from typing import Any

_PROMPT_SHAPES = ("a string, a list of strings, a list of token ids (integers) or a list of "
                  "lists of token ids")


def not_bool(value: Any) -> Any:
    """JSON true/false is not a number (pydantic's lax mode would read it as 1/0)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


FLOAT32_MAX = 3.4028234663852886e38


def check_float32(value: float) -> float:
    """Sampling numbers are used as float32 on the device: larger magnitudes become infinite."""
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"expected a finite number of magnitude at most {FLOAT32_MAX:.4g} "
                         f"(32-bit floating point), got {value:g}")
    return value


def _surrogate(text: str) -> int | None:
    """Index of the first lone UTF-16 surrogate in `text`, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_text(text: str) -> str:
    at = _surrogate(text)
    if at is not None:
        raise ValueError(f"the text has a lone UTF-16 surrogate (U+{ord(text[at]):04X}) at "
                         f"character {at}; text must be valid Unicode")
    return text


def check_text_tree(value: Any) -> Any:
    """check_text for every string (keys included) of a JSON value; iterative (deep nesting)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_text(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return type(value).__name__.replace("dict", "object").replace("list", "array")


def check_prompt_shape(prompt: Any) -> Any:
    """The completions `prompt`: one of the four shapes OpenAI allows, never a mix; the element
    that breaks the shape is named."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise ValueError(f"prompt must be {_PROMPT_SHAPES}; got {_describe(prompt)}")
    if all(isinstance(p, str) for p in prompt) or all(_is_token_id(t) for t in prompt):
        return prompt
    for i, item in enumerate(prompt):
        if not (isinstance(item, (str, list)) or _is_token_id(item)):
            raise ValueError(f"prompt[{i}] is {_describe(item)}; the prompt must be "
                             f"{_PROMPT_SHAPES}")
    if not all(isinstance(p, list) for p in prompt):
        raise ValueError(f"prompt mixes strings, token ids and lists; it must be {_PROMPT_SHAPES}")
    for i, ids in enumerate(prompt):
        bad = next((j for j, t in enumerate(ids) if not _is_token_id(t)), None)
        if bad is not None:
            raise ValueError(f"prompt[{i}][{bad}] is {_describe(ids[bad])}; token ids must be "
                             f"integers")
    return prompt
