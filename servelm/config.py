"""Engine configuration: frozen dataclasses, validated once at start-up.

Every engine option is declared once, here, as a config field made with `option(...)`: its
default, its `LLM(...)` keyword, its CLI flags and their help. `servelm.cli.add_engine_args`
and `LLM(...)`'s keywords are generated from these fields (`engine_options()`), and
`EngineConfig.from_options(**keywords)` builds the config from those keywords."""

from __future__ import annotations

import dataclasses
import difflib
import json
import textwrap
import typing
from dataclasses import MISSING, dataclass, field
from functools import lru_cache
from typing import Any, Callable

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# Weight formats: None = the checkpoint's own (a GGUF's tensor types, an HF
# quantization_config; dequantised when an explicit dtype is given), "none" = dequantised.
QUANTIZATIONS = (None, "none", "int8", "int4")
# How a linear layer's matmul runs (servelm.layers.linear_methods); "auto": chosen per layer
# shape and row bucket by measuring this machine (servelm.tuning).
LINEAR_METHODS = ("auto", "tiles", "onednn", "qdot", "int4pack", "int8pack", "gemv", "gemv_rows",
                  "panels", "q8act", "bfp", "amx", "w8a8", "w8a8_pairs", "w8a8_amx",
                  "torch")
KERNEL_TUNING = ("off", "cached", "fresh")
INT8_ACTIVATIONS = ("auto", "off")
# How the KV pool stores K and V: "auto" in the model's dtype; "int8" (symmetric) and "fp8"
# (e4m3) with one fp32 scale per token and KV head (servelm.models.kv_quant).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# How linear-attention layers keep their recurrent state (vLLM's --mamba-ssm-cache-dtype):
# "auto" is float32 here.
SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
# How attention runs over the paged KV cache (servelm.attention): "auto" picks the C++
# kernels on the CPU, Triton on CUDA, else the gather + SDPA reference.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "cpu_sdpa", "cpu_amx", "triton")
INVARIANCE_COST = 1.10  # batch_invariant=None: invariant where it costs at most 10% more


# ---------------------------------------------------------------- options: declared once

OPTION = "servelm.option"  # a field's metadata key: its Option
GROUP = "servelm.cli_group"  # a sub-config field's metadata key: its flags' --help group


@dataclass(frozen=True)
class Option:
    """How a config field is set from outside the engine: `LLM(keyword=...)` and CLI flags.

    help: the flag's --help text (for the flags in `flags`, else for those in `no_flags`).
    keyword: the LLM keyword (and argparse dest), where it is not the field's name.
    flags: the CLI spellings; None: `--keyword-with-dashes` (a bool: only if its default is
    not True); (): no flag, and `no_flag` says why.
    no_flags: a bool's store_false spellings (None: `--no-keyword` where its default is True,
    else none), `no_help` their help where `flags` has its own.
    parse: CLI text -> value (argparse's type; a ValueError is a usage error naming the flag).
    convert: a keyword's value -> the field's (for CLI values and LLM keywords alike).
    dest: where a command's parsed arguments hold the value, where it is not the keyword.
    """

    help: str
    keyword: str | None = None
    flags: tuple[str, ...] | None = None
    no_flags: tuple[str, ...] | None = None
    no_help: str | None = None
    parse: Callable[[str], Any] | None = None
    convert: Callable[[Any], Any] | None = None
    choices: tuple | None = None
    metavar: str | None = None
    keyword_type: str | None = None  # LLM's annotation, where it takes more than the field
    no_flag: str | None = None  # why a field has no flag
    dest: str | None = None
    nargs: str | None = None  # a value flag taking several values (argparse's nargs)


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **spec) -> Any:
    """A config field that is an engine option: `Option(**spec)` in its metadata."""
    return field(default=default, default_factory=default_factory,
                 metadata={OPTION: Option(**spec)})


@dataclass(frozen=True)
class EngineOption:
    """One engine option as the CLI and LLM(...) see it: a config field and its Option."""

    name: str  # the field's name in its config
    section: str | None  # the EngineConfig field holding that config; None: EngineConfig's own
    config: type
    type: Any  # the field's type (resolved annotation)
    default: Any
    spec: Option
    group: str  # the --help group of its flags

    @property
    def keyword(self) -> str:
        return self.spec.keyword or self.name

    @property
    def dest(self) -> str:
        return self.spec.dest or self.keyword

    @property
    def is_bool(self) -> bool:
        return self.type in (bool, bool | None)

    @property
    def flags(self) -> tuple[str, ...]:
        if self.spec.flags is not None:
            return self.spec.flags
        if self.is_bool and self.default is True:
            return ()
        return ("--" + self.keyword.replace("_", "-"),)

    @property
    def no_flags(self) -> tuple[str, ...]:
        if self.spec.no_flags is not None:
            return self.spec.no_flags
        if self.is_bool and self.default is True:
            return ("--no-" + self.keyword.replace("_", "-"),)
        return ()

    @property
    def path(self) -> str:
        """Where the field lives, e.g. 'KernelConfig.tuning'."""
        return f"{self.config.__name__}.{self.name}"


