"""photon: an LLM inference engine whose GPU never waits for Python."""

from __future__ import annotations

from photon.engine_args import EngineArgs
from photon.llm import LLM
from photon.lora.request import LoRARequest
from photon.outputs import CompletionOutput, Logprob, RequestOutput
from photon.sampling_params import SamplingParams
from photon.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "EngineArgs", "LoRARequest"]
__version__ = "0.1.0"
