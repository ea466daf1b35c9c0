"""servelm: a fast LLM inference engine and OpenAI-compatible server.

Commands: serve (the HTTP API and web console), generate (one completion in the terminal),
chat (a conversation in the terminal), router (one front over several servers), bench
(load-test a server), roofline (what bounds prefill and decode here), tune (measure the
matmul methods), models (what can be served here without a download). `servelm COMMAND --help` shows each one's flags and their defaults."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Iterator

from servelm.config import KV_CACHE_DTYPES, SSM_CACHE_DTYPES, EngineOption, engine_options, size
from servelm.outputs import RequestOutput
from servelm.sampling_params import SamplingParams
from servelm.server.reasoning import REASONING_PARSERS
from servelm.server.tools import TOOL_CALL_PARSERS


def _arg_type(parse):
    """An option's parser as an argparse type: its ValueError is the usage error's message
    (argparse: "argument --flag: message")."""
    def arg_type(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    arg_type.__name__ = parse.__name__
    return arg_type


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each flag's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, argparse.SUPPRESS)
                or action.nargs == 0 or isinstance(default, list)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


# vLLM's and llama-server's names for the tool-call formats servelm parses.
TOOL_PARSER_ALIASES = {"qwen": "hermes", "qwen2_5": "hermes", "qwen25": "hermes",
                       "llama3": "llama3_json", "llama": "llama3_json"}


def _tool_parser(text: str) -> str:
    return TOOL_PARSER_ALIASES.get(text.lower(), text.lower())


# Other engines' flags, accepted so their users' command lines run, and ignored: no config
# field stands behind them (build_llm notes --n-gpu-layers in the log).
IGNORED_ENGINE_FLAGS: tuple[tuple[tuple[str, ...], dict], ...] = (
    (("--n-gpu-layers", "-ngl", "--gpu-layers"),
     dict(type=int, default=None, metavar="N",
          help="accepted for llama.cpp's users and ignored: every layer runs on --device")),
    (("--trust-remote-code",),
     dict(action="store_true",
          help="accepted for vLLM's users: servelm never runs a model's own code")),
    (("--enable-chunked-prefill",),
     dict(action="store_true",
          help="accepted for vLLM's users: long prompts are always prefilled in chunks of "
               "--max-num-batched-tokens")),
)


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """The engine's flags, one per option of servelm.config (engine_options()), in their
    groups; then the accepted-and-ignored ones."""
    groups = {"engine": p.add_argument_group("engine")}
    if positional_model:  # `servelm serve MODEL`, as `vllm serve` takes it
        p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model (the same as --model)")
    for o in engine_options():
        if o.group not in groups:
            groups[o.group] = p.add_argument_group(o.group)
        _add_option(groups[o.group], o)
    for flags, kwargs in IGNORED_ENGINE_FLAGS:
        groups["engine"].add_argument(*flags, **kwargs)


def _add_option(g, o: EngineOption) -> None:
    """One option's flags: a value flag, or a bool's store_true / store_false pair."""
    spec = o.spec
    if o.is_bool:
        if o.flags:
            g.add_argument(*o.flags, dest=o.dest, action="store_true", default=o.default,
                           help=_escape(spec.help))
        if o.no_flags:
            g.add_argument(*o.no_flags, dest=o.dest, action="store_false", default=o.default,
                           help=_escape(spec.no_help if o.flags else spec.help))
        return
    if not o.flags:
        return
    kind = next((t for t in (int, float) if o.type in (t, t | None)), None)
    g.add_argument(*o.flags, dest=o.dest, default=o.default,
                   type=_arg_type(spec.parse) if spec.parse else kind,
                   choices=list(spec.choices) if spec.choices else None, nargs=spec.nargs,
                   metavar=spec.metavar, help=_escape(spec.help))


def _escape(text: str) -> str:
    return text.replace("%", "%%")


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


def engine_keywords(args) -> dict:
    """LLM(...)'s keywords from a command's parsed engine flags: each option's value under
    its keyword (those whose value this command has), the model from --model or MODEL."""
    kw = {o.keyword: getattr(args, o.dest) for o in engine_options() if hasattr(args, o.dest)}
    kw["model"] = model_arg(args)
    return kw


def build_llm(args):
    from servelm.entrypoints.llm import LLM

    if args.n_gpu_layers is not None:
        logging.getLogger("servelm.progress").info(
            "--n-gpu-layers is ignored: every layer runs on --device %s", args.device)
    return LLM(**engine_keywords(args))


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


def _reasoning(tok, prompt: str, params: SamplingParams, name: str):
    """A chat prompt's reasoning parser (--reasoning-parser, auto from the template; None:
    none) and the params that read the answer as it needs (harmony keeps its tags)."""
    from servelm.server.reasoning import parser_for_template

    parser = parser_for_template(name, tok.chat_template)
    if parser is None:
        return None, params
    parser = parser.for_prompt(prompt)
    return parser, dataclasses.replace(params, skip_special_tokens=parser.skip_special_tokens)


def _stream_to(out_file, llm, prompt_ids, params, reasoning=None) -> tuple[RequestOutput, str]:
    """Stream the answer to out_file; a reasoning model's thought (reasoning: its parser) to
    stderr instead, after "[thinking] ". Returns the last output and the answer's text."""
    last, answer, thinking = None, [], False
    split = reasoning.stream() if reasoning is not None else None
    for last in stream(llm, prompt_ids, params):
        delta = last.outputs[0].delta_text
        thought, content = (split.feed(delta, final=last.finished) if split is not None
                            else ("", delta))
        if thought:
            if not thinking:
                sys.stderr.write("[thinking] ")
                thinking = True
            sys.stderr.write(thought)
            sys.stderr.flush()
        if content:
            if thinking:
                sys.stderr.write("\n")
                thinking = False
            out_file.write(content)
            answer.append(content)
        out_file.flush()
    if thinking:
        sys.stderr.write("\n")
    return last, "".join(answer)


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
    reasoning = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        text = tok.apply_chat_template(messages)
        reasoning, params = _reasoning(tok, text, params, args.reasoning_parser)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    out, _ = _stream_to(sys.stdout, llm, ids, params, reasoning)
    print()
    _print_stats(out)
    return 0


