"""LLMEngine: add_request / step / abort over the scheduler, the model runner and the sampler."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace

import torch

from servelm.config import EngineConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.calibration import calibration_ids
from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.executor import Executor, UniProcExecutor, ssm_state_dtype
from servelm.engine.model_runner import SeqInput
from servelm.engine.request import Request, RequestStatus
from servelm.engine.state_cache import StateCache, snapshot_row
from servelm.engine.sampler import Sampler, checks_grammar_after, token_logprobs
from servelm.quantization import mxfp4
from servelm.structured_outputs import GrammarCompiler, MaskPrefetch
from servelm.engine.scheduler import Scheduler
from servelm.models import kv_quant
from servelm.models.hub import resolve_model
from servelm.models.loader import open_checkpoint
from servelm.models.config import POOLING_TYPES
from servelm.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput,
                             RequestMetrics, RequestOutput)
from servelm.pooling_params import PoolingParams
from servelm.retune import IdleRetuner
from servelm.roofline import Hardware, ModelShape
from servelm.sampling_params import SamplingParams
from servelm.runtime import resolve_device

logger = logging.getLogger(__name__)
# What a user waits for at start-up (loading, a first kernel tuning): the CLI shows this
# logger at INFO whatever --log-level says.
progress = logging.getLogger("servelm.progress")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device, quantization: str | None = None,
                  cpu_kernels: bool = True) -> torch.dtype:
    if name == "auto":
        # bf16 where the hardware has it (it halves the bytes each decode step reads), and on
        # a CPU without it where servelm's AVX2 kernels run bf16 fast: bf16 weights on bfp
        # (block floating point on integer multiply-adds: past the fp32 FMA peak), int4 ones
        # on q8act (int8 activations, about twice the fp32 rate for batches and prompts).
        # Otherwise fp32, the reference, and for int8 weights, which bfp runs as fast with
        # fp32 activations.
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        if device.type == "cpu" and cpu_kernels:
            from servelm.layers import bfp, q8act

            if quantization == "int4" and q8act.available():
                return torch.bfloat16
            if quantization is None and bfp.available():
                return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


def resolve_quantization(config: EngineConfig, ckpt) -> tuple[str | None, str]:
    """The weight format to run (None: the activation dtype's) and how it was chosen, for
    the log: an explicit quantization wins; else the checkpoint's own format (a GGUF's
    tensor types, an HF quantization_config), unless an explicit dtype asks for dequantised
    weights."""
    if config.quantization == "none":
        return None, "dequantised (quantization 'none')"
    if config.quantization is not None:
        return config.quantization, f"{config.quantization} (asked for)"
    native, described = ckpt.native_quantization()
    if native is not None and config.dtype != "auto":
        return None, f"dequantised to {config.dtype} (dtype given; the file: {described})"
    return native, described


def _disk_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    return os.path.getsize(path)


def build_executor(config: EngineConfig, ckpt, model_config, dtype: torch.dtype,
                   device: torch.device, max_len: int, load_draft=None,
                   calibration: list[int] | None = None) -> Executor:
    """The executor for a resolved config: the tensor-parallel one (servelm.distributed,
    imported only then) with tensor_parallel_size > 1, else the whole model in this
    process. load_draft: the draft model's loader (speculative decoding; one process only).
    calibration: the int8-activation layers' calibration tokens (one process only).

    Under torchrun, on a rank other than 0, the tensor-parallel executor serves as a worker
    and exits the process (the same command line serves on rank 0 and works elsewhere)."""
    if config.tensor_parallel_size > 1:
        from servelm.distributed.executor import TPExecutor

        return TPExecutor(config, ckpt, model_config, dtype, device, max_len)
    return UniProcExecutor(config, ckpt, model_config, dtype, device, max_len, load_draft,
                           calibration)


@dataclass
class _Sample:
    """One of a request's n samples: the engine-level request and its detokenizer."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list | None
    emitted_tokens: int = 0
    metrics: RequestMetrics | None = None  # computed once, when the sample finishes


@dataclass(frozen=True)
class PoolingConfig:
    """How this model pools (embeddings): what its checkpoint says (GGUF <arch>.pooling_type,
    sentence-transformers' modules), else the last token's final hidden state, normalised:
    what a decoder trained for embeddings (Qwen3-Embedding) uses, so any chat model answers
    too. `unsupported`: why its stated pooling cannot be run (requests are refused)."""

    pooling_type: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: no Matryoshka; (): any
    unsupported: str | None = None

    @classmethod
    def of(cls, cfg) -> "PoolingConfig":
        return cls(pooling_type=cfg.pooling_type or "last",
                   normalize=True if cfg.pooling_normalize is None else cfg.pooling_normalize,
                   hidden_size=cfg.hidden_size, matryoshka_dimensions=cfg.matryoshka_dimensions,
                   unsupported=cfg.pooling_unsupported
                   or (None if (cfg.pooling_type or "last") in POOLING_TYPES
                       else f"it pools by {cfg.pooling_type}"))

    def check(self, params: PoolingParams) -> None:
        """ValueError (naming the field) for params this model cannot honour."""
        if self.unsupported:
            raise ValueError(f"this model cannot embed here: {self.unsupported}")
        d = params.dimensions
        if d is None or d == self.hidden_size:
            return
        if d > self.hidden_size:
            raise ValueError(f"dimensions {d} is more than the model's {self.hidden_size}")
        if self.matryoshka_dimensions is None:
            raise ValueError(f"dimensions {d}: this model does not support Matryoshka "
                             f"embeddings (its {self.hidden_size} values are one embedding; "
                             f"leave dimensions out)")
        if self.matryoshka_dimensions and d not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions {d} is not one this model was trained for: "
                             f"{list(self.matryoshka_dimensions)}")


