"""Request fields -> StructuredOutputsParams, and the early compile that turns a bad grammar into
a 400 before any response starts (on the front end's own compiler: `Frontend.structured`, or the
in-thread engine's, whose cache the engine then reuses)."""

from __future__ import annotations

import asyncio
from typing import Any

from photon.server.errors import bad_request
from photon.server.protocol import ResponseFormat, StructuredOutputsRequest, _SamplingFields
from photon.structured.params import StructuredOutputsParams

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _guided(req: _SamplingFields) -> StructuredOutputsRequest | None:
    """vLLM's older `guided_*` fields as a `structured_outputs` request (one at most)."""
    given = [name for name in _GUIDED if getattr(req, name) is not None]
    if not given:
        return None
    if req.structured_outputs is not None:
        given.append("structured_outputs")
    if len(given) > 1:
        raise bad_request(f"give only one of {', '.join(_GUIDED)} and structured_outputs; got "
                          f"{', '.join(given)}", given[0])
    return StructuredOutputsRequest(json=req.guided_json, regex=req.guided_regex,
                                    choice=req.guided_choice, grammar=req.guided_grammar)


def structured_params(req: _SamplingFields) -> StructuredOutputsParams | None:
    so, rf = _guided(req) or req.structured_outputs, req.response_format
    if so is not None and rf is not None and rf.type != "text":
        raise bad_request("give either response_format or structured_outputs, not both",
                          "response_format")
    try:
        if so is not None:
            return _from_structured_outputs(so)
        if rf is not None:
            return _from_response_format(rf)
    except ValueError as e:
        raise bad_request(str(e), "response_format" if rf is not None else
                          "structured_outputs") from None
    return None


def _from_structured_outputs(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                   grammar=so.grammar, json_object=so.json_object,
                                   any_whitespace=so.any_whitespace,
                                   max_whitespace=so.max_whitespace)


def _from_response_format(rf: ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise ValueError("response_format json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=rf.json_schema.schema_)


async def precompile(core: Any, spec: StructuredOutputsParams | None,
                     param: str = "structured_outputs") -> None:
    """Compile on the grammar pool (cached by spec); errors and timeouts are 400s."""
    if spec is None:
        return
    manager = core.structured
    try:
        fut = await asyncio.to_thread(manager.compile, spec)  # the first call builds the backend
        # shield: the wait's own timeout must not cancel the shared future; expire() fails it
        # for every request waiting on it and frees its compile slot
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), manager.config.timeout_s)
    except asyncio.TimeoutError:
        manager.expire(spec.key(), fut)
        raise bad_request(manager.timeout_message, param) from None
    except ValueError as e:
        raise bad_request(str(e), param) from None