def _reasoning_arg(parser) -> None:
    parser.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                        help="how a reasoning model's thought is told from its answer (printed "
                        "to stderr after [thinking]; auto: from the chat template)")


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
        prompt = tok.apply_chat_template(history)
        reasoning, turn_params = _reasoning(tok, prompt, params, args.reasoning_parser)
        ids = tok.encode(prompt, add_special_tokens=False)
        if len(ids) >= llm.engine.max_model_len:
            print(f"[conversation is {len(ids)} tokens, over the context of "
                  f"{llm.engine.max_model_len}: /reset to start again]", file=sys.stderr)
            history.pop()
            continue
        room = llm.engine.max_model_len - len(ids)
        turn = dataclasses.replace(turn_params, max_tokens=min(params.max_tokens, room))
        try:
            out, answer = _stream_to(sys.stdout, llm, ids, turn, reasoning)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        print()
        _print_stats(out)
        history.append({"role": "assistant", "content": answer})  # the thought left out


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
    from servelm.engine.engine import resolve_dtype
    from servelm.runtime import resolve_device

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
        from servelm.quantization import mxfp4
        from servelm.roofline import quantized_bits_per_weight

        ckpt = open_checkpoint(resolve_model(args.model))
        cfg = ckpt.config()
        native, _ = ckpt.native_quantization()  # a quantised file runs quantised
        bits = args.bits or (quantized_bits_per_weight(native) if native
                             else rl.BYTES[dname] * 8)
        from servelm.engine.executor import ssm_state_dtype
        from servelm.engine.state_cache import StateCache

        model = rl.ModelShape.from_config(
            cfg, weight_bits=bits,
            kv_bits=_kv_bits(args.kv_cache_dtype, rl.BYTES[dname] * 8, cfg.cache_layout[2]),
            state_bytes=StateCache.bytes_per_slot(cfg, dtype,
                                                  ssm_state_dtype(args.mamba_ssm_cache_dtype)),
            expert_bits=None if args.bits else (
                mxfp4.BITS if ckpt.mxfp4_experts() else rl.quantized_expert_bits(native)))
    if args.bandwidth is not None and args.flops is not None:
        hw = rl.Hardware(args.bandwidth * 1e9, args.flops * 1e12)
    else:
        print(f"measuring {device.type} bandwidth and {dname} and int8 matmul throughput ...",
              file=sys.stderr)
        torch.set_num_threads(args.num_threads or torch.get_num_threads())
        measured = rl.measure_hardware(dname, device.type)
        hw = rl.Hardware(args.bandwidth * 1e9 if args.bandwidth else measured.bandwidth,
                         args.flops * 1e12 if args.flops else measured.flops,
                         source="given and measured" if (args.bandwidth or args.flops)
                         else measured.source, int8_ops=measured.int8_ops,
                         q8act_ops=measured.q8act_ops, w8a8_ops=measured.w8a8_ops)
    print(rl.report(model, hw, prompt_lens=args.prompt_lens, batches=args.batches,
                    context=args.context, kv_pool_bytes=args.kv_cache_memory,
                    kv_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype))
    return 0


