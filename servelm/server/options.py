"""ServerOptions: how the HTTP server guards itself, decided once at start-up (no torch)."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass, field

API_KEY_ENV = "SERVELM_API_KEY"
MiB = 1 << 20


@dataclass(frozen=True)
class ServerOptions:
    """Limits and checks of `servelm serve`; every field has its --flag of the same name.

    api_keys: accepted bearer tokens (none: the API is open). Each key gets its own
        prefix cache, so one client cannot learn what another sent from cached_tokens.
    allowed_hosts: Host header names accepted besides IP literals and localhost (which
        always are); "*" accepts any. Guards a local server against DNS rebinding.
    allowed_origins: web origins (scheme://host[:port], or "*") whose pages may call the
        API from a browser (CORS); none by default, so a page elsewhere cannot read
        answers or send JSON bodies (its preflight is refused).
    allowed_methods, allowed_headers: what those pages may send (CORS); only with
        allowed_origins. Empty: GET, POST and OPTIONS; Authorization, Content-Type and
        X-Request-Id. "*" allows any.
    max_request_bytes: the largest request body (413 past it).
    header_timeout: seconds a connection has to finish a request's headers (the first
        request's, or the next one's after a response); slower ones are closed.
    body_timeout: seconds a request has to finish sending its body (408 past it).
    shutdown_timeout: on SIGTERM, seconds in-flight requests have to finish; then each
        ends with an error (streams: an error event and [DONE]) and the server exits.
    public_metrics, public_docs: with api_keys, /metrics, or /openapi.json, /docs and
        /redoc, open without a key (servelm.server.access).
    """

    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ()
    allowed_headers: tuple[str, ...] = ()
    max_request_bytes: int = 8 * MiB
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    public_metrics: bool = False
    public_docs: bool = False
    _salts: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for key in self.api_keys:
            if not key or key != key.strip() or not key.isprintable():
                raise ValueError("an API key must be non-empty printable text without "
                                 "surrounding spaces")
        for host in self.allowed_hosts:
            if not host or any(c in host for c in "/ @:"):
                raise ValueError(f"allowed_hosts entries are host names (no port, scheme or "
                                 f"path), got {host!r}")
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"allowed_origins entries are origins like "
                                 f"'https://app.example' (or '*'), got {origin!r}")
        for name, kind in (("allowed_methods", "HTTP methods like 'GET'"),
                           ("allowed_headers", "header names like 'Authorization'")):
            values = getattr(self, name)
            if values and not self.allowed_origins:
                raise ValueError(f"{name} needs allowed_origins (CORS is off without them)")
            for v in values:
                if v != "*" and not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", v):
                    raise ValueError(f"{name} entries are {kind} (or '*'), got {v!r}")
        # A key's cache salt: a digest, so the key itself never sits in the block manager.
        object.__setattr__(self, "_salts", {
            k: hashlib.sha256(k.encode()).hexdigest()[:16] for k in self.api_keys})

    @property
    def cors_methods(self) -> list[str]:
        return [m.upper() for m in self.allowed_methods] or ["GET", "POST", "OPTIONS"]

    @property
    def cors_headers(self) -> list[str]:
        return list(self.allowed_headers) or ["Authorization", "Content-Type", "X-Request-Id"]

    def key_salt(self, key: str) -> str | None:
        return self._salts.get(key)

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a Host header names this server: an IP literal, localhost (or a
        *.localhost name), or one of allowed_hosts; a port is ignored."""
        if "*" in self.allowed_hosts:
            return True
        if not host_header:
            return False
        host = host_header.strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[1:].partition("]")[0]
        elif host.count(":") == 1:
            host = host.partition(":")[0]
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            pass
        host = host.rstrip(".")
        return (host == "localhost" or host.endswith(".localhost")
                or host in (h.lower().rstrip(".") for h in self.allowed_hosts))


def read_api_keys(cli_keys: list[str] | None, key_file: str | None) -> tuple[str, ...]:
    """Keys from --api-key (repeatable), --api-key-file (one a line, '#' comments) and
    $SERVELM_API_KEY (comma-separated), in that order, without duplicates."""
    keys = list(cli_keys or [])
    if key_file is not None:
        try:
            with open(key_file) as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {e.strerror}") from None
        file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file: {key_file} holds no key")
        keys += file_keys
    env = os.environ.get(API_KEY_ENV)
    if env:
        keys += [k.strip() for k in env.split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))
