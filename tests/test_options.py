"""Engine options declared once (servelm.config's option fields): every CLI engine flag and
every LLM(...) keyword maps to exactly one config field, a new field shows up in both, the
defaults agree, and a command line builds the same EngineConfig as its LLM keywords. No
engine is built: LLMEngine is replaced by one that keeps its config."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest

import servelm.config as config_module
import servelm.entrypoints.llm as llm_module
from servelm import LLM
from servelm.cli import IGNORED_ENGINE_FLAGS, add_engine_args, build_llm, engine_keywords, main
from servelm.cli import make_parser
from servelm.config import (EngineConfig, KernelConfig, SpeculativeConfig, engine_options,
                            option, sub_config)

# The contracts, as they were before the options were generated: every flag spelling and
# the argparse dest it sets, and every LLM keyword with its default.
FLAGS = {
    "--model": "model", "-m": "model", "--revision": "revision",
    "--download-dir": "download_dir", "--tokenizer": "tokenizer",
    "--enable-lora": "enable_lora", "--max-loras": "max_loras",
    "--max-lora-rank": "max_lora_rank", "--lora-modules": "lora_modules",
    "--chat-template": "chat_template", "--chat-template-kwargs": "chat_template_kwargs",
    "--dtype": "dtype", "--quantization": "quantization", "-q": "quantization",
    "--device": "device", "--n-gpu-layers": "n_gpu_layers", "-ngl": "n_gpu_layers",
    "--gpu-layers": "n_gpu_layers", "--trust-remote-code": "trust_remote_code",
    "--kv-cache-memory": "kv_cache_memory", "--kv-cache-dtype": "kv_cache_dtype",
    "--mamba-ssm-cache-dtype": "mamba_ssm_cache_dtype",
    "--block-size": "block_size", "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens", "--max-model-len": "max_model_len",
    "--ctx-size": "max_model_len", "-c": "max_model_len", "--num-threads": "num_threads",
    "--threads": "num_threads", "-t": "num_threads",
    "--admission-lookahead": "admission_lookahead",
    "--no-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "enable_prefix_caching",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--hybrid-kv-cache": "hybrid_kv_cache", "--no-hybrid-kv-cache": "hybrid_kv_cache",
    "--disable-hybrid-kv-cache-manager": "hybrid_kv_cache",
    "--enable-chunked-prefill": "enable_chunked_prefill",
    "--no-kv-commit-while-idle": "commit_kv_while_idle", "--enforce-eager": "enforce_eager",
    "--tensor-parallel-size": "tensor_parallel_size", "-tp": "tensor_parallel_size",
    "--speculative-config": "speculative_config", "--kernel-tuning": "kernel_tuning",
    "--linear-method": "linear_method", "--batch-invariant": "batch_invariant",
    "--int8-activations": "int8_activations",
    "--no-batch-invariant": "batch_invariant",
    "--dequantized-copy-memory": "dequantized_copy_memory",
    "--no-overlap-grammar-masks": "overlap_grammar_masks",
    "--tuning-cache-dir": "tuning_cache_dir", "--no-cpu-kernels": "cpu_kernels",
    "--no-retune-when-idle": "retune_when_idle",
    "--no-fused-decode": "fused_decode", "--no-hugepages": "hugepages",
    "--no-shm-collectives": "shm_collectives", "--no-triton": "triton_attention",
    "--attention-backend": "attention_backend",
}
KEYWORDS = {
    "model": None, "dtype": "auto", "device": "auto", "revision": None, "download_dir": None,
    "tokenizer": None, "chat_template": None, "chat_template_kwargs": None,
    "kv_cache_memory": None, "block_size": 16, "max_num_seqs": 256,
    "max_num_batched_tokens": 4096, "max_model_len": None, "seed": 0, "num_threads": None,
    "enable_prefix_caching": True, "hybrid_kv_cache": True, "admission_lookahead": 64, "tensor_parallel_size": 1,
    "quantization": None, "enforce_eager": False, "kernel_tuning": "cached",
    "linear_method": "auto", "batch_invariant": None, "int8_activations": "auto",
    "cpu_kernels": True,
    "fused_decode": True, "hugepages": True, "triton_attention": True,
    "attention_backend": "auto", "tuning_cache_dir": None, "shm_collectives": True,
    "kv_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "commit_kv_while_idle": True, "speculative_config": None,
    "dequantized_copy_memory": None, "overlap_grammar_masks": True, "retune_when_idle": True,
    "enable_lora": False, "max_loras": 4, "max_lora_rank": 16, "lora_modules": (),
}
IGNORED = {flag for flags, _ in IGNORED_ENGINE_FLAGS for flag in flags}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def engine_parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p, **kw)
    return p


def flag_actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings if s not in ("-h", "--help")}


def config_fields(config=EngineConfig) -> set[str]:
    """Every leaf field: 'EngineConfig.dtype', 'KernelConfig.tuning', ..."""
    out = set()
    for f in dataclasses.fields(config):
        if dataclasses.is_dataclass(f.default_factory):
            out |= {f"{f.default_factory.__name__}.{g.name}"
                    for g in dataclasses.fields(f.default_factory)}
        else:
            out.add(f"{config.__name__}.{f.name}")
    return out


@pytest.fixture
def captured(monkeypatch):
    """LLM(...) builds no engine: the EngineConfig it would be built from is kept."""
    seen = []

    class Engine:
        def __init__(self, config):
            seen.append(config)

    monkeypatch.setattr(llm_module, "LLMEngine", Engine)
    return seen


def test_every_flag_spelling_and_dest_stays():
    actions = flag_actions(engine_parser(positional_model=True))
    assert {flag: a.dest for flag, a in actions.items()} == FLAGS


def test_every_engine_flag_maps_to_exactly_one_config_field():
    by_dest = {}
    for o in engine_options():
        assert o.dest not in by_dest, o.dest
        by_dest[o.dest] = o
    fields_seen = set()
    for flag, action in flag_actions(engine_parser()).items():
        if flag in IGNORED:
            assert action.dest not in by_dest  # accepted and ignored: no field behind it
            continue
        o = by_dest[action.dest]
        assert flag in o.flags + o.no_flags
        fields_seen.add(o.path)
    # Every option field has a flag, or says why it has none (seed: serve's own --seed).
    for o in engine_options():
        assert (o.path in fields_seen) != bool(o.spec.no_flag), o.path
    assert {o.path for o in engine_options() if o.spec.no_flag} == {"EngineConfig.seed"}
    assert config_fields() == {o.path for o in engine_options()}


def test_every_llm_keyword_maps_to_exactly_one_config_field():
    sig = inspect.signature(LLM)
    assert {k: p.default for k, p in sig.parameters.items()} == KEYWORDS
    assert all(p.kind is p.KEYWORD_ONLY for k, p in sig.parameters.items() if k != "model")
    paths = [o.path for o in engine_options()]
    assert len(paths) == len(set(paths)) == len(KEYWORDS)
    assert config_fields() == set(paths)
    # The keywords whose names differ from their fields.
    renamed = {o.keyword: o.path for o in engine_options() if o.keyword != o.name}
    assert renamed == {"commit_kv_while_idle": "CacheConfig.commit_while_idle",
                       "kernel_tuning": "KernelConfig.tuning",
                       "dequantized_copy_memory": "KernelConfig.dequantized_copy_bytes",
                       "speculative_config": "EngineConfig.speculative"}
    doc = LLM.__init__.__doc__
    for keyword, default in KEYWORDS.items():
        assert f"\n{keyword}={default!r} " in doc


def test_an_unknown_keyword_is_a_type_error_naming_it(captured):
    with pytest.raises(TypeError, match="unexpected keyword argument 'tuning'.*kernel_tuning"):
        LLM(tuning="off")
    with pytest.raises(TypeError, match="'block_sise'.*did you mean 'block_size'"):
        LLM(block_sise=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        EngineConfig.from_options(nope=1)
    with pytest.raises(TypeError):
        LLM("a.gguf", "float32")  # only the model is positional
    LLM("a.gguf", dtype="float32")
    assert (captured[-1].model, captured[-1].dtype) == ("a.gguf", "float32")
    assert not captured[:-1]


def test_validation_stays_in_the_configs_and_names_the_field(captured):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        LLM(block_size=3)
    with pytest.raises(ValueError, match="dequantized_copy_bytes"):
        LLM(dequantized_copy_memory=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    assert not captured


@pytest.mark.parametrize("argv", [["generate", "hi"], ["chat"], ["serve"], ["tune"]])
def test_parsed_empty_args_are_the_dataclass_defaults(argv, captured):
    args = make_parser().parse_args(argv)
    for o in engine_options():
        if o.flags or o.no_flags:
            want = "fresh" if (argv == ["tune"] and o.keyword == "kernel_tuning") else o.default
            assert getattr(args, o.dest) == want, o.keyword
    build_llm(args)
    want = EngineConfig()
    if argv == ["tune"]:  # `servelm tune` measures afresh
        want = dataclasses.replace(want, kernels=KernelConfig(tuning="fresh"))
    assert captured == [want]


def test_a_command_line_builds_the_config_its_llm_keywords_build(captured, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    argv = ["serve", "m.gguf", "--revision", "v2", "--download-dir", "/tmp/hf",
            "--tokenizer", "tok.gguf", "--chat-template", str(template),
            "--chat-template-kwargs", '{"enable_thinking": false}', "--dtype", "bf16",
            "-q", "int8", "--device", "cpu", "--seed", "7", "--kv-cache-memory", "64MiB",
            "--kv-cache-dtype", "fp8", "--mamba-ssm-cache-dtype", "bfloat16", "--block-size", "32",
            "--no-enable-prefix-caching",
            "--no-kv-commit-while-idle", "--disable-hybrid-kv-cache-manager", "--max-num-seqs", "8", "--max-num-batched-tokens",
            "512", "-c", "1024", "--admission-lookahead", "0", "-t", "2", "--enforce-eager",
            "--speculative-config", json.dumps(spec), "--kernel-tuning", "off",
            "--linear-method", "tiles,q8act", "--no-batch-invariant", "--int8-activations", "off",
            "--dequantized-copy-memory",
            "1GiB", "--no-overlap-grammar-masks", "--tuning-cache-dir", "/tmp/tune",
            "--no-cpu-kernels", "--no-fused-decode", "--no-hugepages", "--no-shm-collectives",
            "--no-triton", "--attention-backend", "reference", "-ngl", "99",
            "--no-retune-when-idle",
            "--trust-remote-code", "--enable-chunked-prefill", "--enable-lora", "--max-loras",
            "3", "--max-lora-rank", "8", "--lora-modules", "a=/x", "b=/y"]
    keywords = dict(
        model="m.gguf", revision="v2", download_dir="/tmp/hf", tokenizer="tok.gguf",
        chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": False},
        dtype="bfloat16", quantization="int8", device="cpu", seed=7,
        kv_cache_memory=64 << 20, kv_cache_dtype="fp8", mamba_ssm_cache_dtype="bfloat16",
        block_size=32,
        enable_prefix_caching=False, commit_kv_while_idle=False, hybrid_kv_cache=False,
        max_num_seqs=8,
        max_num_batched_tokens=512, max_model_len=1024, admission_lookahead=0, num_threads=2,
        enforce_eager=True, speculative_config=spec, kernel_tuning="off",
        linear_method="tiles,q8act", batch_invariant=False, int8_activations="off",
        dequantized_copy_memory=1 << 30,
        overlap_grammar_masks=False, tuning_cache_dir="/tmp/tune", cpu_kernels=False,
        fused_decode=False, hugepages=False, shm_collectives=False, triton_attention=False,
        attention_backend="reference", retune_when_idle=False, enable_lora=True, max_loras=3,
        max_lora_rank=8,
        lora_modules={"a": "/x", "b": "/y"})
    # Every option given a value not its default (but one: speculation needs one rank).
    assert set(keywords) == set(KEYWORDS) - {"tensor_parallel_size"}
    assert all(v != KEYWORDS[k] for k, v in keywords.items())
    build_llm(make_parser().parse_args(argv))
    LLM(**keywords)
    from_cli, from_keywords = captured
    assert from_cli == from_keywords == EngineConfig.from_options(**keywords)
    assert from_cli.speculative == SpeculativeConfig(num_speculative_tokens=3,
                                                     prompt_lookup_min=4, prompt_lookup_max=4)
    assert (from_cli.kernels.tuning, from_cli.cache.commit_while_idle,
            from_cli.kernels.dequantized_copy_bytes) == ("off", False, 1 << 30)
    # The positive spelling of a negated default, and --threads / -tp, reach it too.
    args = make_parser().parse_args(["generate", "hi", "--batch-invariant", "--threads", "3",
                                     "-tp", "2", "--enable-prefix-caching"])
    kw = engine_keywords(args)
    assert (kw["batch_invariant"], kw["num_threads"], kw["tensor_parallel_size"],
            kw["enable_prefix_caching"]) == (True, 3, 2, True)
    assert "seed" not in kw  # generate's --seed is the sampling seed, not the engine's
    captured.clear()
    build_llm(args)
    LLM(batch_invariant=True, num_threads=3, tensor_parallel_size=2)
    assert captured[0] == captured[1] and captured[0].tensor_parallel_size == 2


# A config with one new option of its own and one in its kernels: each declared only here.
@dataclasses.dataclass(frozen=True)
class NewKernels(KernelConfig):
    turbo: bool = option(False, help="go faster")


@dataclasses.dataclass(frozen=True)
class NewConfig(EngineConfig):
    widget_width: int = option(8, flags=("--widget-width", "-w"), metavar="N",
                               help="how wide the widgets are")
    kernels: NewKernels = sub_config(NewKernels,
                                     "kernels (how a step runs; decided once at start-up)")


def test_a_new_field_is_a_flag_and_a_keyword_with_no_other_declaration(monkeypatch, captured):
    monkeypatch.setattr(config_module, "EngineConfig", NewConfig)
    monkeypatch.setattr(llm_module, "EngineConfig", NewConfig)
    p = engine_parser()
    actions = flag_actions(p)
    assert actions["--widget-width"].dest == actions["-w"].dest == "widget_width"
    assert actions["--widget-width"].help == "how wide the widgets are"
    assert actions["--turbo"].container.title.startswith("kernels")
    assert p.parse_args([]).widget_width == 8 and p.parse_args([]).turbo is False
    sig = llm_module._options_signature().parameters
    assert sig["widget_width"].default == 8 and sig["turbo"].default is False
    build_llm(make_parser().parse_args(["generate", "hi", "-w", "3", "--turbo"]))
    LLM(widget_width=3, turbo=True)
    assert captured[0] == captured[1] and isinstance(captured[0], NewConfig)
    assert captured[0].widget_width == 3 and captured[0].kernels.turbo is True


def test_a_field_without_option_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Config(EngineConfig):
        plain: int = 1

    with pytest.raises(TypeError, match="Config.plain is not declared with option"):
        engine_options(Config)


def test_a_flag_value_parser_error_is_a_usage_error(capsys):
    for argv, message in ((["--kv-cache-memory", "lots"], "not a size"),
                          (["--dequantized-copy-memory", "2XB"], "not a size"),
                          (["--speculative-config", "[1]"], "expected a JSON object")):
        with pytest.raises(SystemExit) as e:
            make_parser().parse_args(["serve", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {argv[0]}: {message}" in err, err


def test_help_keeps_each_flags_text(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for o in engine_options():
        for text in (o.spec.help if (o.flags or o.no_flags) else None, o.spec.no_help):
            if text:  # argparse wraps lines, at spaces and hyphens
                assert "".join(text.split()) in "".join(out.split()), o.keyword
    for _, kwargs in IGNORED_ENGINE_FLAGS:
        assert "".join(kwargs["help"].split()) in "".join(out.split())
    assert "10% more" in out  # --batch-invariant's text, its % escaped for argparse


def test_the_launcher_does_not_import_the_cli():
    """servelm.cli -> servelm.server.launcher only: the launcher is handed build_llm."""
    import servelm.server.launcher as launcher

    tree = ast.parse(Path(launcher.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "servelm.cli" not in imported


def test_lora_options_refuse_bad_values_by_name():
    for bad, match in [({"lora_modules": ["nopath"]}, "name=path"),
                       ({"lora_modules": ["a=/x", "a=/y"]}, "named twice"),
                       ({"lora_modules": [{"name": "a"}]}, "'name' and a 'path'"),
                       ({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_options(**bad)
    cfg = EngineConfig.from_options(lora_modules={"a": "/x"})
    assert cfg.lora.enabled and cfg.lora.lora_modules == (("a", "/x"),)
    assert not EngineConfig.from_options().lora.enabled
