"""Engine configuration: frozen dataclasses, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# Weight formats: None = the checkpoint's own (a GGUF's tensor types, an HF
# quantization_config; dequantised when an explicit dtype is given), "none" = dequantised.
QUANTIZATIONS = (None, "none", "int8", "int4")
# How a linear layer's matmul runs (servelm.layers.linear_methods); "auto": chosen per layer
# shape and row bucket by measuring this machine (servelm.tuning).
LINEAR_METHODS = ("auto", "tiles", "onednn", "qdot", "int4pack", "int8pack", "gemv", "gemv_rows",
                  "panels", "q8act", "bfp", "amx", "torch")
KERNEL_TUNING = ("off", "cached", "fresh")
# How the KV pool stores K and V: "auto" in the model's dtype; "int8" (symmetric) and "fp8"
# (e4m3) with one fp32 scale per token and KV head (servelm.models.kv_quant).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# How attention runs over the paged KV cache (servelm.attention): "auto" picks the C++
# kernels on the CPU, Triton on CUDA, else the gather + SDPA reference.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "cpu_sdpa", "cpu_amx", "triton")
INVARIANCE_COST = 1.10  # batch_invariant=None: invariant where it costs at most 10% more


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: block size and how much memory it may take."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = a default that fits the machine
    enable_prefix_caching: bool = True  # share full blocks of identical prefixes
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # The server commits the pool's memory while it is idle (KVCache.commit_next), so no
    # prompt's step pays the first touch of its blocks; off: pages come as tokens land.
    commit_while_idle: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None = the model's context length
    # Admission keeps free the blocks running requests need for this many more tokens:
    # fewer preemptions (each one recomputes a sequence) when the KV pool is tight.
    admission_lookahead: int = 64

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Each running sequence needs one token of the budget per step to decode.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs}), or running sequences "
                             f"could be left out of steps")
        if self.admission_lookahead < 0:
            raise ValueError(f"admission_lookahead must be >= 0, got {self.admission_lookahead}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class KernelConfig:
    """How a step runs, decided once at start-up: every code-path choice is a field here."""

    # servelm's C++ CPU kernels (attention over block tables, fused norms/rotary, tiled and
    # quantised matmuls, the DecodeStack); False: the PyTorch eager reference everywhere.
    cpu_kernels: bool = True
    # "auto": each linear layer runs, per row bucket, the method measured fastest here (that
    # passed its known-answer check); else that one method wherever it applies.
    linear_method: str = "auto"
    # off: the built-in defaults, nothing timed; cached: timed once per machine, CPU,
    # weight format and thread count, then read back; fresh: timed now (cache rewritten).
    tuning: str = "cached"
    tuning_cache_dir: str | None = None  # None: $XDG_CACHE_HOME/servelm or ~/.cache/servelm
    # Batch invariance: each layer runs one method for every row count, one whose rows were
    # checked bit-identical whatever the row count, so a request's results never depend on
    # what shares its steps. None: wherever that costs at most INVARIANCE_COST more linear
    # time in every row bucket (measured); True: always (where such methods exist); False:
    # the fastest method per bucket.
    batch_invariant: bool | None = None
    fused_decode: bool = True      # decode-only steps on the DecodeStack (one C++ call)
    hugepages: bool = True         # weights and KV cache in 2 MB transparent huge pages
    triton_attention: bool = True  # CUDA: Triton attention in place over the block tables
    # CPU tensor parallelism: the model's all-reduces and gathers between ranks on one host
    # through a shared-memory segment (servelm.distributed.shm); False, or ranks on several
    # hosts: gloo for all of them.
    shm_collectives: bool = True
    # servelm.attention's backend, chosen once at start-up: "auto" (cpu where the C++ kernels
    # run, else triton where it runs, else reference) or one by name, refused at start-up
    # (ValueError) where it cannot run.
    attention_backend: str = "auto"
    # Bytes the dequantised weight copies of a quantised model may take (the amx and onednn
    # methods hold a layer's weight again in the activation dtype, for faster prompts);
    # past it the largest layers do without. None: a quarter of the memory available when
    # the tuner decides; 0: none.
    dequantized_copy_bytes: int | None = None
    # Structured outputs: the next-token masks of the step's constrained rows computed on a
    # background thread while the forward runs (structured_outputs.MaskPrefetch).
    overlap_grammar_masks: bool = True

    def __post_init__(self) -> None:
        if self.dequantized_copy_bytes is not None and (
                isinstance(self.dequantized_copy_bytes, bool)
                or not isinstance(self.dequantized_copy_bytes, int)
                or self.dequantized_copy_bytes < 0):
            raise ValueError(f"dequantized_copy_bytes must be an integer >= 0 or None "
                             f"(auto), got {self.dequantized_copy_bytes!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.attention_backend in ("cpu", "cpu_sdpa", "cpu_amx") and self.cpu_kernels is False:
            raise ValueError(f"attention_backend {self.attention_backend!r} runs servelm's C++ "
                             "kernels, which cpu_kernels=False turns off")
        if self.attention_backend == "triton" and self.triton_attention is False:
            raise ValueError("attention_backend 'triton' runs the Triton kernels, which "
                             "triton_attention=False turns off")
        if self.linear_method not in LINEAR_METHODS:
            raise ValueError(f"linear_method must be one of {', '.join(LINEAR_METHODS)}, "
                             f"got {self.linear_method!r}")
        if self.tuning not in KERNEL_TUNING:
            raise ValueError(f"kernel tuning must be one of {', '.join(KERNEL_TUNING)}, "
                             f"got {self.tuning!r}")
        for name in ("cpu_kernels", "fused_decode", "hugepages", "triton_attention",
                     "shm_collectives", "overlap_grammar_masks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True, False or None (auto), "
                             f"got {self.batch_invariant!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (servelm.spec): each decoding sequence guesses up to
    num_speculative_tokens next tokens, and one target forward verifies them all.

    ngram: the guess is what followed the latest earlier occurrence of the sequence's last
    n tokens (prompt lookup), n from prompt_lookup_max down to prompt_lookup_min. As in
    vLLM: given one bound, the other takes its value; given neither, both are 5.
    draft_model: a smaller model with the same vocabulary drafts them, one at a time.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: the draft's GGUF file or HF directory

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer "
                             f">= 1, got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config model is for method 'draft_model', "
                                 "not 'ngram'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo or hi or 5), (hi or lo or 5)
            if lo > hi:
                raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if not self.model or not isinstance(self.model, str):
                raise ValueError(f"speculative_config model (the draft model's path) is "
                                 f"required for method 'draft_model', got {self.model!r}")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} is for method 'ngram', "
                                     f"not 'draft_model'")

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """From vLLM's speculative_config dict; an unknown key is a ValueError naming it."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {d!r}")
        known = {f for f in cls.__dataclass_fields__}
        for key in d:
            if key not in known:
                raise ValueError(f"speculative_config has an unknown field {key!r} "
                                 f"(known: {', '.join(sorted(known))})")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an LLMEngine is built from."""

    # GGUF file, HF directory, Hugging Face id ORG/NAME or ORG/NAME:QUANT (servelm.models.hub);
    # None = the embedded default
    model: str | None = None
    revision: str | None = None  # of a Hugging Face id: branch, tag or commit
    download_dir: str | None = None  # Hugging Face cache directory (default: HF's own)
    tokenizer: str | None = None  # another GGUF / HF directory / id to take the tokenizer from
    # A chat template replacing the model's (Jinja source), and variables every render gets
    # (a request's chat_template_kwargs override them).
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    # auto: bfloat16 on CUDA and CPUs with AMX/AVX512-BF16, else float32 (bfloat16 for int4
    # where the q8act kernel runs and for unquantised weights where bfp runs; int8 stays
    # float32: engine.resolve_dtype)
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None = physical cores (CPU)
    tensor_parallel_size: int = 1  # ranks sharing every weight (servelm.distributed); 1 = none
    # weight-only: None (the checkpoint's), "none", "int8" (per channel), "int4" (groups of 32)
    quantization: str | None = None
    # CUDA: decode steps replay captured graphs (servelm.engine.cuda_graphs) unless this is
    # set; the eager model is then used for every step, as on the CPU.
    enforce_eager: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    speculative: SpeculativeConfig | None = None  # None: one token per sequence per step

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of None (the checkpoint's), 'none', "
                             f"'int8', 'int4', got {self.quantization!r}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs,
                                                                    dict):
            raise ValueError(f"chat_template_kwargs must be a dict, "
                             f"got {self.chat_template_kwargs!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.speculative is not None and self.tensor_parallel_size > 1:
            # Refused before any rank starts (the draft would need its own sharded runner).
            raise ValueError("speculative_config is not supported with tensor_parallel_size > 1")
