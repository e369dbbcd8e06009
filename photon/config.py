"""Frozen, validated configuration: the `EngineConfig` every component reads.

`photon.engine_args.EngineArgs` is what users write (vLLM's names, flat); its `create_config()`
validates it once and returns the frozen `EngineConfig`. Nothing mutates a config after that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from photon.structured.params import GrammarLimits

if TYPE_CHECKING:
    from photon.generation_config import GenerationDefaults
    from photon.kv_events.config import KVEventsConfig
    from photon.kv_transfer.config import KVTransferConfig
    from photon.lora.config import LoRAConfig
    from photon.quant.config import QuantConfig
    from photon.spec.config import SpeculativeConfig



class ConfigError(ValueError):
    """A user-facing configuration mistake (bad engine arg, missing model file...)."""


@dataclass(frozen=True)
class ModelConfig:
    model: str  # local directory of a Hugging Face model (a hub id's snapshot directory)
    hf_config: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    seed: int
    served_model_name: str
    load_format: str = "auto"
    # The model's default sampling parameters (--generation-config); None: photon's own defaults.
    generation_defaults: GenerationDefaults | None = None
    # The layers run photon.kernels' Triton kernels on CUDA tensors (else the torch ops).
    # create_config: on CUDA when triton imports, unless the environment has PHOTON_TRITON=0.
    use_triton: bool = False
    # The linear layers' quantization (--quantization, or the checkpoint's quantization_config);
    # None: unquantized.
    quant_config: QuantConfig | None = None

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    # --kv-cache-dtype (vLLM's name): auto = the model's dtype; fp8 / fp8_e4m3 = float8 e4m3
    # with per-layer per-KV-head scales (photon.attention.kv_quant).
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # FP8 scales from the first forward (no checkpoint scales)

    @property
    def fp8_kv(self) -> bool:
        return self.cache_dtype != "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


GRAMMAR_WORKERS = ("process", "inline")
MASK_WAITS = ("device", "host")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The --structured-outputs-* engine arguments. Their defaults live in EngineArgs only; the
    fields are checked here, so a config built by hand is checked too (messages name the flags)."""

    backend: str  # the grammar library (photon.structured.backend's registry)
    timeout_s: float  # a request's grammar may take this long to compile, from its arrival
    threads: int  # threads filling a step's next-token masks
    worker: str  # process: a grammar-worker process; inline: the engine thread
    mask_wait: str  # device: the GPU waits for the masks; host: the engine thread does
    max_chars: int  # longest spec, in characters; 0 = no limit
    max_choices: int  # most entries in a choice list; 0 = no limit
    cache_mb: int  # compiled grammars kept for reuse, in MiB

    def __post_init__(self) -> None:
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"structured_outputs_timeout must be a number of seconds > 0, "
                              f"got {timeout!r}")
        object.__setattr__(self, "timeout_s", float(timeout))
        check_positive("structured_outputs_threads", self.threads)
        check_choice("structured_outputs_worker", self.worker, GRAMMAR_WORKERS)
        check_choice("structured_outputs_mask_wait", self.mask_wait, MASK_WAITS)
        for name in ("max_chars", "max_choices", "cache_mb"):
            check_non_negative(f"structured_outputs_{name}", getattr(self, name))
        check_grammar_backend(self.backend)

    @property
    def cache_bytes(self) -> int:
        return self.cache_mb << 20

    @property
    def limits(self) -> GrammarLimits:
        return GrammarLimits(self.max_chars, self.max_choices)


# The MoE families: their config.json fields for (the number of experts, one expert's
# intermediate size).
MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
                     "MixtralForCausalLM": ("num_local_experts", "intermediate_size")}
# The decoders of photon.model.llama's graph: their layers take a tensor-parallel group.
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                 "Qwen3ForCausalLM", *MOE_ARCHITECTURES)


