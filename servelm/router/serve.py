"""The router's processes: `servelm router --backend URL ...` (run_router), and the front of
`servelm serve --data-parallel-size N` (serve_data_parallel): the router over N replicas
this process starts and supervises, on the one port the user asked for."""

from __future__ import annotations

import logging
import signal
import sys

from servelm.router.app import Router, RouterConfig

logger = logging.getLogger(__name__)


def _serve(router: Router, host: str, port: int, log_level: str, banner,
           header_timeout: float = 10.0, root_path: str = "", ssl_keyfile=None,
           ssl_certfile=None, on_exit=None, shutdown_timeout: float = 30.0) -> int:
    import uvicorn

    from servelm.server.transport import deadline_protocol, listen, raise_open_file_limit

    sock = listen(host, port)
    raise_open_file_limit()
    config = uvicorn.Config(router.app(), log_level=log_level.lower(),
                            http=deadline_protocol(header_timeout), root_path=root_path,
                            access_log=False, ssl_keyfile=ssl_keyfile,
                            ssl_certfile=ssl_certfile,
                            timeout_graceful_shutdown=shutdown_timeout)
    server = uvicorn.Server(config)
    signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn's own handler takes over
    h, p = sock.getsockname()[:2]
    shown = f"[{h}]" if ":" in h else h
    scheme = "https" if ssl_keyfile else "http"
    print(banner(f"{scheme}://{shown}:{p}{root_path}"), file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        if on_exit is not None:
            on_exit()
    return 0


def router_config(args, backends: list[str], poll_api_key: str | None = None) -> RouterConfig:
    from servelm.server.options import read_api_keys

    keys = read_api_keys(args.api_key, getattr(args, "api_key_file", None))
    return RouterConfig(backends=tuple(backends),
                        prefill_backends=tuple(getattr(args, "prefill", None) or ()),
                        prefill_min_tokens=getattr(args, "prefill_min_tokens", None),
                        policy=args.router_policy,
                        load_bound=args.router_load_bound,
                        model=getattr(args, "tokenizer_model", None),
                        api_keys=tuple(keys),
                        backend_api_key=getattr(args, "backend_api_key", None),
                        poll_api_key=poll_api_key,
                        chat_template=getattr(args, "router_chat_template", None))


def run_router(args) -> int:
    """`servelm router`: args from servelm.cli's router parser."""
    config = router_config(args, args.backend)
    router = Router(config)

    def banner(url: str) -> str:
        lines = [f"servelm: routing on {url} to {len(config.backends)} backends "
                 f"(policy {config.policy}, load bound {config.load_bound} tokens)"]
        lines += [f"  backend   {u}" for u in config.backends]
        lines += [f"  prefill   {u}" for u in config.prefill_backends]
        return "\n".join([*lines, f"  API       {url}/v1 (OpenAI-compatible; /metrics, "
                                  f"/v1/stats: every backend and the router)"])

    return _serve(router, args.host, args.port, args.log_level, banner)


def serve_data_parallel(args, argv: list[str], model_name: str) -> int:
    """`servelm serve --data-parallel-size N`: start the replicas (each `servelm serve` on a
    loopback port, its share of the cores), then the router over them on --host/--port."""
    n = args.data_parallel_size
    return _serve_replicas(args, argv, model_name, [[]] * n, [""] * n,
                           f"data parallel: {n} replicas")


def parse_split(text: str) -> tuple[int, int]:
    """--disaggregate's P:D: prefill and decode replica counts, each at least 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--disaggregate takes P:D (prefill and decode replicas, like "
                         f"1:1), got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"--disaggregate needs at least one replica of each, got {text!r}")
    return p, d


def serve_disaggregated(args, argv: list[str], model_name: str) -> int:
    """`servelm serve --disaggregate P:D`: P prefill replicas (--role prefill) and D decode
    replicas (--role decode, each receiving KV on a free loopback port), the cores split
    between them, behind the router on --host/--port, which prefills long prompts on a
    prefill replica and lets a decode replica answer (servelm.router.app)."""
    p, d = parse_split(args.disaggregate)
    flags = [["--role", "prefill"]] * p + [["--role", "decode", "--kv-transfer-port", "0"]] * d
    return _serve_replicas(args, argv, model_name, flags, ["prefill"] * p + ["decode"] * d,
                           f"disaggregated: {p} prefill, {d} decode replicas")


def _serve_replicas(args, argv: list[str], model_name: str, flags: list[list[str]],
                    roles: list[str], kind: str) -> int:
    """Start a replica per entry of flags (its own flags after the front's; roles: each
    one's role, "" for a plain one), then the router over them on --host/--port: the
    prefill replicas as its prefill backends, the others as its backends."""
    from servelm.router.replicas import Replicas, replica_argv
    from servelm.server.options import read_api_keys
    from servelm.server.transport import listen

    listen(args.host, args.port).close()  # a taken port fails before the replicas load
    replicas = Replicas(len(flags), replica_argv(argv), threads=args.num_threads, extra=flags)
    shown = [f"{role}, " if role else "" for role in roles]
    for r, role in zip(replicas.replicas, shown):
        print(f"servelm: replica {r.index}: {role}CPUs {_ranges(r.cpus)}, {r.threads} "
              f"threads, {r.url}", file=sys.stderr, flush=True)
    replicas.start()
    keys = read_api_keys(args.api_key, args.api_key_file)
    # The replicas take the same keys (their arguments and environment are the front's):
    # a client's key goes through, each key still its own prefix cache; the router's
    # checks and polls use the first.
    urls = replicas.urls
    config = RouterConfig(
        backends=tuple(u for u, role in zip(urls, roles) if role != "prefill"),
        prefill_backends=tuple(u for u, role in zip(urls, roles) if role == "prefill"),
        prefill_min_tokens=getattr(args, "prefill_min_tokens", None),
        policy=args.router_policy, load_bound=args.router_load_bound, model=None,
        api_keys=tuple(keys), poll_api_key=keys[0] if keys else None, forward_host=True,
        backends_check_keys=True, public_metrics=args.public_metrics,
        max_request_bytes=args.max_request_bytes, chat_template=args.chat_template,
        chat_template_kwargs=args.chat_template_kwargs)
    router = Router(config)

    def banner(url: str) -> str:
        return "\n".join([
            f"servelm: serving {model_name} on {url} ({kind}, policy {config.policy})",
            *[f"  replica {r.index} {r.url} ({role}CPUs {_ranges(r.cpus)})"
              for r, role in zip(replicas.replicas, shown)],
            f"  API       {url}/v1 (OpenAI-compatible; /metrics, /v1/stats: every replica)"])

    try:
        return _serve(router, args.host, args.port, args.log_level, banner,
                      header_timeout=args.header_timeout, root_path=args.root_path,
                      ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                      on_exit=replicas.stop, shutdown_timeout=args.shutdown_timeout)
    except BaseException:
        replicas.stop()
        raise


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)
