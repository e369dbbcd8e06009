"""The output of a forced tool choice, generated under a JSON-schema constraint: for a named
function the arguments object itself; for `required` a JSON array of
`{"name": ..., "parameters": {...}}`. Not registered: the server picks these from the request."""

from __future__ import annotations

from photon.server.tool_parsers.base import CallRegion, Region, ToolParser, sequence_regions
from photon.server.tool_parsers.json_scan import CallScan, SequenceFormat

_REQUIRED = SequenceFormat(separator=",", arg_keys=("parameters",), opener="[", closer="]")


class NamedCallParser(ToolParser):
    """The whole output is the arguments of `function` (also when cut short by max_tokens, as
    vLLM returns it; the finish_reason then says "length")."""

    def __init__(self, function: str) -> None:
        self.function = function

    def regions(self, text: str, final: bool) -> list[Region]:
        return [CallRegion(text, [CallScan(name=self.function, args=text, args_done=final,
                                           end=len(text) if final else None)])]


class RequiredCallsParser(ToolParser):
    def regions(self, text: str, final: bool) -> list[Region]:
        return sequence_regions(text, 0, 0, _REQUIRED, final)