# The values of --distributed-executor-backend (photon.distributed.launchers).
EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """--tensor-parallel-size: ranks, one process each (rank 0 in the engine core's process);
    --enable-expert-parallel: an MoE model's experts are partitioned over those ranks;
    --data-parallel-size: engine cores behind one front end (each with its own TP ranks). With
    both of the last two the experts are partitioned over the data-parallel cores instead
    (`experts_span_cores`: data-parallel attention, expert-parallel MoE layers);
    --distributed-executor-backend: what starts ranks 1..N-1 (photon.distributed.launchers)."""

    tensor_parallel_size: int = 1
    # A collective waiting longer than this for a rank ends the engine (a rank died or hangs).
    collective_timeout_s: float = 60.0
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    # This engine core's rank among the data_parallel_size cores (set per core when spawned).
    data_parallel_rank: int = 0
    # The rendezvous (a TCPStore the front end bound on a free port) of the expert-parallel
    # group that spans the cores; set by the front end when the experts span the cores.
    data_parallel_master_ip: str = "127.0.0.1"
    data_parallel_master_port: int = 0
    # "mp": spawned processes on this host; "ray": Ray actors placed on a Ray cluster.
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        check_choice("distributed_executor_backend", self.distributed_executor_backend,
                     EXECUTOR_BACKENDS)
        check_positive("data_parallel_size", self.data_parallel_size)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ConfigError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                              f"got {self.data_parallel_rank!r}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective timeout must be > 0 seconds, "
                              f"got {self.collective_timeout_s!r}")

    @property
    def experts_span_cores(self) -> bool:
        """An MoE model's experts are partitioned over the data-parallel cores, which then step
        in lockstep (photon.engine.lockstep)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    def check_model(self, architecture: str, hf_config: dict[str, Any]) -> None:
        """The model has a tensor-parallel layout and its heads and widths split evenly over the
        ranks (ConfigError otherwise)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        name = flag("tensor_parallel_size")
        if architecture not in TENSOR_PARALLEL_ARCHITECTURES:
            raise ConfigError(f"{name}={tp}: {architecture} has no tensor-parallel layout yet; "
                              f"supported: {', '.join(TENSOR_PARALLEL_ARCHITECTURES)}")
        heads = int(hf_config["num_attention_heads"])
        kv_heads = int(hf_config.get("num_key_value_heads") or heads)
        if heads % tp:
            raise ConfigError(f"{name}={tp} must divide the model's num_attention_heads={heads}")
        if (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
            raise ConfigError(
                f"{name}={tp} and the model's num_key_value_heads={kv_heads}: the KV heads "
                f"must split evenly over the ranks, or (fewer heads than ranks) the ranks "
                f"evenly over the heads")
        if architecture in MOE_ARCHITECTURES:
            self._check_experts(architecture, hf_config)
        if MOE_ARCHITECTURES.get(architecture, ("", ""))[1] == "intermediate_size":
            return  # the experts' size (Mixtral): checked above
        inter = int(hf_config.get("intermediate_size") or 0)
        if inter % tp:
            raise ConfigError(f"{name}={tp} must divide the model's intermediate_size={inter}")

    def check_expert_parallel(self, architecture: str) -> None:
        """--enable-expert-parallel needs a mixture-of-experts model."""
        if self.enable_expert_parallel and architecture not in MOE_ARCHITECTURES:
            raise ConfigError(f"{flag('enable_expert_parallel')}: {architecture} has no experts; "
                              f"expert parallelism applies to {', '.join(MOE_ARCHITECTURES)}")

    def check_experts_span_cores(self, architecture: str, hf_config: dict[str, Any]) -> None:
        """--data-parallel-size N --enable-expert-parallel: one rank per core (attention
        tp = 1) and at least one expert per core."""
        if not self.experts_span_cores:
            return
        dp = self.data_parallel_size
        if self.tensor_parallel_size > 1:
            raise ConfigError(
                f"{flag('data_parallel_size')}={dp} with {flag('enable_expert_parallel')}: the "
                f"experts are partitioned over the data-parallel cores, each with one rank; "
                f"{flag('tensor_parallel_size')}={self.tensor_parallel_size} is not supported "
                f"with it yet (use 1)")
        experts_field = MOE_ARCHITECTURES[architecture][0]
        experts = int(hf_config.get(experts_field) or hf_config.get("num_local_experts") or 0)
        if experts < dp:
            raise ConfigError(f"{flag('data_parallel_size')}={dp} with expert parallelism: the "
                              f"model has {experts_field}={experts}, fewer experts than cores")

    def _check_experts(self, architecture: str, hf_config: dict[str, Any]) -> None:
        """With expert parallelism every rank holds at least one expert; without it, each
        expert's intermediate dimension splits evenly."""
        tp, name = self.tensor_parallel_size, flag("tensor_parallel_size")
        experts_field, inter_field = MOE_ARCHITECTURES[architecture]
        if self.enable_expert_parallel:
            # Qwen3-MoE's config.json may name the count num_local_experts, as Mixtral does
            experts = int(hf_config.get(experts_field) or hf_config.get("num_local_experts") or 0)
            if experts < tp:
                raise ConfigError(f"{name}={tp} with expert parallelism: the model has "
                                  f"{experts_field}={experts}, fewer experts than ranks")
            return
        inter = int(hf_config.get(inter_field) or 0)
        if inter % tp:
            raise ConfigError(f"{name}={tp} must divide the model's {inter_field}={inter} (each "
                              f"expert is split over the ranks; or pass "
                              f"--enable-expert-parallel to give each rank whole experts)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    pipelined: bool
    enforce_eager: bool
    attention_backend: str  # resolved: never "auto"
    structured_outputs: StructuredOutputsConfig
    reasoning_parser: str | None = None
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events_config: KVEventsConfig | None = None  # None: no KV cache events
    kv_transfer_config: KVTransferConfig | None = None  # None: no prefill/decode disaggregation
    lora_config: LoRAConfig | None = None  # None: no LoRA adapters (--enable-lora off)

    def __post_init__(self) -> None:
        if self.parallel.experts_span_cores:
            self._check_lockstep_features()

    def _check_lockstep_features(self) -> None:
        """The features whose extra forwards or per-forward state the lockstep cores'
        dummy steps do not reproduce yet (ConfigError naming the first one set)."""
        unsupported = [("speculative_config", self.speculative_config is not None),
                       ("enable_lora", self.lora_config is not None),
                       ("kv_transfer_config", self.kv_transfer_config is not None),
                       ("calculate_kv_scales", self.cache.calculate_kv_scales)]
        for name, given in unsupported:
            if given:
                raise ConfigError(
                    f"{flag(name)} is not supported with {flag('data_parallel_size')} > 1 and "
                    f"{flag('enable_expert_parallel')} (experts spanning the data-parallel "
                    f"cores) yet")

    @property
    def pipeline_depth(self) -> int:
        return 2 if self.pipelined else 1


def flag(name: str) -> str:
    """An engine argument as users write it: `max_model_len (--max-model-len)`."""
    return f"{name} (--{name.replace('_', '-')})"


def json_object_arg(value: str | Mapping[str, Any], name: str, example: str
                    ) -> Mapping[str, Any]:
    """A JSON-object engine argument as given (a JSON string from the CLI, a dict from the
    Python API) -> the mapping; ConfigError naming the argument `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} must be a JSON object such as {example}; {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a JSON object (a dict in Python) such as "
                          f"{example}; got {value!r}")
    return value


def check_kv_capacity(usable_blocks: int, block_size: int, max_model_len: int,
                      remedy: str) -> None:
    """Refuse to start when one max_model_len request cannot fit the KV cache (as vLLM does):
    the engine would start, then fail every long request. `remedy`: how to get more blocks."""
    need = -(-max_model_len // block_size)
    if usable_blocks >= need:
        return
    fits = usable_blocks * block_size
    lower = f", or lower {flag('max_model_len')} to at most {fits}" if fits else ""
    raise ConfigError(
        f"the KV cache has {usable_blocks} blocks of {block_size} tokens ({fits} tokens), but one "
        f"request of max_model_len={max_model_len} tokens needs {need} blocks; {remedy}{lower}")

def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value

def check_grammar_backend(name: str) -> None:
    from photon.structured.backend import GRAMMAR_BACKENDS

    if name not in GRAMMAR_BACKENDS:
        raise ConfigError(f"structured_outputs_backend: {GRAMMAR_BACKENDS.unknown(name)}")

def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")

def check_non_negative(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