@dataclass
class _Pooling:
    """A pooling request in flight: what it has pooled of its prompt so far."""

    request: Request
    params: PoolingParams
    prompt: str | None
    acc: torch.Tensor | None = None  # mean: the sum so far; cls: the first position's
    next_pos: int = 0                # positions before it are in acc (recomputes skip them)


# A pooling request's sampling params: never sampled; one "token" keeps the scheduler's
# lookahead from reserving blocks past its prompt, and speculation away from it.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


@dataclass
class _Group:
    """Everything added by one add_request call (n samples of one prompt)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)
    # With params.prompt_logprobs: entries so far, one per prompt position (first None);
    # filled from the first sample's prompt rows, in position order.
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


def _recurrent_config(config: EngineConfig) -> EngineConfig:
    """The engine options a model with linear-attention layers runs with: its recurrent
    state sums the whole sequence, so it cannot roll back rejected draft tokens
    (speculative decoding: refused), and prefix caching restores it from snapshots kept at
    the end of prompts (BlockManager: state snapshots), not from cached blocks alone."""
    if config.speculative is not None:
        raise ValueError("speculative decoding is not supported for a model with "
                         "linear-attention layers: their recurrent state cannot roll back "
                         "rejected draft tokens")
    return config


def mxfp4_splits(ckpt, world: int) -> bool:
    """Whether `world` tensor-parallel ranks each take whole blocks of 32 of the routed
    experts' intermediate size (the down projection's inputs), so MXFP4 experts can stay
    MXFP4 on every rank."""
    if world == 1:
        return True
    from servelm.distributed.sharding import split_range

    size = ckpt.config().moe_intermediate_size
    return all(a % 32 == 0 and b % 32 == 0
               for a, b in (split_range(size, world, r) for r in range(world)))


def hybrid_capacity(reaches: tuple[int, ...], pages: int, block_size: int, max_len: int,
                    step_tokens: int) -> tuple[int, int]:
    """(tokens the pool holds for sequences short of every window, the longest sequence it
    holds) for a pool of `pages` in block groups of these reaches: a block of tokens takes
    a page in every group, except that a windowed group holds at most its reach and a
    step's tokens (BlockManager.num_to_grow)."""
    full = sum(1 for r in reaches if not r)
    capped = sum(-(-(r + step_tokens) // block_size) + 1 for r in reaches if r)
    longest = max(pages // len(reaches), (pages - capped) // full) * block_size
    return pages // len(reaches) * block_size, min(max_len, longest)


class LLMEngine:
    """Continuous batching engine: requests join and leave the running batch at every step."""

    def __init__(self, config: EngineConfig | None = None):
        """Resolve the configuration (the checkpoint, its weight format, the dtypes, the
        tokenizer), ask for the executor that runs the model (build_executor), then build
        the scheduling around it. Process-wide settings (threads, gc.freeze) are not the
        engine's: the process's entry makes them (servelm.runtime)."""
        config = config or EngineConfig()
        t_load = time.perf_counter()
        self.device = resolve_device(config.device)
        ckpt = open_checkpoint(resolve_model(config.model, config.revision, config.download_dir))
        # The weight format, decided once: the checkpoint's own unless one was asked for;
        # every later reader (the TP ranks, the draft) sees the resolved value.
        quantization, self.weight_format = resolve_quantization(config, ckpt)
        # MXFP4 routed experts (gpt-oss) run as they are (servelm.quantization.mxfp4) unless
        # dequantised or int8 weights were asked for, or tensor-parallel ranks would split
        # their inputs inside a block (then each rank dequantises its slice).
        ckpt.keep_mxfp4 = (config.quantization not in ("none", "int8") and ckpt.mxfp4_experts()
                           and mxfp4_splits(ckpt, config.tensor_parallel_size))
        self.mxfp4_experts = ckpt.keep_mxfp4
        if ckpt.keep_mxfp4:
            self.weight_format += ", routed experts MXFP4"
        self.config = config = replace(config, model=ckpt.path, quantization=quantization)
        self.dtype = resolve_dtype(config.dtype, self.device, config.quantization,
                                   config.kernels.cpu_kernels)
        # The KV pool's storage dtype: the model's, or int8 / fp8 with scales (kv_quant).
        self.kv_dtype = kv_quant.storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.model_path, self.model_config = ckpt.path, ckpt.config()
        if self.model_config.has_recurrent_state:
            self.config = config = _recurrent_config(config)
        progress.info("loading %s (%s, %.2f GB on disk): weights %s, activations %s",
                      ckpt.path, self.model_config.architecture, _disk_bytes(ckpt.path) / 1e9,
                      self.weight_format, str(self.dtype).removeprefix("torch."))
        self.tokenizer = self._open_tokenizer(ckpt)
        max_len = self.model_config.max_position_embeddings
        if config.scheduler.max_model_len is not None:
            max_len = min(max_len, config.scheduler.max_model_len)
        calibration = (calibration_ids(self.tokenizer)
                       if config.kernels.int8_activations != "off" else None)
        self.executor = build_executor(config, ckpt, self.model_config, self.dtype,
                                       self.device, max_len,
                                       load_draft=lambda: self._load_draft(max_len),
                                       calibration=calibration)
        num_blocks, block_size = self.executor.num_blocks, config.cache.block_size
        # A sequence longer than the whole pool could never run; unless every attention
        # layer is windowed, and the pool holds a window and a step's tokens.
        self.max_model_len = min(max_len, num_blocks * block_size)
        reach = self.model_config.attention_reach
        if reach and num_blocks * block_size >= (reach + config.scheduler.max_num_batched_tokens
                                                 + 2 * block_size):
            self.max_model_len = max_len
        self.kv_capacity_tokens = num_blocks * block_size
        groups = self.executor.kv_groups
        if groups is not None:  # a hybrid model's pages: one in each group per block of tokens
            self.kv_capacity_tokens, self.max_model_len = hybrid_capacity(
                groups.reaches, num_blocks, block_size, max_len,
                config.scheduler.max_num_batched_tokens)
        self._build_scheduling(num_blocks)
        progress.info("ready in %.1f s; KV cache: %d tokens (%d %s of %d, %.1f MiB), "
                      "max_model_len %d", time.perf_counter() - t_load,
                      self.kv_capacity_tokens, num_blocks,
                      "blocks" if groups is None else
                      f"pages in {len(groups.layers)} block groups",
                      block_size, num_blocks * self.executor.block_bytes / 2**20,
                      self.max_model_len)

    def _open_tokenizer(self, ckpt):
        """The checkpoint's tokenizer, or --tokenizer's (which must fit the model's
        vocabulary), with the chat template and its variables."""
        config = self.config
        tokenizer = (open_checkpoint(resolve_model(config.tokenizer, config.revision,
                                                   config.download_dir)).tokenizer()
                     if config.tokenizer else ckpt.tokenizer())
        if config.tokenizer and tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(f"tokenizer {config.tokenizer}: its {tokenizer.vocab_size} "
                             f"tokens are more than the model's {self.model_config.vocab_size}")
        if config.chat_template is not None:
            tokenizer.chat_template = config.chat_template
        tokenizer.default_template_kwargs = dict(config.chat_template_kwargs or {})
        return tokenizer

    def _build_scheduling(self, num_blocks: int) -> None:
        """Everything around the executor: blocks, scheduler, the step's roofline shape,
        speculation, sampler, grammars, the requests' bookkeeping."""
        config = self.config
        cache_cfg = config.cache
        ex = self.executor
        if cache_cfg.enable_prefix_caching and ex.num_state_slots and not ex.num_state_snapshots:
            logger.info("prefix caching off: the model's linear-attention layers keep a "
                        "recurrent state per sequence, and kv_cache_memory leaves no room "
                        "for a snapshot of one")
            self.config = config = replace(config, cache=replace(cache_cfg,
                                                                 enable_prefix_caching=False))
            cache_cfg = config.cache
        self.block_manager = BlockManager(num_blocks, cache_cfg.block_size,
                                          enable_caching=cache_cfg.enable_prefix_caching,
                                          num_state_slots=ex.num_state_slots,
                                          num_state_snapshots=ex.num_state_snapshots,
                                          reach=(self.model_config.attention_reach or 0)
                                          if ex.kv_groups is None else 0,
                                          groups=() if ex.kv_groups is None
                                          else ex.kv_groups.reaches[1:])
        # LoRA adapters: the registered ones and the model's resident slots.
        self.lora = self.executor.lora_manager(config, self.model_config)
        if self.lora is not None:
            for name, path in config.lora.lora_modules:
                self.lora.register(name, path)
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   max_loras=config.lora.max_loras if self.lora else None)
        weight_bits = torch.empty(0, dtype=self.dtype).element_size() * 8
        expert_bits = None
        if config.quantization:
            from servelm.roofline import quantized_bits_per_weight, quantized_expert_bits

            weight_bits = quantized_bits_per_weight(config.quantization)  # scales included
            expert_bits = quantized_expert_bits(config.quantization)
        if self.mxfp4_experts:
            expert_bits = mxfp4.BITS
        self.shape = ModelShape.from_config(
            self.model_config, weight_bits=weight_bits,
            kv_bits=kv_quant.bits_per_element(self.kv_dtype, self.model_config.cache_layout[2]),
            state_bytes=StateCache.bytes_per_slot(
                self.model_config, self.dtype, ssm_state_dtype(config.cache.mamba_ssm_cache_dtype)),
            expert_bits=expert_bits, window_groups=self.executor.kv_groups is not None)
        self.hardware: Hardware | None = None  # set by whoever measured the machine
        self.speculator = None
        if config.speculative is not None:
            self.speculator = self._build_speculator(config.speculative, self.executor.draft,
                                                     weight_bits)
        self.sampler = Sampler(self.tokenizer.eos_token_ids)
        # Structured outputs: specs -> grammar matchers (llguidance loaded on first use).
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._groups: dict[str, _Group] = {}
        self._pooling: dict[str, _Pooling] = {}
        self.pooling_config = PoolingConfig.of(self.model_config)
        self._owner: dict[str, tuple[_Group, int]] = {}  # engine request id -> group, sample
        self._counter = 0
        self.stats = EngineStats()
        # The linear-method table re-measured while idle where it is provisional or the
        # decode steps contradict it (KernelConfig.retune_when_idle; servelm.retune).
        self.retuner = IdleRetuner.of(self.executor.tuning, config.kernels)

    def _load_draft(self, max_len: int):
        """speculative_config method draft_model: the draft model, checked and loaded (its
        KV pool is allocated with the target's); None for any other configuration."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        from servelm.spec.draft_model import DraftModelProposer

        return DraftModelProposer(spec, self.model_config, self.tokenizer, self.dtype,
                                  self.device, max_len, self.config.quantization,
                                  self.config.kernels)

    def _build_speculator(self, spec, draft, weight_bits: float):
        """Speculative decoding (servelm.spec), with the roofline's ridge measured here."""
        from servelm.roofline import measure_hardware, ridge_tokens
        from servelm.spec.speculator import Speculator

        dtype = str(self.dtype).removeprefix("torch.")
        self.hardware = measure_hardware(dtype, self.device.type, seconds=0.2)
        ridge = ridge_tokens(self.shape, self.hardware)
        draft_cost = 0.0
        if draft is not None:
            # One draft forward reads the draft's weights: that share of a target step.
            draft_shape = ModelShape.from_config(draft.config, weight_bits=weight_bits,
                                                 kv_bits=16)
            draft_cost = draft_shape.weight_bytes(1) / self.shape.weight_bytes(1)
        logger.info("speculation: %s, k=%d; a step turns compute-bound at %.1f tokens per "
                    "weight read (roofline)%s", spec.method, spec.num_speculative_tokens, ridge,
                    f"; a draft forward costs {draft_cost:.2f} of a target step's weight reads"
                    if draft is not None else "")
        return Speculator(spec, ridge, self.config.scheduler.max_num_batched_tokens,
                          proposer=draft, draft_cost=draft_cost)

    # ---- requests in -------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | list[int] | None,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None,
                    cache_salt: str | None = None, lora_request=None) -> str:
        """Queue a prompt (text or token ids); returns the request id. ValueError if it cannot run.

        lora_request: a servelm.lora.LoRARequest (registered here if it is new) or the name of
        a registered adapter; the request runs with that adapter, and its prefix-cache blocks
        are its adapter's own.

        prompt_token_ids, when given, are used as they are (prompt is then only reported back).
        cache_salt: prefix-cache blocks are shared only between requests of the same salt
        (None is a salt of its own), so cached_tokens tells nothing across salts.
        PoolingParams make it a pooling request (an embedding): scheduled like any prompt,
        never sampled; one PoolingRequestOutput when its last prompt chunk has run.
        """
        params = params or SamplingParams()
        lora_name = self._lora_name(lora_request)
        if lora_name is not None:  # two adapters (or two loads of one name) never share KV
            cache_salt = (f"{cache_salt or ''}\x00lora:{lora_name}:"
                          f"{self.lora.generation[lora_name]}")
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if (request_id in self._groups or request_id in self._pooling
                or any(c in self._owner for c in child_ids)):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            return self._add_pooling(request_id, prompt, params, arrival_time,
                                     prompt_token_ids, cache_salt)
        text, ids, max_tokens = self.prepare_prompt(prompt, params, prompt_token_ids)
        group = _Group(request_id, text, ids,
                       prompt_logprobs=None if params.prompt_logprobs is None else [None])
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        for i, rid in enumerate(child_ids):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            req = Request(rid, ids, params, max_tokens, arrival, gen, cache_salt=cache_salt)
            req.lora_name = lora_name
            if params.structured_outputs is not None:
                req.grammar = self.grammars.matcher(params.structured_outputs)
            # The first sample computes every prompt position (its siblings then share its
            # blocks through the prefix cache, as usual).
            req.needs_prompt_logits = i == 0 and params.prompt_logprobs is not None and len(ids) > 1
            if i > 0 and self.block_manager.enable_caching:
                req.wait_for = group.samples[0].request  # share its prompt blocks
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_strings,
                                           params.include_stop_str_in_output,
                                           params.skip_special_tokens,
                                           min_tokens=params.min_tokens)
            group.samples.append(_Sample(req, detok, [] if params.logprobs is not None else None))
            self._owner[rid] = (group, i)
            self.scheduler.add_request(req)
        self._groups[request_id] = group
        return request_id

    def add_lora(self, lora_request, adapter=None) -> bool:
        """Register (load and check) a LoRA adapter; False if it was already registered.
        adapter: its weights as load_lora read them (then nothing is read here). ValueError
        (servelm.lora.loader.LoRAError) when it does not fit the model."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, --enable-lora)")
        known = lora_request.lora_name in self.lora
        self.lora.add(lora_request, adapter)
        return not known

    def load_lora(self, lora_request):
        """An adapter's weights read and checked for add_lora, registering nothing: safe on
        another thread while this engine steps. ValueError as add_lora."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, --enable-lora)")
        return self.lora.load(lora_request)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter: KeyError if unknown, ValueError while requests use it."""
        if self.lora is None or name not in self.lora:
            raise KeyError(name)
        users = sum(r.lora_name == name
                    for r in list(self.scheduler.running) + list(self.scheduler.waiting))
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s)")
        self.lora.remove(name)

    def list_loras(self) -> list:
        """The registered adapters' LoRARequests."""
        return list(self.lora.requests.values()) if self.lora is not None else []

    def _lora_name(self, lora_request) -> str | None:
        """The adapter a request names (a LoRARequest is registered if new), None for the
        base model; ValueError when LoRA is off or the name is unknown."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("lora_request needs LoRA enabled (enable_lora=True, "
                             "--enable-lora or --lora-modules)")
        if isinstance(lora_request, str):
            if lora_request not in self.lora:
                raise ValueError(f"LoRA adapter {lora_request!r} is not loaded")
            return lora_request
        return self.lora.add(lora_request).lora_name

    def add_pooling_request(self, request_id: str | None, prompt: str | list[int] | None,
                            params: PoolingParams | None = None,
                            arrival_time: float | None = None,
                            prompt_token_ids: list[int] | None = None,
                            cache_salt: str | None = None) -> str:
        """add_request with PoolingParams (default: the model's pooling, whole vector)."""
        return self.add_request(request_id, prompt, params or PoolingParams(), arrival_time,
                                prompt_token_ids, cache_salt)

    def _add_pooling(self, request_id: str, prompt, params: PoolingParams,
                     arrival_time: float | None, prompt_token_ids: list[int] | None,
                     cache_salt: str | None) -> str:
        text, ids, _ = self.prepare_prompt(prompt, params, prompt_token_ids)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        req = Request(request_id, ids, _POOLING_SAMPLING, 1, arrival, cache_salt=cache_salt)
        req.pooling_params = params
        self._pooling[request_id] = _Pooling(req, params, text)
        self.scheduler.add_request(req)
        return request_id

    def prepare_prompt(self, prompt: str | list[int] | None,
                       params: SamplingParams | PoolingParams,
                       prompt_token_ids: list[int] | None = None
                       ) -> tuple[str | None, list[int], int]:
        """Tokenise and check a prompt without queueing it: (text, token ids, max_tokens).

        Raises ValueError naming the problem; safe to call from another thread. A pooling
        request (PoolingParams) may fill the whole context (it generates nothing); its
        params are checked against the model's pooling (PoolingConfig.check).
        """
        if prompt is not None and not isinstance(prompt, (str, list, tuple)):
            # A dict would be read as its keys ("prompt token id 'prompt_token_ids'").
            raise ValueError(f"prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__} (token ids go in prompt_token_ids=; "
                             f"LLM.generate takes {{'prompt_token_ids': [...]}})")
        if prompt_token_ids is not None:
            text, ids = prompt, list(prompt_token_ids)
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt or [])
        if prompt_token_ids is not None or not isinstance(prompt, str):
            self._check_in_vocab(ids, "prompt token id")
        if isinstance(params, PoolingParams):
            return text, ids, self._check_pooling(ids, params)
        self._check_in_vocab(params.stop_token_ids, "stop_token_ids entry")
        self._check_in_vocab(params.logit_bias or (), "logit_bias token id")
        return text, ids, self._check_length(ids, params)

    def _check_in_vocab(self, ids, what: str) -> None:
        """ValueError naming the first of `ids` that is not a token id of this model."""
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"{what} {t!r} is outside the vocabulary [0, {vocab})")

    def _check_pooling(self, ids: list[int], params: PoolingParams) -> int:
        if self.config.tensor_parallel_size > 1:
            raise ValueError("embeddings are not served with tensor_parallel_size > 1 (the "
                             "ranks return logits, not hidden states)")
        self.pooling_config.check(params)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, but the maximum context length is "
                             f"{self.max_model_len} tokens")
        return 1

    def _check_length(self, ids: list[int], params: SamplingParams) -> int:
        if not ids:
            raise ValueError("prompt must not be empty")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt is {len(ids)} tokens, but the maximum context length is "
                             f"{self.max_model_len} tokens (including at least one output token)")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(ids) + params.max_tokens} exceeds the maximum context length "
                             f"of {self.max_model_len} tokens")
        return room if params.max_tokens is None else params.max_tokens

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        pooling = self._pooling.pop(request_id, None)
        if pooling is not None:
            self._finish(pooling.request, RequestStatus.FINISHED_ABORTED)
            self.stats.num_aborted += 1
            return True
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.samples:
            self._owner.pop(s.request.request_id, None)
            if not s.request.is_finished:
                self._finish(s.request, RequestStatus.FINISHED_ABORTED)
        self.stats.num_aborted += 1
        return True

    # ---- a prefix's KV between engines (disaggregated prefill and decode) ---------------

    def kv_transfer_check(self) -> str | None:
        """Why this engine cannot send or receive KV blocks, or None when it can."""
        if not self.block_manager.enable_caching:
            return ("prefix caching is off (KV blocks travel through it: the sender reads "
                    "a finished prompt's cached blocks, the receiver caches them)")
        if self.config.tensor_parallel_size > 1:
            return "tensor parallelism shards the KV pool over ranks"
        return None

    def kv_layout(self) -> dict:
        """What a block of this engine's pool holds and how it was computed: another
        engine's blocks serve here only where this is equal (the model's shape, its weight
        format and activation dtype, the pool's regions)."""
        cfg = self.model_config
        return {"architecture": cfg.architecture, "num_layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "weights": self.weight_format,
                "activations": str(self.dtype).removeprefix("torch."),
                **self.executor.kv_cache.layout()}

    def export_prefix(self, token_ids: list[int], salt: str | None = None
                      ) -> tuple[int, torch.Tensor]:
        """(n, bytes): the KV of the first n tokens of token_ids, the longest prefix of whole
        blocks this engine holds cached under `salt` short of the last token (what a
        receiver's request for the same prompt can take from its cache), as
        KVCache.read_blocks' bytes of its pages (BlockManager.prefix_pages: with block
        groups, a windowed group's in reach of its end only). Called after the prompt ran,
        before its blocks are evicted (0 tokens if they were)."""
        bm = self.block_manager
        hit = bm.find_cached_prefix(token_ids, salt)
        return len(hit) * bm.block_size, self.executor.kv_cache.read_blocks(bm.prefix_pages(hit))

    def import_prefix(self, token_ids: list[int], salt: str | None, data: torch.Tensor) -> int:
        """Put another engine's export_prefix(token_ids, salt) into this engine's prefix
        cache (blocks already cached here are kept, not rewritten). Returns the tokens now
        cached; 0 when the free blocks cannot hold them (a request for the prompt then
        computes it). ValueError when data is not len(token_ids) tokens of this pool's
        blocks."""
        bm, kv = self.block_manager, self.executor.kv_cache
        if len(token_ids) % bm.block_size:
            raise ValueError(f"{len(token_ids)} tokens are not whole blocks of {bm.block_size}")
        rows = bm.prefix_rows(len(token_ids) // bm.block_size)
        if data.numel() != rows * kv.block_bytes:
            raise ValueError(f"{data.numel()} bytes are not {len(token_ids)} tokens of "
                             f"this pool's blocks ({rows} of {kv.block_bytes} bytes)")
        key = "\x00import"  # a table of its own for the length of this call
        got = bm.begin_import(key, token_ids, salt)
        if got is None:
            return 0
        pages, at = got
        try:
            kv.write_blocks(pages, data, at)
        except BaseException:
            bm.end_import(key, token_ids, salt, written=False)
            raise
        bm.end_import(key, token_ids, salt)
        return len(token_ids)

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel worker has died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Release what outlives the engine object: tensor-parallel worker processes."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def commit_pool(self, seconds: float) -> bool:
        """Commit the KV pool's memory (CacheConfig.commit_while_idle) for at most `seconds`:
        the server's start, before it reports ready, so the first prompts after it do not
        pay first-touch faults inside their steps (a fresh pool's blocks are handed out in
        the order committed). Returns whether any is left for the idle loop."""
        if not self.config.cache.commit_while_idle:
            return False
        deadline = time.monotonic() + seconds
        while self.executor.kv_cache.commit_next():
            if time.monotonic() >= deadline:
                return True
        return False

    def commit_idle(self) -> bool:
        """Idle work, one slice at a time: commit the next part of the KV pool's memory
        (CacheConfig.commit_while_idle), then a piece of re-tuning the linear methods
        (IdleRetuner.idle_piece). Returns whether any is left; False at once where both are
        off or done. Under tensor parallelism only this process's rank's pool is committed;
        the other ranks' pages come at first touch."""
        if self.config.cache.commit_while_idle and self.executor.kv_cache.commit_next():
            return True
        # Then a piece of re-measuring a provisional or suspect linear-method table.
        return self.retuner is not None and self.retuner.idle_piece()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups) + len(self._pooling)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Schedule, run one forward pass over the mixed batch, sample, and report progress
        (a pooling request: once, when its last prompt chunk has run)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.waiting)
        sched = self.scheduler.schedule()
        if self.speculator is not None:
            for r in sched.preempted:  # recomputed later: the proposer's state goes too
                self.speculator.release(r)
        if sched.is_empty:
            return []
        restores = self.block_manager.take_restores()
        if restores:  # admissions on a cached prefix: their recurrent state from its snapshot
            self.executor.restore_states(restores)
        now = time.perf_counter()
        seqs = []
        lora_slots = (self.lora.slots_for(s.request.lora_name for s in sched.scheduled
                                          if s.request.lora_name is not None)
                      if self.lora is not None else {})
        for s in sched.scheduled:
            req = s.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            ids = req.token_slice(s.start, s.start + s.num_new_tokens - s.num_draft)
            if s.num_draft:
                ids += req.spec_token_ids
            table = self.block_manager.block_table(req.request_id)
            state = self.block_manager.state_slot(req.request_id)
            group_tables = self.block_manager.group_tables(req.request_id)
            if req.pooling_params is not None:
                seqs.append(self._pooling_input(ids, s, table, state, group_tables))
                continue
            seqs.append(SeqInput(ids, s.start, table, s.samples,
                                 all_logits=req.needs_prompt_logits,
                                 num_logits=s.num_draft + 1,
                                 lora_slot=lora_slots.get(req.lora_name, -1),
                                 state_slot=state,
                                 state_snapshot=None if s.snapshot is None else (
                                     s.snapshot[0], snapshot_row(self.executor.num_state_slots,
                                                                 s.snapshot[1])),
                                 group_tables=group_tables))
        masks = None
        if self.config.kernels.overlap_grammar_masks and not any(
                s.num_draft for s in sched.scheduled):
            # Structured outputs: the sampling rows' masks computed during the forward.
            # (Greedy rows check their argmax against the grammar after the forward instead.)
            grammars = [s.request.grammar for s in sched.scheduled
                        if s.samples and s.request.grammar is not None
                        and not (self.sampler.check_grammar_after
                                 and checks_grammar_after(s.request))]
            if grammars:
                masks = MaskPrefetch(grammars, self.model_config.vocab_size)
        t0 = time.perf_counter()
        pooled = None
        if any(q.pooling for q in seqs):
            logits, rows, hidden, hidden_rows = self.executor.execute_pooling(seqs)
            pooled = (hidden, hidden_rows)
        else:
            logits, rows = self.executor.execute(seqs)
        if any(q.all_logits and not q.pooling for q in seqs):
            logits, rows = self._take_prompt_logprobs(seqs, sched, logits, rows)
        if any(s.num_draft for s in sched.scheduled):
            emitted = self._verify(sched, logits, rows)
        else:
            sampled_reqs = [sched.scheduled[i].request for i in rows]
            result = self.sampler(logits, sampled_reqs, masks) if sampled_reqs else None
            emitted = [([result.token_ids[j]], [result.logprobs[j]]) for j in range(len(rows))]
        self.scheduler.update_after_step(sched)
        # The sampler has read the logits back, so the step's device work is done.
        seconds = time.perf_counter() - t0
        self.stats.record_step(sched, seconds, self.shape)
        if self.retuner is not None:  # busy, and the decode steps' times checked
            self.retuner.record(sched, seconds)

        now = time.perf_counter()
        touched: dict[str, _Group] = {}
        for i, (tokens, logprobs) in zip(dict.fromkeys(rows), emitted):
            req = sched.scheduled[i].request
            group, index = self._owner[req.request_id]
            sample = group.samples[index]
            for token, lp in zip(tokens, logprobs):
                req.append_output_token(token, now)
                if req.grammar is not None:
                    req.grammar.consume_token(token)
                if sample.logprobs is not None:
                    sample.logprobs.append(lp)
                self._check_stop(sample, token)
                if req.is_finished:
                    break  # stopped inside an accepted run: the rest is dropped
            req.spec_token_ids = []
            touched[group.request_id] = group
        outputs: list = [self._make_output(g) for g in touched.values()]
        if pooled is not None:
            outputs += self._pool(sched, *pooled)
        return outputs

    def _pooling_input(self, ids: list[int], s, table: list[int], state: int,
                       group_tables: list[list[int]]) -> SeqInput:
        """A pooling request's chunk: the rows its pooling reads come back as hidden states
        (every position for mean, the first chunk's for CLS, the last position at the end)."""
        kind = self.pooling_config.pooling_type
        every = kind == "mean" or (kind == "cls" and s.start == 0)
        return SeqInput(ids, s.start, table, s.samples, all_logits=every, pooling=True,
                        state_slot=state, group_tables=group_tables)

    def _pool(self, sched, hidden: torch.Tensor, rows: list[int]) -> list[PoolingRequestOutput]:
        """Fold this step's hidden-state rows into each pooling request's pooling; finish
        those whose prompt is complete: their vector (truncated, normalised), blocks freed."""
        kind = self.pooling_config.pooling_type
        by_seq: dict[int, list[int]] = {}
        for r, i in enumerate(rows):
            by_seq.setdefault(i, []).append(r)
        outputs = []
        for i, rs in by_seq.items():
            s = sched.scheduled[i]
            state = self._pooling.get(s.request.request_id)
            if state is None:
                continue
            h = hidden[rs]
            if kind == "mean" and s.start + len(rs) > state.next_pos:
                # Rows are positions s.start...; after a preemption the recomputed ones
                # before next_pos are in the sum already.
                part = h[max(0, state.next_pos - s.start):].sum(0)
                state.acc = part if state.acc is None else state.acc + part
                state.next_pos = s.start + len(rs)
            elif kind == "cls" and s.start == 0 and state.acc is None:
                state.acc = h[0].clone()
            if s.samples:
                outputs.append(self._finish_pooling(state, h[-1]))
        return outputs

    def _finish_pooling(self, state: _Pooling, last: torch.Tensor) -> PoolingRequestOutput:
        req, params, cfg = state.request, state.params, self.pooling_config
        if cfg.pooling_type == "mean":
            vec = state.acc / req.num_prompt_tokens
        elif cfg.pooling_type == "cls":
            vec = state.acc
        else:
            vec = last
        if params.dimensions is not None:
            vec = vec[:params.dimensions]
        if cfg.normalize if params.normalize is None else params.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        self._finish(req, RequestStatus.FINISHED_STOPPED)  # its blocks, uncached, freed now
        del self._pooling[req.request_id]
        self.stats.num_pooling_requests += 1
        self.stats.num_pooling_tokens += req.num_prompt_tokens
        return PoolingRequestOutput(req.request_id, PoolingOutput(vec.cpu().contiguous()),
                                    req.prompt_token_ids, 0, True, state.prompt,
                                    RequestMetrics.of(req))

    def _take_prompt_logprobs(self, seqs: list[SeqInput], sched, logits: torch.Tensor,
                              rows: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Record the prompt logprobs that rows of all_logits sequences give (the logits
        at position p score prompt token p + 1); return the rows left to sample from."""
        keep: list[int] = []
        picked: list[tuple[int, int, _Group, int]] = []  # (row, target token, group, top-N)
        seen: dict[int, int] = {}
        expect: dict[int, int] = {}  # seq index -> the next prompt position it records
        for r, i in enumerate(rows):
            q = seqs[i]
            if not q.all_logits:
                keep.append(r)
                continue
            k = seen[i] = seen.get(i, -1) + 1
            if q.sample and k == len(q.token_ids) - 1:
                keep.append(r)  # the last prompt position predicts the first output token
                continue
            req = sched.scheduled[i].request
            group = self._owner[req.request_id][0]
            target = q.start_pos + k + 1
            # Recomputed positions (after a preemption) were recorded the first time.
            if target == expect.setdefault(i, len(group.prompt_logprobs)) < req.num_prompt_tokens:
                expect[i] += 1
                picked.append((r, req.prompt_token_ids[target], group,
                               req.sampling_params.prompt_logprobs))
        if picked:
            idx = torch.tensor([p[0] for p in picked], dtype=torch.long, device=logits.device)
            lp = torch.log_softmax(logits[idx], dim=-1)  # raw model distribution, [R, V]
            targets = torch.tensor([p[1] for p in picked], dtype=torch.long, device=logits.device)
            found = token_logprobs(lp, targets, [p[3] for p in picked])
            text = self.tokenizer.token_text
            for (_, _, group, _), e in zip(picked, found):
                entry = {t: Logprob(v, rank, text(t)) for rank, (t, v) in enumerate(e.top, 1)}
                entry[e.token_id] = Logprob(e.logprob, e.rank, text(e.token_id))
                group.prompt_logprobs.append(entry)
        for q, s in zip(seqs, sched.scheduled):
            req = s.request
            if q.all_logits and not q.pooling:
                group = self._owner[req.request_id][0]
                req.needs_prompt_logits = len(group.prompt_logprobs) < req.num_prompt_tokens
        if len(keep) == len(rows):
            return logits, rows
        return logits[keep], [rows[r] for r in keep]

    def _verify(self, sched, logits: torch.Tensor, rows: list[int]) -> list[tuple[list, list]]:
        """Sample the plain rows and verify the speculating ones (servelm.spec.verify);
        per sampled sequence in row order, (tokens to emit, their logprobs). Sets each
        speculated ScheduledSeq's num_rejected for the scheduler's rollback."""
        from servelm.spec.verify import verify

        seq_rows: dict[int, int] = {}  # sequence index -> its first row
        for r, i in enumerate(rows):
            seq_rows.setdefault(i, r)
        plain = [r for i, r in seq_rows.items() if not sched.scheduled[i].num_draft]
        spec = [i for i in seq_rows if sched.scheduled[i].num_draft]
        out: dict[int, tuple[list, list]] = {}
        if plain:
            reqs = [sched.scheduled[rows[r]].request for r in plain]
            res = self.sampler(logits[torch.tensor(plain, device=logits.device)], reqs)
            for j, r in enumerate(plain):
                out[rows[r]] = ([res.token_ids[j]], [res.logprobs[j]])
        reqs = [sched.scheduled[i].request for i in spec]
        drafts = [r.spec_token_ids for r in reqs]
        for i, v in zip(spec, verify(self.sampler, logits, reqs, drafts,
                                     [seq_rows[i] for i in spec])):
            s = sched.scheduled[i]
            s.num_rejected = s.num_draft - v.num_accepted
            self.stats.record_spec(s.num_draft, v.num_accepted)
            self.speculator.observe(s.num_draft, v.num_accepted)
            out[i] = (v.token_ids, v.logprobs or [None] * len(v.token_ids))
        return [out[i] for i in seq_rows]

    def _check_stop(self, sample: _Sample, token: int) -> None:
        req = sample.request
        p = req.sampling_params
        past_min = req.num_output_tokens >= p.min_tokens
        if token in self.tokenizer.eos_token_ids and not p.ignore_eos and past_min:
            return self._finish(req, RequestStatus.FINISHED_STOPPED)
        if token in p.stop_token_ids and past_min:
            req.stop_reason = token
            return self._finish(req, RequestStatus.FINISHED_STOPPED)
        stop = sample.detok.add_token(token)  # matches only past min_tokens
        if stop is not None:
            req.stop_reason = stop
            return self._finish(req, RequestStatus.FINISHED_STOPPED)
        if req.grammar is not None and req.grammar.is_stopped():  # the grammar is complete
            return self._finish(req, RequestStatus.FINISHED_STOPPED)
        if req.num_output_tokens >= req.max_tokens:
            return self._finish(req, RequestStatus.FINISHED_LENGTH)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(req, status)
        if self.speculator is not None:
            self.speculator.release(req)  # a draft model's blocks for it
        req.finished_time = time.perf_counter()

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, s in enumerate(group.samples):
            req = s.request
            new_ids = req.output_token_ids[s.emitted_tokens:]
            s.emitted_tokens = req.num_output_tokens
            reason = req.finish_reason
            delta = s.detok.get_delta(final=req.is_finished)  # before .text: final flushes
            # Timings are final only at the end; building them every step would walk every
            # token time of every running request on the hot path.
            if req.is_finished and s.metrics is None:
                s.metrics = RequestMetrics.of(req)
            outs.append(CompletionOutput(
                index=i, text=s.detok.text, token_ids=list(req.output_token_ids),
                finish_reason=reason.value if reason else None, stop_reason=req.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                delta_text=delta, delta_token_ids=new_ids, metrics=s.metrics))
        finished = group.finished
        if finished:
            self._groups.pop(group.request_id, None)
            for s in group.samples:
                self._owner.pop(s.request.request_id, None)
        plp = group.prompt_logprobs
        if plp is not None and len(plp) < len(group.prompt_token_ids):
            plp = None  # not complete yet
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                             finished, prompt_logprobs=plp)


@dataclass
class EngineStats:
    """Counters since start, for metrics and benchmarks.

    Steps with prompt tokens count as prefill steps (their time is mostly arithmetic),
    steps of decodes only as decode steps (their time is mostly reading weights and KV).
    Bytes and FLOPs are the roofline model's (ModelShape), not measured.
    """

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0  # tokens sampled (decodes and prompts' first tokens)
    num_aborted: int = 0
    num_decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_bytes: float = 0.0    # weights + KV read by decode-only steps
    decode_flops: float = 0.0    # their matmul and attention FLOPs
    prefill_seconds: float = 0.0
    prefill_bytes: float = 0.0   # weights + KV read by prefill steps
    # matmul FLOPs of prefill steps' prompt tokens (LM head, last layer's tail: sampled rows)
    prefill_flops: float = 0.0

    # Pooling (embedding) requests finished, and their prompt tokens (within prefill's).
    num_pooling_requests: int = 0
    num_pooling_tokens: int = 0

    # Speculative decoding: sequences verified with drafts, draft tokens, accepted drafts.
    num_spec_verifications: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    def record_spec(self, num_draft: int, num_accepted: int) -> None:
        self.num_spec_verifications += 1
        self.num_spec_draft_tokens += num_draft
        self.num_spec_accepted_tokens += num_accepted
        self.num_generated_tokens += num_accepted  # beyond the one record_step counts

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts / drafts verified."""
        d = self.num_spec_draft_tokens
        return self.num_spec_accepted_tokens / d if d else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification: accepted drafts + the target's own token."""
        v = self.num_spec_verifications
        return 1 + self.num_spec_accepted_tokens / v if v else None

    def record_step(self, sched, seconds: float, shape: ModelShape) -> None:
        self.num_steps += 1
        num_tokens = prefill_tokens = 0
        flops = kv_bytes = attention = 0.0
        for s in sched.scheduled:
            n = s.num_new_tokens
            num_tokens += n
            kv_bytes += shape.kv_read_bytes(s.start + n)  # each sequence's context read once
            attention += n * shape.attention_flops(s.start + n)  # (its last query's, n times)
            samples = s.samples and s.request.pooling_params is None
            if samples:
                self.num_generated_tokens += 1  # accepted drafts: record_spec
            if s.num_draft or (n == 1 and s.start >= s.request.num_prompt_tokens):
                self.num_decode_tokens += n  # a verification: the token and its drafts
            else:
                prefill_tokens += n
                flops += shape.prefill_flops(n, context=s.start + n // 2,
                                             sampled_rows=1 if samples else 0)
        # Every weight once (a MoE model: the experts this many tokens are expected to reach).
        read = shape.weight_bytes(num_tokens) + kv_bytes
        self.num_prefill_tokens += prefill_tokens
        if prefill_tokens:
            self.prefill_seconds += seconds
            self.prefill_bytes += read
            self.prefill_flops += flops
        else:
            self.num_decode_steps += 1
            self.decode_seconds += seconds
            self.decode_bytes += read
            # One token a sequence (a verification: its drafts too), each reading its keys.
            self.decode_flops += num_tokens * shape.flops_per_token(0) + attention

    @property
    def decode_bandwidth(self) -> float | None:
        """Achieved bytes/s of decode-only steps."""
        return self.decode_bytes / self.decode_seconds if self.decode_seconds else None

    @property
    def prefill_flops_rate(self) -> float | None:
        """Achieved prompt FLOP/s of prefill steps."""
        return self.prefill_flops / self.prefill_seconds if self.prefill_seconds else None
