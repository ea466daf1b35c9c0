"""servelm: a fast LLM inference engine and OpenAI-compatible server.

Commands: serve (the HTTP API and web console), generate (one completion in the terminal),
chat (a conversation in the terminal), bench (load-test a server), roofline (what bounds
prefill and decode here), tune (measure the matmul methods), models (what can be served here
without a download). `servelm COMMAND --help` shows each one's flags and their defaults."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Iterator

from servelm.config import ATTENTION_BACKENDS, KERNEL_TUNING, KV_CACHE_DTYPES, LINEAR_METHODS
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams
from servelm.server.reasoning import REASONING_PARSERS
from servelm.server.tools import TOOL_CALL_PARSERS


def _size(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


def _speculative_config(text: str):
    """--speculative-config JSON -> SpeculativeConfig (argparse reports a ValueError)."""
    import json

    from servelm.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_dict(json.loads(text))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each flag's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, argparse.SUPPRESS)
                or action.nargs == 0 or isinstance(default, list)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                 "fp32": "float32"}
# vLLM's and llama-server's names for the tool-call formats servelm parses.
TOOL_PARSER_ALIASES = {"qwen": "hermes", "qwen2_5": "hermes", "qwen25": "hermes",
                       "llama3": "llama3_json", "llama": "llama3_json"}


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text.lower(), text.lower())


def _tool_parser(text: str) -> str:
    return TOOL_PARSER_ALIASES.get(text.lower(), text.lower())


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _chat_template(text: str) -> str:
    from servelm.tokenizer import load_chat_template

    try:
        return load_chat_template(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    g = p.add_argument_group("engine")
    if positional_model:  # `servelm serve MODEL`, as `vllm serve` takes it
        p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model (the same as --model)")
    g.add_argument("--model", "-m", default=None,
                   help="GGUF file, Hugging Face model directory, Hugging Face id ORG/NAME, or "
                        "ORG/NAME:QUANT for a GGUF in such a repo (default: the embedded "
                        "SmolLM2-135M); `servelm models` lists those here")
    g.add_argument("--revision", default=None,
                   help="of a Hugging Face id: branch, tag or commit (default: main)")
    g.add_argument("--download-dir", default=None, metavar="DIR",
                   help="Hugging Face cache to read and download into (default: HF_HUB_CACHE "
                        "or ~/.cache/huggingface/hub); HF_HUB_OFFLINE=1 never downloads")
    g.add_argument("--tokenizer", default=None,
                   help="take the tokenizer (and chat template) from this model instead")
    g.add_argument("--chat-template", type=_chat_template, default=None, metavar="FILE|JINJA",
                   help="chat template replacing the model's: a file, or the Jinja source")
    g.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='variables every chat template render gets, e.g. '
                        '\'{"enable_thinking": false}\' (a request\'s own override them)')
    g.add_argument("--dtype", type=_dtype, default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation (and unquantised weight) dtype; half, fp16, bf16, float "
                        "and fp32 are accepted too. auto: bfloat16 where the machine runs it "
                        "fast, else float32")
    g.add_argument("--quantization", "-q", default=None, choices=["none", "int8", "int4"],
                   help="weight format: int8 per channel, int4 in groups of 32, none "
                        "(dequantised). Default: the checkpoint's own (a GGUF's Q4/Q5/K-quant "
                        "tensors int4, Q8_0/Q6_K int8, F16/BF16 as they are; an HF "
                        "quantization_config), dequantised if --dtype is given")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--n-gpu-layers", "-ngl", "--gpu-layers", type=int, default=None,
                   metavar="N", help="accepted for llama.cpp's users and ignored: every layer "
                                     "runs on --device")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's users: servelm never runs a model's own code")
    g.add_argument("--kv-cache-memory", type=_size, default=None, metavar="BYTES",
                   help="KV cache pool size, e.g. 1GiB (default: fits the machine)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="how the KV pool stores K and V: the model dtype (auto), or int8 / "
                        "fp8 (e4m3) with a scale per token and KV head (~2x the tokens of "
                        "bf16 in the same --kv-cache-memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=256, help="max sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="max tokens per step (longer prompts are prefilled in chunks)")
    g.add_argument("--max-model-len", "--ctx-size", "-c", type=int, default=None,
                   help="cap on context length (default: the model's)")
    g.add_argument("--num-threads", "--threads", "-t", type=int, default=None,
                   help="CPU threads (default: one per physical core)")
    g.add_argument("--admission-lookahead", type=int, default=64, metavar="TOKENS",
                   help="admit a request only if running ones keep room for this many more "
                        "tokens each (fewer preemptions in a tight KV pool; 0: off)")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching",
                   dest="enable_prefix_caching", action="store_false",
                   help="do not share KV blocks of identical prompt prefixes")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_true", default=True,
                   help="share KV blocks of identical prompt prefixes (the default)")
    g.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted for vLLM's users: long prompts are always prefilled in "
                        "chunks of --max-num-batched-tokens")
    g.add_argument("--no-kv-commit-while-idle", dest="commit_kv_while_idle",
                   action="store_false",
                   help="the server leaves the KV pool's pages to be committed as tokens land "
                        "in them, instead of committing them while idle (lower RSS until the "
                        "pool is used; prompts then pay first-touch faults)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly, without replaying captured decode graphs")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N processes (under torchrun: its WORLD_SIZE; "
                        "--num-threads is then shared among the ranks on this host)")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON", help='speculative decoding, as vLLM\'s: e.g. \'{"method": '
                   '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                   '"prompt_lookup_min": 2}\'')
    k = p.add_argument_group("kernels (how a step runs; decided once at start-up)")
    k.add_argument("--kernel-tuning", default="cached", choices=list(KERNEL_TUNING),
                   help="linear methods per layer shape and row bucket: measured once per "
                        "machine and cached (cached), measured now (fresh), or the built-in "
                        "defaults (off)")
    k.add_argument("--linear-method", default="auto", choices=list(LINEAR_METHODS),
                   help="one matmul method for every linear layer where it applies "
                        "(default auto: the measured table)")
    k.add_argument("--batch-invariant", action="store_true", default=None,
                   help="always run batch-invariant matmuls (each layer one method whose rows "
                        "were checked bit-identical at every row count), so a request's "
                        "results do not depend on what shares its steps (default: wherever "
                        "that costs at most 10%% more, measured)")
    k.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="the fastest method per row bucket, invariant or not")
    k.add_argument("--dequantized-copy-memory", type=_size, default=None, metavar="BYTES",
                   help="how much memory a quantised model's dequantised weight copies may "
                        "take (the amx and onednn methods keep a layer's weight in the "
                        "activation dtype too, for faster prompts); 0: none (default: a "
                        "quarter of the memory available at start-up)")
    k.add_argument("--no-overlap-grammar-masks", dest="overlap_grammar_masks",
                   action="store_false",
                   help="structured outputs: compute the grammars' masks after the forward, "
                        "not on a thread beside it")
    k.add_argument("--tuning-cache-dir", default=None, metavar="DIR",
                   help="where the tuning table is cached (default: ~/.cache/servelm)")
    k.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="the PyTorch eager reference instead of servelm's C++ CPU kernels")
    k.add_argument("--no-fused-decode", dest="fused_decode", action="store_false",
                   help="decode steps op by op instead of on the one-call DecodeStack")
    k.add_argument("--no-hugepages", dest="hugepages", action="store_false",
                   help="weights and KV cache in plain pages, not 2 MB huge pages")
    k.add_argument("--no-shm-collectives", dest="shm_collectives", action="store_false",
                   help="CPU tensor parallelism: gloo for the ranks' all-reduces, not shared "
                        "memory")
    k.add_argument("--no-triton", dest="triton_attention", action="store_false",
                   help="CUDA: gather + SDPA attention instead of the Triton kernels")
    k.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="attention over the paged KV cache: servelm's C++ kernels (cpu; "
                        "cpu_sdpa / cpu_amx: prompts on PyTorch's flash attention / on "
                        "servelm's AMX kernel), Triton (CUDA), or gather + SDPA (reference); "
                        "default auto: the fastest cpu backend measured here where the C++ "
                        "kernels run, else triton where it runs, else reference. One that "
                        "cannot run here is refused at start-up")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def model_arg(args) -> str | None:
    """The model named by --model / -m or the positional MODEL (ValueError if they differ)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"two models given: {tag!r} and --model {args.model!r}")
    return tag if tag is not None else args.model