def _option(config: type, f: dataclasses.Field, hints: dict, section: str | None,
            group: str) -> EngineOption:
    if f.metadata.get(OPTION) is None:
        raise TypeError(f"{config.__name__}.{f.name} is not declared with option()")
    default = f.default if f.default is not MISSING else f.default_factory()
    return EngineOption(f.name, section, config, hints[f.name], default, f.metadata[OPTION],
                        group)


def options_of(config: type) -> list[EngineOption]:
    """Every option a config dataclass declares, in declaration order, its sub-configs'
    (fields declared with sub_config) expanded in place. A TypeError if a field is neither,
    or two options share a keyword."""
    out = []
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if GROUP in f.metadata:
            sub = f.default_factory
            sub_hints = typing.get_type_hints(sub)
            out.extend(_option(sub, g, sub_hints, f.name, f.metadata[GROUP])
                       for g in dataclasses.fields(sub))
        else:
            out.append(_option(config, f, hints, None, "engine"))
    keywords = [o.keyword for o in out]
    dup = sorted({k for k in keywords if keywords.count(k) > 1})
    if dup:
        raise TypeError(f"{config.__name__}: more than one option has the keyword "
                        f"{', '.join(dup)}")
    return out


def sub_config(config: type, group: str = "engine") -> Any:
    """A field holding a config dataclass whose own fields are options; `group`: the --help
    group their flags are listed under."""
    return field(default_factory=config, metadata={GROUP: group})


@lru_cache(maxsize=None)
def _engine_options(config: type) -> tuple[EngineOption, ...]:
    return tuple(options_of(config))


def engine_options(config: type | None = None) -> tuple[EngineOption, ...]:
    """EngineConfig's options in declaration order: what add_engine_args and LLM take."""
    return _engine_options(config or EngineConfig)


def config_from_options(config: type, options: dict[str, Any], caller: str):
    """`config` (EngineConfig or one shaped like it) from option keywords: each value goes to
    its field (through its Option's convert), each sub-config is built from its own; an
    unknown keyword is a TypeError naming it, as Python's own."""
    specs = {o.keyword: o for o in engine_options(config)}
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for keyword, value in options.items():
        o = specs.get(keyword)
        if o is None:
            raise TypeError(f"{caller}() got an unexpected keyword argument {keyword!r}"
                            + _did_you_mean(keyword, specs))
        if o.spec.convert is not None and value is not None:
            value = o.spec.convert(value)
        if o.section is None:
            top[o.name] = value
        else:
            sections.setdefault(o.section, {})[o.name] = value
    for f in dataclasses.fields(config):
        if GROUP in f.metadata:
            top[f.name] = f.default_factory(**sections.get(f.name, {}))
    return config(**top)


