"""OpenAI protocol models (pydantic). Requests accept unknown fields, as vLLM does, but an OpenAI
or vLLM field photon does not implement is refused (`unsupported_fields`): never silently ignored.

Value ranges are checked by `SamplingParams` (one source of truth, clear messages -> 400); the
models here check types only, plus a cap on `n` so one request cannot create unbounded work.
Types are checked strictly where JSON's loose values would be silently reinterpreted: a boolean
is never a number, token ids are JSON integers, numbers are finite in float32 (the precision the
sampling parameters are used in), and text is valid Unicode (JSON can spell a lone UTF-16
surrogate, which no tokenizer can encode).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt
from pydantic.types import AllowInfNan

from photon.server.validation import (
    check_float32,
    check_prompt_shape,
    check_text,
    check_text_tree,
    not_bool,
)

MAX_N = 128  # completions per prompt
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles

Int = Annotated[int, BeforeValidator(not_bool)]
Float = Annotated[float, BeforeValidator(not_bool), AllowInfNan(False),
                  AfterValidator(check_float32)]
Text = Annotated[str, AfterValidator(check_text)]
JsonObject = Annotated[dict[str, Any], AfterValidator(check_text_tree)]
TokenIds = list[StrictInt]
Prompt = Annotated[Text | list[Text] | TokenIds | list[TokenIds], BeforeValidator(check_prompt_shape)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    # Known OpenAI / vLLM fields photon does not implement -> the values that ask for nothing
    # (accepted: clients send some defaults explicitly). None is always accepted.
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported_fields(self) -> list[str]:
        """The request's fields that ask for something photon does not implement."""
        extra = self.model_extra or {}
        return [name for name, neutral in self.UNSUPPORTED.items()
                if extra.get(name) is not None and not _is_neutral(extra[name], neutral)]


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # bool is an int in Python: `True in (1,)` would hold, so compare types too.
    return any(type(value) is type(n) and value == n for n in neutral)


_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    # vLLM sampling and serving extensions
    "use_beam_search": (False,), "length_penalty": (1.0, 1), "early_stopping": (False,),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "allowed_token_ids": (), "bad_words": ([],), "priority": (0,), "request_id": (),
    "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "cache_salt": (),
    "vllm_xargs": (), "prompt_embeds": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (), "structural_tag": (), "mm_processor_kwargs": (),
    "media_io_kwargs": (),
    # OpenAI
    "store": (False,), "service_tier": ("auto", "default"), "audio": (),
    "modalities": (["text"],), "prediction": (), "web_search_options": (), "verbosity": (),
}


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: Text | None = None
    description: Text | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` request field: exactly one of json, regex, choice, grammar
    (or json_object); any_whitespace / max_whitespace allow (bounded) free JSON whitespace."""

    json_: JsonObject | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    any_whitespace: bool = False
    max_whitespace: Int | None = None


class _SamplingFields(_Request):
    model: Text | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: dict[str, Float] | None = None  # token id (as a JSON key) -> bias
    best_of: Int | None = None  # only 1 (vLLM's V1 engine has no best_of either)
    # vLLM's older names for structured outputs (still accepted by vLLM)
    guided_json: JsonObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # vLLM's prefill/decode disaggregation: passed to the engine's KV connector as given (a
    # prefill request asks {"do_remote_decode": true}; a decode request carries what the prefill
    # response returned). One prompt and n=1 only.
    kv_transfer_params: JsonObject | None = None


class CompletionRequest(_SamplingFields):
    UNSUPPORTED = _UNSUPPORTED_COMMON

    prompt: Prompt
    max_tokens: Int | None = 16  # 0 with echo: only the prompt (and its logprobs) comes back
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_logprobs: Int | None = None


class ContentPart(_Request):
    type: Text
    text: Text | None = None


class FunctionDefinition(_Request):
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Request):
    """An entry of `tools`: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: Text


class NamedToolChoice(_Request):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Request):
    name: Text
    arguments: Text  # JSON text of the arguments object


class MessageToolCall(_Request):
    """A call in an assistant message's `tool_calls` (what an earlier response returned)."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: Text | None = None  # "tool" messages: the call this is the result of


class ChatCompletionRequest(_SamplingFields):
    UNSUPPORTED = {**_UNSUPPORTED_COMMON, "echo": (False,), "add_special_tokens": (False,),
                   "prompt_logprobs": (),
                   # OpenAI's deprecated function calling: use tools / tool_choice
                   "functions": (), "function_call": ()}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True  # False: at most one call
    continue_final_message: bool = False
    chat_template_kwargs: JsonObject | None = None


class TokenizeRequest(_Request):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JsonObject | None = None


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: TokenIds


# ---- responses (documented in the OpenAPI schema; handlers build plain dicts) -----------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the engine's KV connector


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the think block's text
    reasoning: str | None = None  # the same text under vLLM's newer name


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the engine's KV connector


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "photon"
    root: str | None = None  # a LoRA adapter's: its lora_path
    parent: str | None = None  # a LoRA adapter's: the base model (None: the base model itself)
    max_model_len: int | None = None
    vocab_size: int | None = None  # photon's addition: token-id prompts must stay below it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): serve the PEFT adapter at `lora_path` (a path
    on the server) under the model name `lora_name`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: Text
    lora_path: Text


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter: stop serving `lora_name` (requests already running with
    it finish first). vLLM's optional `lora_int_id` is accepted and not needed."""

    model_config = ConfigDict(extra="forbid")
    lora_name: Text
    lora_int_id: Int | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: str


class VersionResponse(BaseModel):
    version: str


def sse_event(data: dict[str, Any] | str) -> str:
    import json

    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {body}\n\n"
