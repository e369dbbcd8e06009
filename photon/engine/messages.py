"""The messages between the front end (`AsyncLLM`) and the engine-core process (`core_proc`).

Front end -> core: `AddRequest` (a request the front end already checked), `Abort` (request ids,
or child sequence ids of an n > 1 request), `Utility`, `Wake` (lockstep cores: another core got
a request), `Shutdown`. Core -> front end: one `StepOutputs` per engine step with every touched
request's delta (new token ids, finish, logprobs), the answers to adds (refusals, and the
acceptance of each request with a LoRA adapter) and the engine's stats, and `CoreError` last if
the core's loop raised. All of it is msgspec-encoded msgpack: plain values and dataclasses, never
pickle.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from photon.engine.engine_core import EngineStats
from photon.errors import AdapterNotFoundError
from photon.lora.registry import LoRAAdapters
from photon.lora.request import LoRARequest
from photon.outputs import Logprob
from photon.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() of the front end (one clock per machine)
    client: int = 0  # which front end sent it: its outputs go back there
    kv_transfer_params: dict[str, Any] | None = None  # disaggregation (photon.kv_transfer)
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]  # parent ids, or child ids (`{parent}-{index}`) of n > 1 requests


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Utility(msgspec.Struct, tag="utility", array_like=True):
    """Run one of the core's utility methods between two steps (`core_proc.UTILITIES`); its
    result comes back in a `StepOutputs`."""

    call_id: int
    method: str
    client: int = 0
    args: list[str] = []  # the method's arguments after the core


class Wake(msgspec.Struct, tag="wake", array_like=True):
    """Lockstep cores (photon.engine.lockstep): another core was sent a request, so this one
    joins the steps; one goes to every other core with each AddRequest."""


CoreInput = AddRequest | Abort | Shutdown | Utility | Wake


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    value: int | str | LoRAAdapters | None = None
    error: str | None = None  # the method raised (an AssertionError's message, for checks)


class ChildDelta(msgspec.Struct, array_like=True):
    """What one sequence of a request produced since the last step (usually one token)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # without text: the front end decodes it


# Why the core refused an AddRequest: its adapter is not served (any more), a ValueError of its
# checks, anything else.
Refusal = Literal["model_not_found", "invalid", "internal"]


class RequestDelta(msgspec.Struct, array_like=True):
    """A request's news since the last step. The core also answers each AddRequest of an
    adapter request at once (the front end awaits it: the core checks the adapter): `accepted`
    (nothing else in it), or `refused` (finished, with `error`). Other requests are answered
    only when refused."""

    request_id: str
    children: list[ChildDelta]
    finished: bool
    first_scheduled_time: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # sent once, when complete
    num_cached_tokens: int | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's final output
    accepted: bool = False
    refused: Refusal | None = None
    first_token_time: float | None = None


def refusal(e: Exception) -> Refusal:
    """The kind of the exception the core's add_request raised."""
    if isinstance(e, AdapterNotFoundError):
        return "model_not_found"
    return "invalid" if isinstance(e, ValueError) else "internal"


def refusal_error(kind: Refusal, message: str, lora_name: str) -> Exception:
    """What the front end's add_request raises for the core's refusal (the exception the
    in-process engine's add_request raises)."""
    if kind == "model_not_found":
        return AdapterNotFoundError(lora_name, message)
    return ValueError(message) if kind == "invalid" else RuntimeError(message)


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    requests: list[RequestDelta]
    stats: EngineStats
    step_s: float | None  # the step's duration (None: no step ran, e.g. a rejected add)
    gap_s: float | None  # host time between this step and the previous one
    utility: list[UtilityResult] = []


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    """The core's first message once its engine is built."""

    num_blocks: int
    pid: int


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    """The core's first message when building its engine failed (it exits after it)."""

    kind: str  # the exception's type name
    message: str


CoreStarted = CoreReady | CoreFailed


class CoreError(msgspec.Struct, tag="error", array_like=True):
    """The core's last message when its loop raised after start-up (it exits after it): every
    request still open, and every later one, fails with this cause."""

    kind: str  # the exception's type name
    message: str

    def describe(self) -> str:
        return f"the engine core failed: {self.kind}: {self.message}"


CoreOutput = StepOutputs | CoreError