def build_llm(args):
    from servelm.entrypoints.llm import LLM

    if args.n_gpu_layers is not None:
        logging.getLogger("servelm.progress").info(
            "--n-gpu-layers is ignored: every layer runs on --device %s", args.device)
    return LLM(model=model_arg(args), dtype=args.dtype, device=args.device,
               revision=args.revision, download_dir=args.download_dir, tokenizer=args.tokenizer,
               chat_template=args.chat_template, chat_template_kwargs=args.chat_template_kwargs,
               kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, num_threads=args.num_threads,
               seed=getattr(args, "engine_seed", None) or 0,
               enable_prefix_caching=args.enable_prefix_caching,
               commit_kv_while_idle=args.commit_kv_while_idle,
               admission_lookahead=args.admission_lookahead,
               tensor_parallel_size=args.tensor_parallel_size,
               quantization=getattr(args, "quantization", None),
               enforce_eager=getattr(args, "enforce_eager", False),
               kernel_tuning=args.kernel_tuning, linear_method=args.linear_method,
               batch_invariant=args.batch_invariant, tuning_cache_dir=args.tuning_cache_dir,
               dequantized_copy_memory=args.dequantized_copy_memory,
               overlap_grammar_masks=args.overlap_grammar_masks,
               cpu_kernels=args.cpu_kernels, fused_decode=args.fused_decode,
               hugepages=args.hugepages, triton_attention=args.triton_attention,
               shm_collectives=args.shm_collectives,
               attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
               speculative_config=getattr(args, "speculative_config", None))


def sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          stop=args.stop)


def stream(llm, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
    """Drive the engine for one request, yielding each step's output as it comes."""
    engine = llm.engine
    rid = engine.add_request(None, None, params, prompt_token_ids=prompt_ids)
    try:
        while True:
            for out in engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
    finally:
        engine.abort_request(rid)  # no-op once finished; frees blocks on Ctrl-C


def _stream_to(out_file, llm, prompt_ids, params) -> RequestOutput:
    last = None
    for last in stream(llm, prompt_ids, params):
        out_file.write(last.outputs[0].delta_text)
        out_file.flush()
    return last


def _print_stats(out: RequestOutput) -> None:
    m = out.metrics
    parts = [f"{m.num_prompt_tokens} prompt tokens, {m.num_output_tokens} output tokens"]
    if m.ttft is not None:
        parts.append(f"TTFT {m.ttft * 1000:.0f} ms")
    if m.tpot is not None:
        parts.append(f"TPOT {m.tpot * 1000:.1f} ms ({1 / m.tpot:.1f} tok/s)")
    parts.append(f"finish: {out.outputs[0].finish_reason}")
    print(f"[{' | '.join(parts)}]", file=sys.stderr)


def cmd_generate(args) -> int:
    params = sampling_params(args)  # bad values fail before the model loads
    llm = build_llm(args)
    tok = llm.get_tokenizer()
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    out = _stream_to(sys.stdout, llm, ids, params)
    print()
    _print_stats(out)
    return 0


def cmd_chat(args) -> int:
    params = sampling_params(args)
    llm = build_llm(args)
    tok = llm.get_tokenizer()
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("servelm chat: type a message; /reset clears the history, /exit or Ctrl-D quits.",
          file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            print("[history cleared]", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(history), add_special_tokens=False)
        if len(ids) >= llm.engine.max_model_len:
            print(f"[conversation is {len(ids)} tokens, over the context of "
                  f"{llm.engine.max_model_len}: /reset to start again]", file=sys.stderr)
            history.pop()
            continue
        room = llm.engine.max_model_len - len(ids)
        turn = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        try:
            out = _stream_to(sys.stdout, llm, ids, turn)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        print()
        _print_stats(out)
        history.append({"role": "assistant", "content": out.outputs[0].text})


# Argument types, also used by the benchmark scripts (benchmarks/*.py).

def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive(kind):
    def parse(text: str):
        value = kind(float(text)) if kind is int else kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def _kv_bits(kv_cache_dtype: str, auto_bits: float, head_dim: int | None) -> float:
    """Pool bits per cached element: the model dtype's, or 8 plus the per-row fp32 scale."""
    if kv_cache_dtype == "auto":
        return auto_bits
    return 8 + (32 / head_dim if head_dim else 0)


def cmd_roofline(args) -> int:
    import torch

    from servelm import roofline as rl
    from servelm.engine.engine import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dname = str(dtype).removeprefix("torch.")
    if args.params is not None:
        model = rl.ModelShape(num_params=int(args.params), weight_bits=args.bits or 16,
                              num_layers=args.layers, num_kv_heads=args.kv_heads,
                              head_dim=args.head_dim, num_heads=args.heads,
                              kv_bits=_kv_bits(args.kv_cache_dtype, args.bits or 16,
                                               args.head_dim))
    else:
        from servelm.models.hub import resolve_model
        from servelm.models.loader import open_checkpoint
        from servelm.quantization import quantized_bits_per_weight

        ckpt = open_checkpoint(resolve_model(args.model))
        cfg = ckpt.config()
        native, _ = ckpt.native_quantization()  # a quantised file runs quantised
        bits = args.bits or (quantized_bits_per_weight(native) if native
                             else rl.BYTES[dname] * 8)
        model = rl.ModelShape.from_config(
            cfg, weight_bits=bits,
            kv_bits=_kv_bits(args.kv_cache_dtype, rl.BYTES[dname] * 8, cfg.head_dim))
    if args.bandwidth is not None and args.flops is not None:
        hw = rl.Hardware(args.bandwidth * 1e9, args.flops * 1e12)
    else:
        print(f"measuring {device.type} bandwidth and {dname} matmul throughput ...",
              file=sys.stderr)
        torch.set_num_threads(args.num_threads or torch.get_num_threads())
        measured = rl.measure_hardware(dname, device.type)
        hw = rl.Hardware(args.bandwidth * 1e9 if args.bandwidth else measured.bandwidth,
                         args.flops * 1e12 if args.flops else measured.flops,
                         source="given and measured" if (args.bandwidth or args.flops)
                         else measured.source)
    print(rl.report(model, hw, prompt_lens=args.prompt_lens, batches=args.batches,
                    context=args.context, kv_pool_bytes=args.kv_cache_memory,
                    kv_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype))
    return 0


def cmd_tune(args) -> int:
    """Measure the linear methods for a model on this machine (or show the cached table)."""
    from servelm.tuning import linear_summary

    args.kv_cache_memory = args.kv_cache_memory or (64 << 20)
    llm = build_llm(args)
    print(llm.engine.executor.tuning.table())
    print(linear_summary(llm.engine.executor.model))
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelm", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO, WARNING or ERROR (start-up progress shows at any)")
    parser.add_argument("--version", action="version", version=f"servelm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_parser = sub.add_parser

    def add_parser(*a, **kw):  # every command's --help shows its defaults
        return _add_parser(*a, formatter_class=HelpFormatter, **kw)

    sub.add_parser = add_parser

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat, positional_model=True)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    def cmd_serve(args) -> int:  # imported here so that generate and chat never load FastAPI
        from servelm.server.launcher import serve

        return serve(args)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every /v1 route (repeat "
                       "for several keys; each key gets its own prefix cache). Also read "
                       "from $SERVELM_API_KEY (comma-separated), which keeps keys out of ps")
    serve.add_argument("--api-key-file", default=None, metavar="FILE",
                       help="API keys, one a line ('#' starts a comment)")
    serve.add_argument("--public-metrics", action="store_true",
                       help="with an API key, serve /metrics without one (it is behind the "
                       "key by default: it tells request and token counts, latencies and "
                       "load; Prometheus can send the key with 'authorization: credentials'; "
                       "open it for a scraper on a trusted network that cannot)")
    serve.add_argument("--public-docs", action="store_true",
                       help="with an API key, serve /openapi.json, /docs and /redoc without "
                       "one (behind the key by default; the docs pages are read in a browser, "
                       "which cannot send the key)")
    serve.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME,...",
                       help="Host header names to accept besides IP addresses and localhost "
                       "('*': any); other names get 403 (DNS rebinding)")
    serve.add_argument("--allowed-origins", action="append", default=None,
                       metavar="ORIGIN,...", help="web origins (https://app.example, or '*') "
                       "whose pages may call the API from a browser (CORS; default none)")
    serve.add_argument("--allowed-methods", action="append", default=None,
                       metavar="METHOD,...", help="HTTP methods those pages may use ('*': any; "
                       "default GET,POST,OPTIONS; needs --allowed-origins)")
    serve.add_argument("--allowed-headers", action="append", default=None,
                       metavar="NAME,...", help="request headers those pages may send ('*': "
                       "any; default Authorization,Content-Type,X-Request-Id; needs "
                       "--allowed-origins)")
    serve.add_argument("--max-request-bytes", type=int, default=8 << 20, metavar="N",
                       help="largest request body; past it 413 (default 8 MiB)")
    serve.add_argument("--header-timeout", type=positive(float), default=10.0, metavar="S",
                       help="seconds a connection has to send a request's headers (default 10)")
    serve.add_argument("--body-timeout", type=positive(float), default=30.0, metavar="S",
                       help="seconds a request has to send its body; past it 408 (default 30)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                       help="on SIGTERM, seconds in-flight requests have to finish; then each "
                       "ends with an error (streams: an error event and [DONE]) (default 30)")
    serve.add_argument("--max-queue", type=int, default=256,
                       help="max sequences waiting to run beyond those running (--max-num-seqs); "
                       "past it requests get 503 with Retry-After, and a request of more "
                       "sequences than both together (prompts x n) gets 400")
    serve.add_argument("--tool-call-parser", type=_tool_parser, default="auto",
                       choices=TOOL_CALL_PARSERS,
                       help="how answers to requests with tools are read for tool calls: "
                       "hermes (<tool_call> JSON or a bare JSON call; qwen is the same), "
                       "llama3_json, mistral ([TOOL_CALLS]); auto (default): the one the chat "
                       "template's format names, else hermes")
    serve.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                       help="how a reasoning model's thought is told from its answer "
                       "(reasoning_content): qwen3 (<think>...</think> opening the answer), "
                       "deepseek_r1 (the answer starts in a thought, until </think>); auto "
                       "(default): qwen3 where the chat template writes <think>, deepseek_r1 "
                       "where it only strips </think> from past turns, else none")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM's users: tool_choice auto is always served")
    serve.add_argument("--seed", dest="engine_seed", type=int, default=0,
                       help="the engine's seed (a request's own 'seed' makes it reproducible)")
    serve.add_argument("--root-path", default="",
                       help="the path prefix a reverse proxy serves the API under")
    serve.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                       help="serve HTTPS with this private key (PEM; with --ssl-certfile)")
    serve.add_argument("--ssl-certfile", default=None, metavar="FILE",
                       help="the certificate (chain) for --ssl-keyfile (PEM)")
    serve.add_argument("--disable-log-requests", "--no-access-log", dest="access_log",
                       action="store_false",
                       help="no access-log line per request (shown with --log-level INFO)")
    serve.add_argument("--served-model-name", default=None,
                       help="model name in the API (default: the model file's basename)")
    serve.add_argument("--roofline-bandwidth", type=positive(float), default=None,
                       metavar="GB/s", help="memory bandwidth for /metrics utilisation "
                       "(default: measured at start)")
    serve.add_argument("--roofline-flops", type=positive(float), default=None,
                       metavar="TFLOP/s", help="matmul peak for /metrics utilisation "
                       "(default: measured at start)")
    add_engine_args(serve, positional_model=True)
    serve.set_defaults(func=cmd_serve)

    tune = sub.add_parser("tune", help="measure each linear layer's matmul methods here and "
                          "cache the fastest (what serve/generate/chat then read back)")
    add_engine_args(tune, positional_model=True)
    tune.set_defaults(func=cmd_tune, kernel_tuning="fresh")

    roof = sub.add_parser("roofline", help="predicted prefill/decode limits for a model here")
    roof.add_argument("--model", default=None, help="GGUF file or HF directory (config only)")
    roof.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    roof.add_argument("--device", default="auto")
    roof.add_argument("--bandwidth", type=positive(float), default=None, metavar="GB/s",
                      help="memory bandwidth (default: measured)")
    roof.add_argument("--flops", type=positive(float), default=None, metavar="TFLOP/s",
                      help="peak matmul throughput in the dtype (default: measured)")
    roof.add_argument("--params", type=positive(float), default=None,
                      help="describe a model instead of loading one: parameter count, e.g. 7e9")
    roof.add_argument("--bits", type=positive(float), default=None,
                      help="bits per weight (default: the dtype's)")
    roof.add_argument("--layers", type=positive(int), default=None)
    roof.add_argument("--heads", type=positive(int), default=None)
    roof.add_argument("--kv-heads", type=positive(int), default=None)
    roof.add_argument("--head-dim", type=positive(int), default=None)
    roof.add_argument("--context", type=positive(int), default=512,
                      help="tokens per sequence for the decode table")
    roof.add_argument("--prompt-lens", type=int_list, default=[128, 512, 2048])
    roof.add_argument("--batches", type=int_list, default=[1, 4, 16, 64, 256])
    roof.add_argument("--kv-cache-memory", type=_size, default=None, metavar="BYTES",
                      help="KV pool size, to show how many sequences fit")
    roof.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                      help="how the pool stores K and V (int8 / fp8: 1 byte an element plus "
                           "an fp32 scale per token and KV head)")
    roof.add_argument("--num-threads", type=int, default=None)
    roof.set_defaults(func=cmd_roofline)

    from servelm.bench.cli import add_bench_parser  # argparse only: keeps startup fast

    add_bench_parser(sub)
    from servelm.models.catalog import add_models_parser

    add_models_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("servelm")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Start-up progress (loading, a first kernel tuning) shows whatever the level, as plain
    # lines on stderr.
    progress = logging.getLogger("servelm.progress")
    if progress.level == logging.NOTSET and not progress.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("servelm: %(message)s"))
        progress.addHandler(handler)
        progress.propagate = False
        progress.setLevel(min(logging.INFO, logging.getLogger().level))
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one line, no traceback
        print(f"servelm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
