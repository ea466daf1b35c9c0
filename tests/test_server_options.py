"""The server's guards as units: Host names, API keys from flags/file/environment, option
validation, and the listening socket (no model, milliseconds)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from servelm.server.options import API_KEY_ENV, ServerOptions, read_api_keys
from servelm.server.transport import listen


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1:8000", True), ("[::1]:8000", True), ("::1", True), ("192.168.1.20", True),
    ("localhost", True), ("LOCALHOST:80", True), ("api.localhost", True), ("localhost.", True),
    ("allowed.example", True), ("Allowed.Example:443", True),
    ("evil.example", False), ("localhost.evil.example", False), ("allowed.example.evil", False),
    ("", False), (None, False), ("127.0.0.1.nip.io", False)])
def test_host_allowed(host, ok):
    assert ServerOptions(allowed_hosts=("allowed.example",)).host_allowed(host) is ok


def test_star_allows_any_host():
    assert ServerOptions(allowed_hosts=("*",)).host_allowed("anything.example")
    assert ServerOptions(allowed_hosts=("*",)).host_allowed(None)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"max_request_bytes": 10}, "max_request_bytes"),
    ({"header_timeout": 0}, "header_timeout"),
    ({"body_timeout": -1}, "body_timeout"),
    ({"shutdown_timeout": -1}, "shutdown_timeout"),
    ({"api_keys": (" padded",)}, "API key"),
    ({"api_keys": ("",)}, "API key"),
    ({"allowed_hosts": ("http://x.example",)}, "allowed_hosts"),
    ({"allowed_hosts": ("x.example:80",)}, "allowed_hosts"),
    ({"allowed_origins": ("app.example",)}, "allowed_origins"),
    ({"allowed_origins": ("https://app.example/path",)}, "allowed_origins"),
    ({"allowed_methods": ("POST",)}, "needs allowed_origins"),
    ({"allowed_headers": ("X-Trace",)}, "needs allowed_origins"),
    ({"allowed_origins": ("*",), "allowed_methods": ("PO ST",)}, "allowed_methods"),
    ({"allowed_origins": ("*",), "allowed_headers": ("X:Y",)}, "allowed_headers")])
def test_bad_options_are_named(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ServerOptions(**kwargs)


def test_api_keys_from_flags_file_and_environment(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# team keys\nk-file-1\n\n  k-file-2  \nk-flag\n")
    monkeypatch.setenv(API_KEY_ENV, "k-env-1, k-env-2,")
    assert read_api_keys(["k-flag"], str(f)) == ("k-flag", "k-file-1", "k-file-2", "k-env-1",
                                                 "k-env-2")
    monkeypatch.delenv(API_KEY_ENV)
    assert read_api_keys(None, None) == ()
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(None, str(tmp_path / "empty"))


def test_each_key_has_its_own_salt_which_is_not_the_key():
    opts = ServerOptions(api_keys=("alpha", "beta"))
    salts = {opts.key_salt("alpha"), opts.key_salt("beta")}
    assert len(salts) == 2 and not salts & {"alpha", "beta"}
    assert opts.key_salt("gamma") is None


def test_accepted_connections_have_tcp_nodelay():
    """asyncio sets TCP_NODELAY only on sockets whose proto is TCP: the listener's must be."""
    sock = listen("127.0.0.1", 0)
    seen = {}

    async def main():
        def on_connect(reader, writer):
            s = writer.get_extra_info("socket")
            seen["nodelay"] = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(main())
    assert seen["nodelay"] != 0


def test_a_taken_port_is_a_clear_error():
    sock = listen("127.0.0.1", 0)
    try:
        with pytest.raises(ValueError, match="cannot listen on 127.0.0.1"):
            listen("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


def test_cors_defaults_and_choices():
    default = ServerOptions(allowed_origins=("*",))
    assert default.cors_methods == ["GET", "POST", "OPTIONS"]
    assert "Authorization" in default.cors_headers
    chosen = ServerOptions(allowed_origins=("*",), allowed_methods=("post",),
                           allowed_headers=("X-Trace",))
    assert chosen.cors_methods == ["POST"] and chosen.cors_headers == ["X-Trace"]
