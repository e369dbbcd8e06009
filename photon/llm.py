"""Offline batch API: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from tqdm.auto import tqdm

from photon.config import ConfigError, EngineConfig
from photon.engine.engine_core import EngineCore
from photon.engine_args import EngineArgs
from photon.lora.request import LoRARequest
from photon.outputs import RequestOutput
from photon.sampling_params import SamplingParams
from photon.tokenizer import resolve_chat_template

PromptType = str | Sequence[int]
Conversation = list[dict[str, Any]]  # chat messages: {"role": ..., "content": ...}


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; "
                            f"valid: {', '.join(EngineArgs.field_names())}")
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.config = self.engine_args.create_config()
        check_offline_parallel(self.config)
        self.engine = EngineCore(self.config)

    def get_tokenizer(self):  # noqa: ANN201 - photon.tokenizer.Tokenizer
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the model's generation_config.json
        defaults (`generation_config`), else SamplingParams(). Given SamplingParams are used
        as they are, as in vLLM."""
        defaults = self.config.model.generation_defaults
        return SamplingParams(**(defaults.as_kwargs() if defaults else {}))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        kv_transfer_params: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """kv_transfer_params (with --kv-transfer-config): one dict for every prompt, or one per
        prompt; a prefill instance's outputs carry those to send to the decode instance.
        lora_request (with enable_lora): the LoRA adapter of every prompt, or one per prompt
        (None: the base model)."""
        prompts = _as_prompt_list(prompts)
        kv_params = _as_kv_params_list(kv_transfer_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        params = _as_params_list(sampling_params if sampling_params is not None
                                 else self.get_default_sampling_params(), len(prompts))
        ids: list[str] = []
        try:
            for prompt, p, kvp, lora in zip(prompts, params, kv_params, loras):
                ids.append(self.engine.add_request(prompt, p, stream=False,
                                                   kv_transfer_params=kvp, lora_request=lora))
            with _interrupts_between_steps() as interrupted:
                return self._run(ids, use_tqdm, interrupted)
        except BaseException:
            # A bad prompt, a failed request or an interrupt (KeyboardInterrupt): nothing this
            # call added outlives it (the next call would run it first); all or nothing. The
            # engine holds only this call's requests, all finished now: the drain just ends
            # the steps in flight, so the engine is clean when the exception leaves.
            self.abort(ids)
            while self.engine.has_unfinished():
                self.engine.step()
            raise

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: render each conversation (one list of `{"role", "content"}`
        messages, or a list of them) with the chat template (the model's, or `chat_template`:
        a Jinja file's path or the template itself), then `generate` the rendered prompts.
        `chat_template_kwargs` become template variables (e.g. `{"enable_thinking": False}`);
        `tools` reach the template as `tools`."""
        conversations = _as_conversations(messages)
        template = None if chat_template is None else resolve_chat_template(chat_template)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=template,
                continue_final_message=continue_final_message, tools=tools,
                **(chat_template_kwargs or {}))
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by id (`RequestOutput.request_id`), as vLLM's engine `abort_request`:
        they produce nothing more; their steps already in flight end with the engine's next
        steps. Ids that are unknown or already finished are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            self.engine.abort(rid)

    def _run(self, ids: list[str], use_tqdm: bool,
             interrupted: threading.Event) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while self.engine.has_unfinished():
                if interrupted.is_set():
                    raise KeyboardInterrupt
                for out in self.engine.step():
                    if out.error is not None:  # e.g. its grammar did not compile
                        raise ValueError(f"request {out.request_id}: {out.error}")
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [finished[i] for i in ids]


@contextmanager
def _interrupts_between_steps() -> Iterator[threading.Event]:
    """Ctrl-C during `generate` is taken between two engine steps (the event is set and the loop
    raises KeyboardInterrupt there), so it never lands inside a step, whose in-flight bookkeeping
    it would tear. A second Ctrl-C interrupts at once. Only the main thread receives signals:
    elsewhere, or when a program installed its own SIGINT handler, nothing changes."""
    interrupted = threading.Event()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield interrupted
        return

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        interrupted.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, (list, tuple))
                                           and all(isinstance(t, int) for t in p)):
            raise ValueError(f"each prompt must be a string or a list of token ids, got {p!r:.80}")
    return prompts


def _as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    items = list(messages)
    if not items:
        raise ValueError("messages is empty; give a conversation (a list of messages) or a list "
                         "of conversations")
    if all(isinstance(m, dict) for m in items):
        return [items]  # one conversation
    if all(isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c)
           for c in items):
        return [list(c) for c in items]
    raise ValueError("messages must be a list of message dicts ({'role': ..., 'content': ...}) "
                     "or a list of such lists (one per conversation), none empty")


def _as_kv_params_list(values: object, n: int) -> list[dict[str, Any] | None]:
    if values is None or isinstance(values, dict):
        return [values] * n
    values = list(values)  # type: ignore[call-overload]
    if len(values) != n:
        raise ValueError(f"kv_transfer_params: got {len(values)} for {n} prompts")
    return values


def _as_lora_list(values: object, n: int) -> list[LoRARequest | None]:
    if values is None or isinstance(values, LoRARequest):
        return [values] * n
    values = list(values)  # type: ignore[call-overload]
    if len(values) != n:
        raise ValueError(f"lora_request: got {len(values)} for {n} prompts; give one or one each")
    return values


def _as_params_list(params: SamplingParams | Sequence[SamplingParams],
                    n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one or one each")
    return params


def check_offline_parallel(config: EngineConfig) -> None:
    """The offline LLM drives one engine in this process: data parallelism (several engine
    cores behind a load-balancing front end) is `photon serve`'s (ConfigError otherwise)."""
    dp = config.parallel.data_parallel_size
    if dp > 1:
        raise ConfigError(
            f"data_parallel_size (--data-parallel-size) = {dp}: the offline LLM (and photon "
            f"generate / photon bench) runs one engine; data parallelism needs the "
            f"engine-core processes of `photon serve --data-parallel-size {dp}` (use 1 here)")