def cmd_tune(args) -> int:
    """Measure the linear methods for a model on this machine (or show the cached table)."""
    from servelm.tuning import linear_summary

    args.kv_cache_memory = args.kv_cache_memory or (64 << 20)
    llm = build_llm(args)
    report = llm.engine.executor.tuning
    print(report.table())
    print(linear_summary(llm.engine.executor.model))
    if report.provisional:
        print("PROVISIONAL: the timings stayed unstable (is the machine busy?); the table "
              "was not cached: run `servelm tune` again on a quieter machine")
    return 0


def add_router_args(g) -> None:
    """The routing policy's flags (servelm router, serve --data-parallel-size)."""
    from servelm.router.policy import POLICIES

    g.add_argument("--router-policy", "--policy", dest="router_policy", default="cache_aware",
                   choices=POLICIES, help="cache_aware: the backend holding the longest "
                   "cached prefix of the prompt, unless its load exceeds the least loaded "
                   "one's by more than --router-load-bound, else the least loaded; "
                   "least_loaded; round_robin")
    g.add_argument("--router-load-bound", type=int, default=4096, metavar="TOKENS",
                   help="how many more tokens in flight the backend with the longest cached "
                   "prefix may have than the least loaded one and still get the request")


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
    _reasoning_arg(gen)
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    chat.add_argument("--system", default=None, help="system message")
    _reasoning_arg(chat)
    add_engine_args(chat, positional_model=True)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    def cmd_serve(args) -> int:  # imported here so that generate and chat never load FastAPI
        from servelm.server.launcher import default_model_name, serve

        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.disaggregate is not None:
            from servelm.router.serve import serve_disaggregated

            if args.data_parallel_size > 1 or args.role != "both":
                raise ValueError("--disaggregate starts its own prefill and decode replicas: "
                                 "drop --data-parallel-size and --role")
            name = args.served_model_name or default_model_name(model_arg(args))
            return serve_disaggregated(args, args.argv, name)
        if args.data_parallel_size > 1:
            from servelm.router.serve import serve_data_parallel

            name = args.served_model_name or default_model_name(model_arg(args))
            return serve_data_parallel(args, args.argv, name)
        return serve(args, build_llm, model_arg(args))

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
    # The engine's seed option, as serve's own flag (generate's and chat's --seed is the
    # sampling seed): its dest, default and help are the option's.
    seed = next(o for o in engine_options() if o.keyword == "seed")
    serve.add_argument("--seed", dest=seed.dest, type=int, default=seed.default,
                       help=seed.spec.help)
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
    pd = serve.add_argument_group("disaggregated prefill and decode")
    pd.add_argument("--role", default="both", choices=("both", "prefill", "decode"),
                    help="prefill: send a finished prompt's KV blocks to the decode server a "
                    "request names (kv_transfer_params, which `servelm router --prefill` "
                    "sets); decode: receive KV blocks into the prefix cache on "
                    "--kv-transfer-host/--kv-transfer-port; both (default): neither, "
                    "unless --kv-transfer-port is given (then it receives). A prefill server "
                    "connects where a request says: let only the router reach it")
    pd.add_argument("--kv-transfer-host", default=None, metavar="ADDR",
                    help="address the KV receiver binds (default: --host); only prefill "
                    "servers should reach it (it has no key)")
    pd.add_argument("--kv-transfer-port", type=int, default=None, metavar="PORT",
                    help="port of the KV receiver (0: any free one, shown by /v1/stats; "
                    "default with --role decode: 0)")
    pd.add_argument("--no-kv-transfer-shm", dest="kv_transfer_shm", action="store_false",
                    help="send KV over gloo even to a receiver on this host (default: "
                    "through shared memory there)")
    pd.add_argument("--kv-transfer-timeout", type=positive(float), default=30.0, metavar="S",
                    help="seconds a KV connection or transfer may take (default 30)")
    pd.add_argument("--disaggregate", nargs="?", const="1:1", default=None, metavar="P:D",
                    help="P prefill and D decode replicas (default 1:1), each its own "
                    "process on its share of the cores, behind a router on --port that "
                    "sends long prompts to a prefill replica and their KV to a decode "
                    "replica, which answers")
    pd.add_argument("--prefill-min-tokens", type=int, default=None, metavar="TOKENS",
                    help="with --disaggregate: uncached prompt tokens from which a prompt "
                    "runs on a prefill replica (default: the roofline's ridge in tokens a "
                    "step, at least 64)")
    dp = serve.add_argument_group("data parallel")
    dp.add_argument("--data-parallel-size", "--dp", type=int, default=1, metavar="N",
                    help="N replicas of the engine, each its own process with its own KV pool "
                    "(--kv-cache-memory is per replica) and its share of the CPU cores "
                    "(pinned; --threads, if given, is per replica), behind a cache-aware "
                    "router on --port; a replica that dies fails its requests and is "
                    "restarted")
    add_router_args(dp)
    add_engine_args(serve, positional_model=True)
    serve.set_defaults(func=cmd_serve)

    def cmd_router(args) -> int:
        from servelm.router.serve import run_router

        return run_router(args)

    rt = sub.add_parser("router", help="an OpenAI-compatible front routing each request to "
                        "one of several servelm (or other OpenAI-compatible) servers, by what "
                        "each has cached and its load")
    rt.add_argument("--backend", "--decode", dest="backend", nargs="+", action="extend",
                    default=[], metavar="URL",
                    help="the backends' base URLs, e.g. http://10.0.0.2:8000 (repeatable); "
                    "with --prefill, the decode servers (--role decode) that answer")
    rt.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                    help="prefill servers (--role prefill): a prompt of at least "
                    "--prefill-min-tokens the chosen backend has not cached runs on one of "
                    "them first, its KV sent to that backend, which then answers")
    rt.add_argument("--prefill-min-tokens", type=int, default=None, metavar="TOKENS",
                    help="uncached prompt tokens from which a prompt is prefilled on a "
                    f"--prefill server (default: the backend's roofline ridge in tokens a "
                    f"step, at least 64)")
    rt.add_argument("--host", default="127.0.0.1", help="address to bind")
    rt.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    rt.add_argument("--model", dest="tokenizer_model", default=None, metavar="PATH",
                    help="the backends' model (a .gguf file or a model directory), for its "
                    "tokenizer (default: the first backend's /v1/models root, a path on its "
                    "host)")
    from servelm.config import chat_template

    rt.add_argument("--chat-template", dest="router_chat_template", default=None,
                    type=_arg_type(chat_template), metavar="FILE|JINJA",
                    help="the backends' --chat-template, if they have one (the source; "
                    "prompts are tokenised as they render them)")
    rt.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' from clients (repeatable; "
                    "also $SERVELM_API_KEY); the client's key is passed to the backend")
    rt.add_argument("--api-key-file", default=None, metavar="FILE",
                    help="client API keys, one a line")
    rt.add_argument("--backend-api-key", default=None, metavar="KEY",
                    help="send this key to every backend instead of the client's (and on the "
                    "router's health checks and cache-event polls)")
    add_router_args(rt)
    rt.set_defaults(func=cmd_router)

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
    roof.add_argument("--kv-cache-memory", type=_arg_type(size), default=None, metavar="BYTES",
                      help="KV pool size, to show how many sequences fit")
    roof.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                      help="how the pool stores K and V (int8 / fp8: 1 byte an element plus "
                           "an fp32 scale per token and KV head)")
    roof.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=list(SSM_CACHE_DTYPES),
                      help="linear-attention layers' recurrent state: float32 (auto) or bfloat16")
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
    args.argv = list(sys.argv[1:] if argv is None else argv)  # serve's replicas take it
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
