"""Other ways in: a Hugging Face directory, bf16 weights, the command line."""

from __future__ import annotations

import re

import subprocess
import sys

import pytest
import torch

from conftest import CHAT_PROMPTS, TEXT_PROMPTS
from helpers import prompt_logits
from servelm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hf_model, hf_tokenizer):
    """A real HF model directory (config.json, safetensors, tokenizer.json) written by transformers.

    transformers refuses save_pretrained on a GGUF-loaded model, so the weights go through
    safetensors directly (tied head left out, as transformers writes it).
    """
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("hf-smollm2")
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf_model.config.save_pretrained(d)
    hf_tokenizer.save_pretrained(d)
    return d


def test_hf_directory_gives_the_same_tokens_as_the_gguf(llm, hf_dir):
    from_dir = LLM(model=str(hf_dir), dtype="float32", kv_cache_memory=64 << 20)
    assert from_dir.engine.model_config.num_kv_heads == llm.engine.model_config.num_kv_heads == 3
    prompts = TEXT_PROMPTS[:3]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in from_dir.generate(prompts, GREEDY, use_tqdm=False)]
    assert a == b
    chat = from_dir.chat(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=32),
                         use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and "Paris" in chat.text


def test_bf16_stays_close_to_fp32(llm):
    bf16 = LLM(dtype="bfloat16", kv_cache_memory=64 << 20)
    assert bf16.engine.executor.kv_cache.data.dtype == torch.bfloat16
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in TEXT_PROMPTS]
    ref = prompt_logits(llm.engine, prompts)
    got = prompt_logits(bf16.engine, prompts)
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)  # KL(fp32 || bf16) per prompt
    assert kl.max().item() < 0.05, kl
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.8


def _cli(*args, input=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "servelm.cli", *args], input=input,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_generate_streams_text_and_prints_timings(llm):
    r = _cli("generate", "The capital of France is", "--temperature", "0", "--max-tokens", "8",
             "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    expected = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].text
    assert r.stdout.strip() == expected.strip()
    assert "TTFT" in r.stderr and "prompt tokens" in r.stderr


def test_cli_chat_keeps_history(monkeypatch, capsys):
    import io

    from servelm.cli import main

    # In this process (the entry point runs as a process in the test above).
    monkeypatch.setattr("sys.stdin", io.StringIO("My name is Bob.\n/reset\nHello\n/exit\n"))
    assert main(["chat", "--temperature", "0", "--max-tokens", "8", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert err.count("prompt tokens") == 2
    assert "[history cleared]" in err


def test_cli_chat_prints_a_thought_to_stderr(monkeypatch, capsys):
    """A reasoning model's thought (here: a ChatML template whose generation prompt opens
    <think>, so the whole short answer is thought) goes to stderr after [thinking], the
    answer alone to stdout, and the next turn's history holds only the answer; with
    --reasoning-parser none the same text is the answer."""
    import io

    from servelm.cli import main

    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
    args = ["--temperature", "0", "--max-tokens", "6", "--dtype", "float32",
            "--chat-template", template, "--kernel-tuning", "off"]
    assert main(["generate", "Say hi", "--chat", "--reasoning-parser", "none", *args]) == 0
    plain = capsys.readouterr().out.strip()
    assert plain
    assert main(["generate", "Say hi", "--chat", *args]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == ""
    assert f"[thinking] {plain}" in out.err
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi\nSay hi\n/exit\n"))
    assert main(["chat", *args]) == 0
    err = capsys.readouterr().err
    assert err.count("[thinking] ") == 2
    # the second prompt holds the first turn's answer (empty), not its thought
    from servelm.models.loader import resolve_model_path
    from servelm.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(None))
    turns = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "Say hi"}]
    want = len(tok.encode(tok.apply_chat_template(turns, chat_template=template),
                          add_special_tokens=False))
    assert [int(t) for t in re.findall(r"\[(\d+) prompt tokens", err)][1] == want


def test_cli_bad_model_is_one_line_error(tmp_path, capsys):
    from servelm.cli import main

    assert main(["generate", "hi", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"servelm: error: {tmp_path / 'missing.gguf'}: no such file or directory"


def test_cli_bad_sampling_value_names_the_field(capsys):
    from servelm.cli import main

    assert main(["generate", "hi", "--top-p", "0"]) == 2  # before any model loads
    assert "top_p" in capsys.readouterr().err
