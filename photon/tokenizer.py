"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` plus the model's chat template.

Only `tokenizer.json` (+ the optional JSON configs next to it) is read; `transformers` is never
imported at run time. BOS handling follows tokenizer.json's post-processor, exactly as HF's fast
tokenizers do with `add_special_tokens=True`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from photon.config import ConfigError


def _read_json(model_dir: str, name: str) -> dict[str, Any]:
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _load_chat_template(model_dir: str, tok_config: dict[str, Any]) -> str | None:
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):  # transformers >= 4.43 saves the template here; it takes priority
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; chat templates expect plain JSON.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> Any:
    """Compile like transformers does: sandboxed, trim_blocks + lstrip_blocks, loop controls.
    Raises jinja2.TemplateSyntaxError for a template that does not parse."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def resolve_chat_template(value: str) -> str:
    """vLLM's `--chat-template`: the path of a Jinja file, or the template itself. Checked here:
    a template that does not parse, or a path that names no file, is a ValueError."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"chat template {value!r} looks like a file path, but there is no such "
                         f"file (give a Jinja file's path or the template text itself)")
    from jinja2 import TemplateSyntaxError

    try:
        compile_chat_template(value)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None
    return value


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, *, eos_token_ids: Iterable[int] = (),
                 bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = tokenizer.token_to_id(bos_token) if bos_token else None
        eos = set(eos_token_ids)
        if eos_token and tokenizer.token_to_id(eos_token) is not None:
            eos.add(tokenizer.token_to_id(eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._compiled_template: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the grammar worker gets a copy): the compiled chat template is rebuilt on
        first use instead of pickled (Jinja templates are not picklable)."""
        return {**self.__dict__, "_compiled_template": None}

    @classmethod
    def from_pretrained(cls, model_dir: str) -> Tokenizer:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model directory {model_dir!r} has no tokenizer.json "
                              f"(photon needs a fast tokenizer file)")
        tok_config = _read_json(model_dir, "tokenizer_config.json")
        eos_ids = (_as_ids(_read_json(model_dir, "generation_config.json").get("eos_token_id"))
                   + _as_ids(_read_json(model_dir, "config.json").get("eos_token_id")))
        return cls(_HFTokenizer.from_file(path), eos_token_ids=eos_ids,
                   bos_token=_token_content(tok_config.get("bos_token")),
                   eos_token=_token_content(tok_config.get("eos_token")),
                   chat_template=_load_chat_template(model_dir, tok_config))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True
                     ) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Ids outside the vocabulary (padded embedding rows) decode to nothing.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_str(self) -> str:
        """The tokenizer.json content (decoder, pre-tokenizer...)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            chat_template: str | None = None,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """Render a Jinja chat template (sandboxed), like HF `tokenize=False`: the model's, or
        `chat_template` (its source). `kwargs` reach the template as variables (vLLM's
        `chat_template_kwargs`, e.g. `enable_thinking`). `continue_final_message`: the text ends
        with the last message's content, open for the model to continue (as transformers)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true; set add_generation_prompt to false to continue the final "
                             "message")
        template = self._template(chat_template)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "tools": None, **kwargs, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        text = template.render(**context)
        if continue_final_message and messages:
            text = _cut_after_final(text, messages[-1].get("content"))
        return text

    def _template(self, source: str | None) -> Any:
        if source is not None:
            return compile_chat_template(source)
        if self._compiled_template is None:
            if not self.chat_template:
                raise ValueError(
                    "this model has no chat template (no 'chat_template' in tokenizer_config.json "
                    "and no chat_template.jinja); give one (--chat-template, or chat_template= "
                    "in LLM.chat) or use the completions API with a raw prompt")
            self._compiled_template = compile_chat_template(self.chat_template)
        return self._compiled_template


def _cut_after_final(text: str, final: Any) -> str:
    """The rendered text up to the end of the final message's content (templates may strip it)."""
    if isinstance(final, list):  # content parts: the last text part
        texts = [p.get("text") for p in final if isinstance(p, dict) and p.get("text")]
        final = texts[-1] if texts else ""
    final = final if isinstance(final, str) else ""
    for needle in (final, final.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[:at + len(needle)]
    raise ValueError("continue_final_message: the chat template did not render the final "
                     "message's content, so there is nothing to continue")
