"""`EngineArgs`: what users write (vLLM's names, flat; every field is also a CLI flag), and
`EngineArgs.create_config()`, which validates it once into the frozen `photon.config.EngineConfig`
that every component reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from photon.config import (
    EXECUTOR_BACKENDS,
    GRAMMAR_WORKERS,
    MASK_WAITS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    check_choice,
    check_positive,
    flag,
)
from photon.engine_resolve import (
    DEVICES,
    DTYPES,
    attention_backend,
    default_name,
    kv_events_config,
    kv_transfer_config,
    lora_config,
    parallel_config,
    quant_config,
    reasoning_parser,
    resolve_device,
    resolve_dtype,
    resolve_max_len,
    resolve_use_triton,
    speculative_config,
)
from photon.reasoning import reasoning_parser_names

if TYPE_CHECKING:
    from photon.kv_events.config import KVEventsConfig
    from photon.kv_transfer.config import KVTransferConfig
    from photon.spec.config import SpeculativeConfig


def _help(text: str, choices: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field metadata for the CLI: the flag's help and, for choice flags, the allowed values."""
    return {"help": text, "choices": choices} if choices else {"help": text}


_LOAD_FORMATS = ("auto", "dummy")


@dataclass
class EngineArgs:
    """Engine arguments, named as in vLLM. Every field is also a CLI flag (`--max-model-len`)."""

    model: str | None = field(default=None, metadata=_help(
        "A built-in model name, a local Hugging Face model directory or a Hugging Face hub id "
        "(e.g. Qwen/Qwen3-0.6B: downloaded, or read from the cache when offline). Default: the "
        "built-in photon-tiny (trained on Python's standard library); photon-tiny-draft is its "
        "speculative-decoding draft, photon-tiny-random has random weights (for tests)."))
    dtype: str = field(default="auto", metadata=_help(
        "Weights/activations dtype. auto = float32 on CPU, the checkpoint's dtype (bfloat16 if "
        "float32) on CUDA.", ("auto", *DTYPES)))
    max_model_len: int | None = field(default=None, metadata=_help(
        "Longest prompt + output in tokens. Default: the model's max_position_embeddings."))
    max_num_seqs: int = field(default=256, metadata=_help("Most requests in one step."))
    max_num_batched_tokens: int = field(default=8192, metadata=_help(
        "Most tokens (prefill + decode) in one step; long prompts are chunked to fit."))
    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "Fraction of GPU memory the engine may use (weights + activations + KV cache)."))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=_help(
        "KV cache size in bytes. Default: 256 MiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves (this flag overrides it)."))
    num_gpu_blocks_override: int | None = field(default=None, metadata=_help(
        "Force the number of KV blocks (testing preemption). Default: from the KV cache size."))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "Reuse KV blocks of shared prompt prefixes."))
    seed: int = field(default=0, metadata=_help("Seed for unseeded requests and weights init."))
    device: str = field(default="auto", metadata=_help(
        "Where the model runs; auto = cuda when available, else cpu.", DEVICES))
    pipelined: bool = field(default=True, metadata=_help(
        "Pipelined decoding (launch t+1 before committing t). --no-pipelined = blocking loop."))
    enforce_eager: bool = field(default=False, metadata=_help(
        "Disable CUDA graphs (decode steps' and the piecewise graphs of prefill and mixed "
        "steps)."))
    attention_backend: str = field(default="auto", metadata=_help(
        "Attention backend: auto (default: triton on CUDA, torch on CPU), torch or triton."))
    served_model_name: str | None = field(default=None, metadata=_help(
        "Model name reported by the API. Default: the hub id, or the model directory's name."))
    load_format: str = field(default="auto", metadata=_help(
        "auto: read *.safetensors; dummy: random weights of the model's shape (benchmarks).",
        _LOAD_FORMATS))
    quantization: str | None = field(default=None, metadata=_help(
        "Quantize the linear layers: fp8 = FP8 (e4m3) weights with per-channel scales made at "
        "load time from a bf16/fp32 checkpoint, activations quantized per token (CUDA: compute "
        "capability 8.9+). compressed-tensors checkpoints (FP8 / INT8 W8A8, W4A16, W8A16; "
        "written by llm-compressor or `photon quantize`) are detected from their config.json. "
        "Embeddings and the LM head stay unquantized. Default: none.",
        ("fp8", "compressed-tensors")))
    kv_cache_dtype: str = field(default="auto", metadata=_help(
        "KV cache dtype: auto = the model's dtype; fp8 (= fp8_e4m3) stores K and V as FP8 e4m3 "
        "with one scale per layer and KV head (the cache holds twice the tokens of bf16). "
        "Scales: the checkpoint's k_scale / v_scale when it has them, else from the first "
        "forward with --calculate-kv-scales, else 1.0. A draft model's cache keeps its dtype.",
        ("auto", "fp8", "fp8_e4m3")))
    calculate_kv_scales: bool = field(default=False, metadata=_help(
        "With --kv-cache-dtype fp8 and a checkpoint without KV scales: set each layer's K and V "
        "scales per KV head from the first forward (amax / 448 of the first prefill's K and V), "
        "then keep them fixed."))
    revision: str | None = field(default=None, metadata=_help(
        "The hub model's branch, tag or commit. Default: main."))
    download_dir: str | None = field(default=None, metadata=_help(
        "Hugging Face cache directory for hub models. Default: huggingface_hub's cache "
        "($HF_HUB_CACHE, else ~/.cache/huggingface/hub)."))
    generation_config: str = field(default="auto", metadata=_help(
        "Default sampling parameters for what a request leaves unset: auto = the model's "
        "generation_config.json (temperature, top_k, top_p, min_p, repetition_penalty, "
        "max_new_tokens), vllm = photon's own defaults, or a folder holding a "
        "generation_config.json."))
    structured_outputs_backend: str = field(default="xgrammar", metadata=_help(
        "Library that makes outputs follow a request's JSON schema, regex, choice list or "
        "grammar.", ("xgrammar",)))
    structured_outputs_timeout: float = field(default=30.0, metadata=_help(
        "Seconds a request's JSON schema or grammar may take to prepare before the request "
        "fails with 400."))
    structured_outputs_threads: int = field(default=8, metadata=_help(
        "CPU threads that work out, each step, which tokens structured-output requests may "
        "take; more keep large batches of them fast, 1 uses one."))
    structured_outputs_worker: str = field(default="process", metadata=_help(
        "process: structured outputs are enforced in a helper process, alongside the engine's "
        "own work (faster with many such requests); inline: in the engine thread. Outputs are "
        "the same.", GRAMMAR_WORKERS))
    structured_outputs_mask_wait: str = field(default="device", metadata=_help(
        "device: on CUDA the GPU waits for the allowed-token lists of structured-output "
        "requests, so the engine never stalls on them; host: the engine waits (always so on "
        "CPU). Outputs are the same.", MASK_WAITS))
    structured_outputs_max_chars: int = field(default=65536, metadata=_help(
        "Longest structured-outputs spec a request may give, in characters: a JSON schema (as "
        "compact JSON), regex, EBNF grammar or all choices together. Longer ones get a 400: "
        "compile time grows with the spec. 0 = no limit."))
    structured_outputs_max_choices: int = field(default=1024, metadata=_help(
        "Most entries in a structured-outputs choice list (400 beyond). 0 = no limit."))
    structured_outputs_cache_mb: int = field(default=512, metadata=_help(
        "Memory for compiled grammars kept for reuse by later requests with the same spec, in "
        "MiB (least recently used ones are dropped beyond it)."))
    reasoning_parser: str | None = field(default=None, metadata=_help(
        "How the model marks its reasoning: the server returns the think block as "
        "reasoning_content, the rest as content, and structured outputs constrain only the "
        "text after the reasoning. Default: none (all output is content).",
        tuple(reasoning_parser_names())))
    tensor_parallel_size: int = field(default=1, metadata={**_help(
        "Tensor parallelism: split every layer over this many ranks, one process each (gloo on "
        "CPU, NCCL on CUDA); the model's attention heads must split evenly."),
        "aliases": ("-tp",)})
    enable_expert_parallel: bool = field(default=False, metadata=_help(
        "Mixture-of-experts models under tensor parallelism: partition the experts over the "
        "ranks (each rank holds and loads E/N whole experts) instead of splitting every "
        "expert's intermediate dimension; attention stays tensor parallel. With "
        "--data-parallel-size N (and tensor parallel size 1) the experts are partitioned over "
        "the N engine cores instead: data-parallel attention, expert-parallel MoE layers."))
    data_parallel_size: int = field(default=1, metadata={**_help(
        "Data parallelism (photon serve): run this many engine cores, each with its own "
        "scheduler, KV cache and --tensor-parallel-size ranks; the server sends each new "
        "request to the core with the fewest open requests. With --enable-expert-parallel on "
        "a mixture-of-experts model the experts are partitioned over the cores, which then "
        "step together."),
        "aliases": ("-dp",)})
    distributed_executor_backend: str = field(default="mp", metadata=_help(
        "What starts the tensor-parallel ranks 1..N-1 (rank 0 runs in the engine core's "
        "process): mp, a process per rank on this machine; ray, a Ray actor per rank, placed "
        "by a placement group on the Ray cluster this process joins (RAY_ADDRESS, else the one "
        "`ray start` runs on this machine, else a new local instance): the way to span "
        "machines. ray needs `pip install ray`.", EXECUTOR_BACKENDS))
    speculative_config: str | dict[str, Any] | SpeculativeConfig | None = field(
        default=None, metadata=_help(
            "Speculative decoding, as a JSON object (a dict in Python): "
            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' proposes from the "
            "request's own tokens (prompt_lookup_min/prompt_lookup_max: the n-gram lengths "
            "searched, default 5); '{\"method\": \"draft_model\", \"model\": DIR, "
            "\"num_speculative_tokens\": 3}' from a small draft model sharing the target's "
            "tokenizer and vocabulary (its KV cache shares the target's blocks and memory). "
            "num_speculative_tokens: 1 to 16. Default: off."))
    kv_events_config: str | dict[str, Any] | KVEventsConfig | None = field(
        default=None, metadata=_help(
            "KV cache events for cache-aware routers, as a JSON object (vLLM's keys): "
            "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
            "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": "
            "\"kv-events\"}' publishes BlockStored / BlockRemoved / AllBlocksCleared batches "
            "on a ZeroMQ PUB socket (msgpack, vLLM's layout); also buffer_steps, hwm, "
            "max_queue_size. With data parallelism rank r uses port + r. Default: off."))
    kv_transfer_config: str | dict[str, Any] | KVTransferConfig | None = field(
        default=None, metadata=_help(
            "Prefill/decode disaggregation, as a JSON object (a dict in Python): "
            "'{\"kv_connector\": \"SharedMemoryConnector\", \"kv_role\": \"kv_producer\"}' "
            "on the prefill instance, kv_role kv_consumer on the decode instance (kv_both: "
            "either). kv_connector_extra_config: timeout_s (default 30: a transfer not done by "
            "then falls back), on_failure (recompute: the decode instance computes the prompt "
            "itself, the default; fail: the request fails). kv_connector NcclConnector "
            "(torch.distributed send/recv; gloo on CPU): kv_ip and kv_port of the prefill "
            "instance's rendezvous (default 127.0.0.1, port 0: a free one); "
            "allowed_remote_hosts: the prefill hosts a decode instance may connect to "
            "(default: localhost, 127.0.0.1, ::1 and kv_ip; \"*\": any); with "
            "--tensor-parallel-size N rank r listens on kv_port + r. kv_connector "
            "NixlConnector (pip install nixl; the decode instance reads the prefill "
            "instance's blocks with NIXL): the same kv_ip, kv_port and "
            "allowed_remote_hosts. With --tensor-parallel-size N (any connector): N equal on "
            "both instances, every rank moves its own KV shard. "
            "Default: off."))

    enable_lora: bool = field(default=False, metadata=_help(
        "Serve LoRA adapters (PEFT format: adapter_config.json and adapter_model.safetensors, "
        "targeting q/k/v/o and gate/up/down projections) next to the base model; requests name "
        "one (LoRARequest offline, the request's model on the server)."))
    max_loras: int = field(default=1, metadata=_help(
        "With --enable-lora: adapters resident on the device at once (slots). A request whose "
        "adapter finds no free slot waits; idle adapters are evicted least recently used."))
    max_lora_rank: int = field(default=16, metadata=_help(
        "With --enable-lora: the highest adapter rank r accepted (1 to 256); the slots are "
        "sized for it."))
    max_cpu_loras: int | None = field(default=None, metadata=_help(
        "With --enable-lora: adapters kept in host memory (least recently used ones are "
        "dropped and read again when needed). Default: --max-loras."))
    lora_modules: list[str] | None = field(default=None, metadata={**_help(
        "With --enable-lora: adapters served from startup, as name=path entries "
        "(--lora-modules sql=/adapters/sql chat=/adapters/chat)."), "nargs": "+"})

    def create_config(self) -> EngineConfig:
        """The checked, frozen configuration (ConfigError naming the argument at fault)."""
        from photon.spec import check_supported

        config = self._build_config()
        check_supported(config)
        return config

    def _build_config(self) -> EngineConfig:
        from photon.generation_config import load_generation_defaults
        from photon.model.hf_config import architecture, check_required_fields, load_hf_config
        from photon.model.tiny import resolve_model_path

        model_dir = resolve_model_path(self.model, self.revision, self.download_dir)
        hf_config = load_hf_config(model_dir)
        arch = architecture(hf_config)
        check_required_fields(hf_config, model_dir)
        device = resolve_device(self.device)
        use_triton = resolve_use_triton(device)
        model_config = ModelConfig(
            model=model_dir,
            hf_config=hf_config,
            architecture=arch,
            dtype=resolve_dtype(self.dtype, hf_config, device),
            max_model_len=resolve_max_len(self.max_model_len, hf_config),
            vocab_size=int(hf_config["vocab_size"]),
            seed=self.seed,
            served_model_name=self.served_model_name or default_name(self.model, model_dir),
            load_format=check_choice("load_format", self.load_format, _LOAD_FORMATS),
            generation_defaults=load_generation_defaults(self.generation_config, model_dir),
            use_triton=use_triton,
            quant_config=quant_config(self.quantization, hf_config, arch, device, use_triton),
        )
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive("block_size", self.block_size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("kv_cache_memory_bytes", "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None:
                check_positive(name, value)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(self.block_size, self.gpu_memory_utilization,
                              self.kv_cache_memory_bytes, self.num_gpu_blocks_override,
                              self.enable_prefix_caching, self._kv_cache_dtype(hf_config, device),
                              self.calculate_kv_scales),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens),
            device=device,
            pipelined=self.pipelined,
            enforce_eager=self.enforce_eager,
            attention_backend=attention_backend(self.attention_backend, device),
            structured_outputs=self.structured_outputs_config(),
            reasoning_parser=reasoning_parser(self.reasoning_parser),
            speculative_config=speculative_config(self.speculative_config),
            kv_events_config=kv_events_config(self.kv_events_config),
            kv_transfer_config=kv_transfer_config(self.kv_transfer_config,
                                                   self.tensor_parallel_size),
            lora_config=lora_config(self),
            parallel=parallel_config(ParallelConfig(
                self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                distributed_executor_backend=self.distributed_executor_backend), arch,
                hf_config),
        )

    def _kv_cache_dtype(self, hf_config: dict[str, Any], device: str) -> str:
        """--kv-cache-dtype checked against --calculate-kv-scales, the checkpoint, the device and
        the features that cannot take an FP8 cache."""
        from photon.attention.kv_quant import FP8_NAMES, check_fp8_kv_device, check_kv_cache_dtype

        name = check_kv_cache_dtype(self.kv_cache_dtype, self.calculate_kv_scales,
                                    hf_config.get("quantization_config"))
        if name not in FP8_NAMES:
            return name
        if self.kv_transfer_config is not None:
            raise ConfigError(f"{flag('kv_cache_dtype')}={name} is not supported with "
                              f"{flag('kv_transfer_config')} yet (both instances' caches would "
                              f"need the same scales); use {flag('kv_cache_dtype')} auto")
        if device == "cuda":
            check_fp8_kv_device(torch.cuda.get_device_capability())
        return name

    def structured_outputs_config(self) -> StructuredOutputsConfig:
        """The --structured-outputs-* arguments, checked (ConfigError naming the flag)."""
        return StructuredOutputsConfig(
            backend=self.structured_outputs_backend,
            timeout_s=self.structured_outputs_timeout,
            threads=self.structured_outputs_threads,
            worker=self.structured_outputs_worker,
            mask_wait=self.structured_outputs_mask_wait,
            max_chars=self.structured_outputs_max_chars,
            max_choices=self.structured_outputs_max_choices,
            cache_mb=self.structured_outputs_cache_mb,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