def _did_you_mean(keyword: str, specs: dict[str, EngineOption]) -> str:
    for o in specs.values():
        if keyword == o.name:
            return f" ({o.path} is the keyword {o.keyword!r})"
    close = difflib.get_close_matches(keyword, list(specs), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def options_doc(config: type | None = None) -> str:
    """The options as a docstring: each keyword, its default, and what it does."""
    lines = []
    for o in engine_options(config):
        flags = o.flags or o.no_flags
        cli = f" [{', '.join(flags)}]" if flags else ""
        text = o.spec.help if o.flags or not o.no_flags else f"{o.no_flags[0]}: {o.spec.help}"
        if o.flags and o.no_flags and o.spec.no_help:
            text = f"{text}; {o.no_flags[0]}: {o.spec.no_help}"
        lines.append(f"{o.keyword}={o.default!r}{cli} ({o.path})")
        lines.extend(textwrap.wrap(text, 88, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines)


# CLI text -> value (Option.parse; a ValueError's message is the usage error).

SIZE_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
              "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                 "fp32": "float32"}


def size(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    t = text.strip().lower()
    try:
        for suffix, mult in SIZE_UNITS.items():
            if t.endswith(suffix):
                return int(float(t[: -len(suffix)]) * mult)
        return int(float(t))
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 1GiB, 512MB, 1e9)") from None


def dtype_name(text: str) -> str:
    """A dtype, vLLM's and PyTorch's short names accepted: half, fp16, bf16, float, fp32."""
    return DTYPE_ALIASES.get(text.lower(), text.lower())


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def chat_template(text: str) -> str:
    """A chat template given as a file or as the Jinja source itself, compiled."""
    from servelm.tokenizer import load_chat_template

    return load_chat_template(text)


def speculative_config(value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
    """vLLM's speculative_config, as JSON text or a dict -> SpeculativeConfig."""
    if isinstance(value, str):
        value = json_object(value)
    if isinstance(value, dict):
        try:
            return SpeculativeConfig.from_dict(value)
        except TypeError as e:
            raise ValueError(str(e)) from None
    return value


# ---------------------------------------------------------------- the configs

@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: block size and how much memory it may take."""

    # bytes; None = a default that fits the machine
    kv_cache_memory: int | None = option(
        None, parse=size, metavar="BYTES",
        help="KV cache pool size, e.g. 1GiB (default: fits the machine)")
    kv_cache_dtype: str = option(  # one of KV_CACHE_DTYPES
        "auto", choices=KV_CACHE_DTYPES,
        help="how the KV pool stores K and V: the model dtype (auto), or int8 / fp8 (e4m3) "
             "with a scale per token and KV head (~2x the tokens of bf16 in the same "
             "--kv-cache-memory)")
    mamba_ssm_cache_dtype: str = option(  # one of SSM_CACHE_DTYPES (executor.ssm_state_dtype)
        "auto", choices=SSM_CACHE_DTYPES,
        help="how linear-attention layers (Qwen3.5, Qwen3-Next) keep their recurrent state: "
             "float32 (auto), or bfloat16 (half the bytes a sequence and a step; each new "
             "value rounded)")
    block_size: int = option(16, help="tokens per KV block")
    enable_prefix_caching: bool = option(  # share full blocks of identical prefixes
        True, flags=("--enable-prefix-caching",),
        no_flags=("--no-prefix-caching", "--no-enable-prefix-caching"),
        help="share KV blocks of identical prompt prefixes (the default)",
        no_help="do not share KV blocks of identical prompt prefixes")
    # A hybrid model (windowed and full attention layers: Gemma 2/3, gpt-oss, Llama 4...):
    # its layers' pages in groups of equal size, the windowed groups' pages out of reach
    # given back (ModelConfig.kv_groups); off: one block table, every layer's keys kept.
    hybrid_kv_cache: bool = option(
        True, flags=("--hybrid-kv-cache",),
        no_flags=("--no-hybrid-kv-cache", "--disable-hybrid-kv-cache-manager"),
        help="a model with sliding-window and full-attention layers keeps only the window's "
             "keys of its sliding layers (the default)",
        no_help="keep every layer's keys for the whole sequence on hybrid windowed models "
                "(one block table for all layers)")
    # The server commits the pool's memory while it is idle (KVCache.commit_next), so no
    # prompt's step pays the first touch of its blocks; off: pages come as tokens land.
    commit_while_idle: bool = option(
        True, keyword="commit_kv_while_idle", no_flags=("--no-kv-commit-while-idle",),
        help="the server leaves the KV pool's pages to be committed as tokens land in them, "
             "instead of committing them while idle (lower RSS until the pool is used; "
             "prompts then pay first-touch faults)")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.mamba_ssm_cache_dtype not in SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype must be one of "
                             f"{', '.join(SSM_CACHE_DTYPES)}, got {self.mamba_ssm_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step."""

    max_num_seqs: int = option(256, help="max sequences per step")
    max_num_batched_tokens: int = option(
        4096, help="max tokens per step (longer prompts are prefilled in chunks)")
    max_model_len: int | None = option(  # None = the model's context length
        None, flags=("--max-model-len", "--ctx-size", "-c"),
        help="cap on context length (default: the model's)")
    # Admission keeps free the blocks running requests need for this many more tokens:
    # fewer preemptions (each one recomputes a sequence) when the KV pool is tight.
    admission_lookahead: int = option(
        64, metavar="TOKENS",
        help="admit a request only if running ones keep room for this many more tokens each "
             "(fewer preemptions in a tight KV pool; 0: off)")

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


def lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """LoRA adapters served from start-up, as (name, path) pairs, from vLLM's spellings:
    'name=path' strings (or a list of them), JSON objects {"name": ..., "path": ...}, or a
    dict name -> path."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = list(value.items())
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        value = [value]
    out = []
    for item in value:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            item = json_object(item)
        if isinstance(item, dict):
            if not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
                raise ValueError(f"a LoRA module needs a 'name' and a 'path', got {item!r}")
            item = (item["name"], item["path"])
        elif isinstance(item, str):
            name, eq, path = item.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"a LoRA module is name=path, got {item!r}")
            item = (name, path)
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(x, str) and x for x in item)):
            raise ValueError(f"a LoRA module is name=path, got {item!r}")
        out.append((item[0], item[1]))
    names = [n for n, _ in out]
    for n in names:
        if names.count(n) > 1:
            raise ValueError(f"LoRA module {n!r} is named twice")
    return tuple(out)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (servelm.lora)."""

    enable_lora: bool = option(False, help="serve LoRA adapters (--lora-modules, "
                               "LoRARequest, /v1/load_lora_adapter)")
    max_loras: int = option(
        4, metavar="N",
        help="adapters resident at once (a step holds at most N; the least recently used "
             "one is evicted for another)")
    max_lora_rank: int = option(16, metavar="R", help="the largest adapter rank accepted")
    lora_modules: tuple = option(
        (), parse=str, convert=lora_modules, nargs="+", metavar="NAME=PATH",
        keyword_type="dict | list | tuple",
        help="adapters served from start-up, each NAME=PATH (a PEFT directory or a GGUF LoRA) "
             "or a JSON object with name and path; implies --enable-lora")

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        object.__setattr__(self, "lora_modules", lora_modules(self.lora_modules))

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


@dataclass(frozen=True)
class KernelConfig:
    """How a step runs, decided once at start-up: every code-path choice is a field here."""

    # off: the built-in defaults, nothing timed; cached: timed once per machine, CPU,
    # weight format and thread count, then read back; fresh: timed now (cache rewritten).
    tuning: str = option(
        "cached", keyword="kernel_tuning", choices=KERNEL_TUNING,
        help="linear methods per layer shape and row bucket: measured once per machine and "
             "cached (cached), measured now (fresh), or the built-in defaults (off)")
    # "auto": each linear layer runs, per row bucket, the method measured fastest here (that
    # passed its known-answer check); else that one method wherever it applies, or of a
    # comma-separated list, the first that applies.
    linear_method: str = option(
        "auto", metavar="METHOD[,METHOD...]",
        help="one matmul method for every linear layer where it applies, or of a list the "
             "first that applies (" + ", ".join(LINEAR_METHODS[1:]) + "; default auto: the "
             "measured table)")
    # Batch invariance: each layer runs one method for every row count, one whose rows were
    # checked bit-identical whatever the row count, so a request's results never depend on
    # what shares its steps. None: wherever that costs at most INVARIANCE_COST more linear
    # time in every row bucket (measured); True: always (where such methods exist); False:
    # the fastest method per bucket.
    batch_invariant: bool | None = option(
        None, no_flags=("--no-batch-invariant",),
        help="always run batch-invariant matmuls (each layer one method whose rows were "
             "checked bit-identical at every row count), so a request's results do not depend "
             "on what shares its steps (default: wherever that costs at most 10% more, "
             "measured)",
        no_help="the fastest method per row bucket, invariant or not")
    # Bytes the dequantised weight copies of a quantised model may take (the amx and onednn
    # methods hold a layer's weight again in the activation dtype, for faster prompts; w8a8
    # an int8 copy, of a bf16 model's layers too);
    # past it the largest layers do without. None: a quarter of the memory available when
    # the tuner decides; 0: none.
    dequantized_copy_bytes: int | None = option(
        None, keyword="dequantized_copy_memory", parse=size, metavar="BYTES",
        help="how much memory a quantised model's dequantised weight copies may take (the "
             "amx and onednn methods keep a layer's weight in the activation dtype too, for "
             "faster prompts; w8a8 an int8 copy, a bf16 model's too); 0: none (default: a "
             "quarter of the memory available at start-up)")
    # Int8 activations for the compute-bound calls (prompts, batches): the qkv, o, gate_up
    # and down_proj layers calibrated at start-up on a
    # built-in text (servelm.engine.calibration),
    # then the w8a8 method (servelm.layers.w8a8) is one more the tuner measures (bf16
    # activations, AVX-512 VNNI; on CUDA its Triton form, servelm.tuning_cuda); off: never,
    # and the outputs keep the bf16 (or q8act's) activations at every row count.
    int8_activations: str = option(
        "auto", choices=INT8_ACTIVATIONS,
        help="int8 activations (SmoothQuant-smoothed, blocks of up to 128 inputs) for the "
             "qkv, o and gate_up layers (and down_proj on bf16 weights) of prompts and "
             "batches, where the CPU has AVX-512 VNNI (or the GPU int8 tensor cores) and "
             "they measure faster (auto), or never (off)")
    # Structured outputs: the next-token masks of the step's constrained rows computed on a
    # background thread while the forward runs (structured_outputs.MaskPrefetch).
    overlap_grammar_masks: bool = option(
        True, help="structured outputs: compute the grammars' masks after the forward, not on "
                   "a thread beside it")
    tuning_cache_dir: str | None = option(  # None: $XDG_CACHE_HOME/servelm or ~/.cache/servelm
        None, metavar="DIR", help="where the tuning table is cached (default: ~/.cache/servelm)")
    # A provisional table (timings unstable at start-up, not cached) or one the decode steps
    # contradict is measured again while the engine idles, and cached (servelm.retune).
    retune_when_idle: bool = option(
        True, help="never measure the linear methods again while the engine idles (a "
                   "table timed unstably at start-up then stays uncached)")
    # servelm's C++ CPU kernels (attention over block tables, fused norms/rotary, tiled and
    # quantised matmuls, the DecodeStack); False: the PyTorch eager reference everywhere.
    cpu_kernels: bool = option(
        True, help="the PyTorch eager reference instead of servelm's C++ CPU kernels")
    fused_decode: bool = option(  # decode-only steps on the DecodeStack (one C++ call)
        True, help="decode steps op by op instead of on the one-call DecodeStack")
    hugepages: bool = option(  # weights, LoRA slots and KV cache in 2 MB transparent huge pages
        True, help="weights, LoRA slots and KV cache in plain pages, not 2 MB huge pages")
    # CPU tensor parallelism: the model's all-reduces and gathers between ranks on one host
    # through a shared-memory segment (servelm.distributed.shm); False, or ranks on several
    # hosts: gloo for all of them.
    shm_collectives: bool = option(
        True, help="CPU tensor parallelism: gloo for the ranks' all-reduces, not shared memory")
    triton_attention: bool = option(  # CUDA: Triton attention in place over the block tables
        True, no_flags=("--no-triton",),
        help="CUDA: gather + SDPA attention instead of the Triton kernels")
    # servelm.attention's backend, chosen once at start-up: "auto" (cpu where the C++ kernels
    # run, else triton where it runs, else reference) or one by name, refused at start-up
    # (ValueError) where it cannot run.
    attention_backend: str = option(
        "auto", choices=ATTENTION_BACKENDS,
        help="attention over the paged KV cache: servelm's C++ kernels (cpu; cpu_sdpa / "
             "cpu_amx: prompts on PyTorch's flash attention / on servelm's AMX kernel), Triton "
             "(CUDA), or gather + SDPA (reference); default auto: the fastest cpu backend "
             "measured here where the C++ kernels run, else triton where it runs, else "
             "reference. One that cannot run here is refused at start-up")

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
        if self.linear_method != "auto" and not (
                isinstance(self.linear_method, str)
                and all(m in LINEAR_METHODS[1:] for m in self.linear_method.split(","))):
            raise ValueError(f"linear_method must be auto, or one or more (comma-separated) of "
                             f"{', '.join(LINEAR_METHODS[1:])}, got {self.linear_method!r}")
        if self.int8_activations not in INT8_ACTIVATIONS:
            raise ValueError(f"int8_activations must be one of {', '.join(INT8_ACTIVATIONS)}, "
                             f"got {self.int8_activations!r}")
        if self.tuning not in KERNEL_TUNING:
            raise ValueError(f"kernel tuning must be one of {', '.join(KERNEL_TUNING)}, "
                             f"got {self.tuning!r}")
        for name in ("cpu_kernels", "fused_decode", "hugepages", "triton_attention",
                     "shm_collectives", "overlap_grammar_masks", "retune_when_idle"):
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
    """Everything an LLMEngine is built from: its own options and its sub-configs'."""

    # GGUF file, HF directory, Hugging Face id ORG/NAME or ORG/NAME:QUANT (servelm.models.hub);
    # None = the embedded default
    model: str | None = option(
        None, flags=("--model", "-m"),
        help="GGUF file, Hugging Face model directory, Hugging Face id ORG/NAME, or "
             "ORG/NAME:QUANT for a GGUF in such a repo (default: the embedded SmolLM2-135M); "
             "`servelm models` lists those here")
    revision: str | None = option(  # of a Hugging Face id: branch, tag or commit
        None, help="of a Hugging Face id: branch, tag or commit (default: main)")
    download_dir: str | None = option(  # Hugging Face cache directory (default: HF's own)
        None, metavar="DIR",
        help="Hugging Face cache to read and download into (default: HF_HUB_CACHE or "
             "~/.cache/huggingface/hub); HF_HUB_OFFLINE=1 never downloads")
    tokenizer: str | None = option(  # another GGUF / HF directory / id to take it from
        None, help="take the tokenizer (and chat template) from this model instead")
    # A chat template replacing the model's (Jinja source), and variables every render gets
    # (a request's chat_template_kwargs override them).
    chat_template: str | None = option(
        None, parse=chat_template, convert=chat_template, metavar="FILE|JINJA",
        help="chat template replacing the model's: a file, or the Jinja source")
    chat_template_kwargs: dict | None = option(
        None, parse=json_object, metavar="JSON",
        help="variables every chat template render gets, e.g. '{\"enable_thinking\": false}' "
             "(a request's own override them)")
    # auto: bfloat16 on CUDA and CPUs with AMX/AVX512-BF16, else float32 (bfloat16 for int4
    # where the q8act kernel runs and for unquantised weights where bfp runs; int8 stays
    # float32: engine.resolve_dtype)
    dtype: str = option(
        "auto", parse=dtype_name, choices=DTYPES,
        help="activation (and unquantised weight) dtype; half, fp16, bf16, float and fp32 are "
             "accepted too. auto: bfloat16 where the machine runs it fast, else float32")
    # weight-only: None (the checkpoint's), "none", "int8" (per channel), "int4" (groups of 32)
    quantization: str | None = option(
        None, flags=("--quantization", "-q"), choices=tuple(q for q in QUANTIZATIONS if q),
        help="weight format: int8 per channel, int4 in groups of 32, none (dequantised). "
             "Default: the checkpoint's own (a GGUF's Q4/Q5/K-quant tensors int4, Q8_0/Q6_K "
             "int8, F16/BF16 as they are; an HF quantization_config), dequantised if --dtype "
             "is given")
    device: str = option("auto", help="auto, cpu, cuda or cuda:N")
    seed: int = option(
        0, flags=(), dest="engine_seed",
        no_flag="`servelm serve --seed` (dest engine_seed) sets it; generate's and chat's "
                "--seed is the sampling seed",
        help="the engine's seed (a request's own 'seed' makes it reproducible)")
    cache: CacheConfig = sub_config(CacheConfig)
    lora: LoRAConfig = sub_config(LoRAConfig, "LoRA adapters")
    scheduler: SchedulerConfig = sub_config(SchedulerConfig)
    num_threads: int | None = option(  # torch intra-op threads; None = physical cores (CPU)
        None, flags=("--num-threads", "--threads", "-t"),
        help="CPU threads (default: one per physical core)")
    # CUDA: decode steps replay captured graphs (servelm.engine.cuda_graphs) unless this is
    # set; the eager model is then used for every step, as on the CPU.
    enforce_eager: bool = option(
        False, help="CUDA: run every step eagerly, without replaying captured decode graphs")
    tensor_parallel_size: int = option(  # ranks sharing every weight (servelm.distributed)
        1, flags=("--tensor-parallel-size", "-tp"), metavar="N",
        help="shard the model over N processes (under torchrun: its WORLD_SIZE; --num-threads "
             "is then shared among the ranks on this host)")
    # None: one token per sequence per step (servelm.spec)
    speculative: SpeculativeConfig | None = option(
        None, keyword="speculative_config", parse=speculative_config,
        convert=speculative_config, metavar="JSON", keyword_type="dict | SpeculativeConfig | None",
        help="speculative decoding, as vLLM's: e.g. '{\"method\": \"ngram\", "
             "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'")
    kernels: KernelConfig = sub_config(KernelConfig,
                                       "kernels (how a step runs; decided once at start-up)")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The config from LLM(...)'s keywords (engine_options(): each names one field of
        this config or of a sub-config); an unknown keyword is a TypeError naming it."""
        return config_from_options(cls, options, f"{cls.__name__}.from_options")

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
