"""`servelm serve`: load the model, then serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import os
import signal
import sys

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_name(model: str | None) -> str:
    """The name /v1/models reports: a local model file's (or directory's) basename, or the
    Hugging Face id as given."""
    if model is None:
        return EMBEDDED_MODEL_NAME
    if not os.path.exists(model):
        return model
    return os.path.basename(os.path.normpath(model))


def banner(engine, name: str, url: str, disaggregation=None) -> str:
    """What `servelm serve` prints once it listens: where, what, and in which format."""
    shape = f"{engine.model_config.architecture}, {engine.model_config.num_layers} layers"
    lines = [
        f"servelm: serving {name} on {url} ({shape})",
        f"  weights   {engine.weight_format}; activations "
        f"{str(engine.dtype).removeprefix('torch.')} on {engine.device}",
        f"  KV cache  {engine.kv_capacity_tokens:,} tokens "
        f"(max {engine.max_model_len:,} per request)"]
    if disaggregation is not None and disaggregation.config.role != "both":
        r = disaggregation.receiver
        lines.append(f"  role      {disaggregation.config.role}" + (
            f"; KV received on {r.host}:{r.port}" if r is not None else ""))
    if engine.lora is not None:  # each adapter a model of its own name, on this one
        lora = engine.config.lora
        lines.append(f"  LoRA      up to {lora.max_loras} resident, rank <= {lora.max_lora_rank}; "
                     f"{len(engine.list_loras())} loaded (/v1/load_lora_adapter adds more)")
        lines += [f"            {r.lora_name} = {r.lora_path}" for r in engine.list_loras()]
    return "\n".join([*lines, f"  console   {url}/",
                      f"  API       {url}/v1 (OpenAI-compatible; /metrics, /v1/stats)"])


def server_options(args):
    """ServerOptions from `servelm serve`'s flags (ValueError names a bad one)."""
    from servelm.server.options import ServerOptions, read_api_keys

    def split(values):
        return tuple(v.strip() for arg in values or [] for v in arg.split(",") if v.strip())

    return ServerOptions(api_keys=read_api_keys(args.api_key, args.api_key_file),
                         allowed_hosts=split(args.allowed_hosts),
                         allowed_origins=split(args.allowed_origins),
                         allowed_methods=split(args.allowed_methods),
                         allowed_headers=split(args.allowed_headers),
                         max_request_bytes=args.max_request_bytes,
                         header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                         shutdown_timeout=args.shutdown_timeout,
                         public_metrics=args.public_metrics, public_docs=args.public_docs)


def kv_transfer_config(args):
    """KVTransferConfig from `servelm serve`'s --role and --kv-transfer-* flags."""
    from servelm.distributed.kv_transfer import KVTransferConfig

    return KVTransferConfig(role=args.role, host=args.kv_transfer_host or args.host,
                            port=args.kv_transfer_port, shm=args.kv_transfer_shm,
                            timeout=args.kv_transfer_timeout)


# The KV pool's memory committed before the server reports ready, for at most this long (the
# rest while it idles: LLMEngine.commit_pool): a client that starts right away, as a
# benchmark does, would otherwise pay first-touch faults in its first prompts' steps.
COMMIT_AT_START_S = 1.0


def _build_engine(args, build_llm):
    """The engine, with the machine's roofline figures (given, or measured in about a
    second) so /metrics can report utilisation."""
    from servelm.roofline import Hardware, measure_hardware

    engine = build_llm(args).engine
    bw, fl = args.roofline_bandwidth, args.roofline_flops
    source, int8, q8act, w8a8 = "given", None, None, None
    if bw is None or fl is None:
        # The engine may have measured already (speculation's ridge): not twice.
        dtype = str(engine.dtype).removeprefix("torch.")
        hw = engine.hardware or measure_hardware(dtype, engine.device.type, seconds=0.2)
        source = hw.source if bw is None and fl is None else f"{hw.source}, partly given"
        bw = bw if bw is not None else hw.bandwidth / 1e9
        fl = fl if fl is not None else hw.flops / 1e12
        int8, q8act, w8a8 = hw.int8_ops, hw.q8act_ops, hw.w8a8_ops
    engine.hardware = Hardware(bw * 1e9, fl * 1e12, source, int8, q8act, w8a8)
    if engine.speculator is not None:  # speculation's ridge from these figures too
        from servelm.roofline import ridge_tokens

        engine.speculator.ridge_tokens = ridge_tokens(engine.shape, engine.hardware)
    engine.commit_pool(COMMIT_AT_START_S)
    return engine


def serve(args, build_llm, model: str | None) -> int:
    """Entry point of `servelm serve`: args from servelm.cli's parser, build_llm(args) -> its
    LLM, model as given (for the served name); returns the exit status."""
    import uvicorn

    from servelm.engine.async_engine import AsyncLLMEngine
    from servelm.server.api import build_app
    from servelm.server.disaggregation import Disaggregation
    from servelm.server.transport import (DrainingServer, deadline_protocol, listen,
                                          raise_open_file_limit)

    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for path in (args.ssl_keyfile, args.ssl_certfile):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"no such file: {path}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    options = server_options(args)
    sock = listen(args.host, args.port)  # before loading: a taken port fails fast
    raise_open_file_limit()  # one file per connection
    # Built on its own thread, which then runs it: all torch work stays on one thread.
    engine = AsyncLLMEngine.build(lambda: _build_engine(args, build_llm),
                                  max_queue=args.max_queue)
    name = args.served_model_name or default_model_name(model)
    if name in engine.loras:  # the name would always run the base model
        engine.stop()
        raise ValueError(f"--lora-modules names an adapter '{name}', the served model's name: "
                         f"give the adapter another name (or --served-model-name)")
    try:
        disaggregation = Disaggregation(kv_transfer_config(args), engine)
    except BaseException:
        engine.stop()
        raise
    app = build_app(engine, name, options, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser, disaggregation=disaggregation)
    config = uvicorn.Config(app, log_level=args.log_level.lower(),
                            http=deadline_protocol(options.header_timeout),
                            root_path=args.root_path, access_log=args.access_log,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    # SIGTERM: stop accepting, refuse new requests, give those in flight shutdown_timeout.
    server = DrainingServer(config, options.shutdown_timeout, expire=engine.expire,
                            on_start=engine.start_drain)
    # After a graceful shutdown uvicorn re-raises the SIGTERM it caught, under the handler
    # that was installed before it ran; a no-op handler there lets the process exit with 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    host, port = sock.getsockname()[:2]
    scheme = "https" if args.ssl_keyfile else "http"
    shown = f"[{host}]" if ":" in host else host
    print(banner(engine.engine, name, f"{scheme}://{shown}:{port}{args.root_path}",
                 disaggregation),
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0
