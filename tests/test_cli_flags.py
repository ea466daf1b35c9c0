"""The command line's spellings: vLLM's and llama-server's flags for what servelm has, the
positional model, --help with defaults, --version, and the chat-template flags (parser only:
no engine is built here)."""

from __future__ import annotations

import json

import pytest

from servelm.cli import main, make_parser, model_arg

INLINE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def parse(*argv: str):
    return make_parser().parse_args(list(argv))


def test_t_is_threads_and_tp_is_tensor_parallel():
    args = parse("serve", "-t", "2")
    assert args.num_threads == 2 and args.tensor_parallel_size == 1
    args = parse("serve", "--threads", "3", "-tp", "2")
    assert args.num_threads == 3 and args.tensor_parallel_size == 2


@pytest.mark.parametrize("command", ["serve", "chat", "tune"])
def test_positional_model(command):
    assert model_arg(parse(command, "some/model.gguf")) == "some/model.gguf"
    assert model_arg(parse(command, "--model", "x.gguf")) == "x.gguf"
    assert model_arg(parse(command, "-m", "y.gguf")) == "y.gguf"
    assert model_arg(parse(command, "a.gguf", "--model", "a.gguf")) == "a.gguf"
    with pytest.raises(ValueError, match="two models"):
        model_arg(parse(command, "a.gguf", "--model", "b.gguf"))


def test_llama_server_spellings():
    args = parse("serve", "-m", "m.gguf", "-c", "2048", "-ngl", "99")
    assert (args.model, args.max_model_len, args.n_gpu_layers) == ("m.gguf", 2048, 99)
    assert parse("serve", "--ctx-size", "512").max_model_len == 512


@pytest.mark.parametrize("given,dtype", [("half", "float16"), ("fp16", "float16"),
                                         ("bf16", "bfloat16"), ("float", "float32"),
                                         ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_dtype_spellings(given, dtype):
    assert parse("serve", "--dtype", given).dtype == dtype


def test_vllm_spellings_parse():
    args = parse("serve", "--enable-prefix-caching", "--enable-chunked-prefill",
                 "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "qwen",
                 "--disable-log-requests", "--seed", "7", "--root-path", "/api",
                 "--tokenizer", "tok.gguf", "--revision", "v1", "--download-dir", "/tmp/hf",
                 "--served-model-name", "m")
    assert args.enable_prefix_caching is True and args.tool_call_parser == "hermes"
    assert args.access_log is False and args.engine_seed == 7 and args.root_path == "/api"
    assert (args.tokenizer, args.revision, args.download_dir) == ("tok.gguf", "v1", "/tmp/hf")
    assert parse("serve", "--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("serve", "--no-prefix-caching").enable_prefix_caching is False
    assert parse("serve", "--tool-call-parser", "llama3").tool_call_parser == "llama3_json"


def test_quantization_choices():
    assert parse("serve").quantization is None  # the checkpoint's own
    assert parse("serve", "--quantization", "none").quantization == "none"
    assert parse("serve", "-q", "int4").quantization == "int4"


def test_unknown_values_are_usage_errors(capsys):
    for argv in (["serve", "--dtype", "int3"], ["serve", "--tool-call-parser", "nope"],
                 ["serve", "--quantization", "fp8"]):
        with pytest.raises(SystemExit) as e:
            parse(*argv)
        assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("servelm 0.1")


def test_python_dash_m_servelm_is_the_command():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "servelm", "--version"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("servelm 0.1")


def test_help_lists_commands_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("serve", "generate", "chat", "bench", "roofline", "tune", "models"):
        assert command in out
    assert "generate | chat" not in out
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 8000)" in out and "(default: 127.0.0.1)" in out
    assert "(default: 4096)" in out  # --max-num-batched-tokens, an engine flag


def test_chat_template_flag(tmp_path):
    assert parse("serve", "--chat-template", INLINE).chat_template == INLINE
    path = tmp_path / "t.jinja"
    path.write_text(INLINE)
    assert parse("serve", "--chat-template", str(path)).chat_template == INLINE
    as_json = tmp_path / "chat_template.json"
    as_json.write_text(json.dumps({"chat_template": INLINE}))
    assert parse("chat", "--chat-template", str(as_json)).chat_template == INLINE
    args = parse("serve", "--chat-template-kwargs", '{"enable_thinking": false}')
    assert args.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("argv,message", [
    (["--chat-template", "missing.jinja"], "no such file"),
    (["--chat-template", "{% for %}"], "does not compile"),
    (["--chat-template-kwargs", "[1]"], "JSON object"),
    (["--chat-template-kwargs", "{no"], "not JSON"),
])
def test_chat_template_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse("serve", *argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_tls_flags_go_together(capsys, tmp_path):
    key = tmp_path / "k.pem"
    key.write_text("x")
    assert main(["serve", "--ssl-keyfile", str(key), "--port", "0"]) == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err
