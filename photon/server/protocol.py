"""OpenAI protocol models (pydantic). Requests accept and ignore unknown fields, as vLLM does.

Value ranges are checked by `SamplingParams` (one source of truth, clear messages -> 400); the
models here check types only, plus a cap on `n` so one request cannot create unbounded work.
Types are checked strictly where JSON's loose values would be silently reinterpreted: a boolean
is never a number, token ids are JSON integers, numbers are finite in float32 (the precision the
sampling parameters are used in), and text is valid Unicode (JSON can spell a lone UTF-16
surrogate, which no tokenizer can encode).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Request):
    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Request):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None = None


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "photon"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None  # photon's addition: token-id prompts must stay below it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


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
