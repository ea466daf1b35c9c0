"""Real checkpoints of the second and third families against transformers on the same GGUF:
token ids, never "looks sane". Qwen2.5-Coder-0.5B (qwen2: biases, no q/k permute, Q5_0/Q8_0/
Q4_K/Q6_K) is fetched by `make test`; Gemma-3-270M (gemma3: SentencePiece, sliding layers,
two rotary bases, sandwich norms) by `make models`, and its test skips without it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import assert_reference_greedy, hf_from_gguf, hf_tokenizer_from_gguf
from servelm import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "fetch_models", Path(__file__).parents[1] / "scripts" / "fetch_models.py")
fetch_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch_models)

RAW = ["def quicksort(arr):", "The capital of France is",
       "Once upon a time, in a small village,"]
CHAT = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What does a KV cache store?"}]]
TOKENIZER_TEXTS = ["  two spaces\tand a tab\n\nnewlines", "def f(x):\n    return x**2  # square",
                   "Émigré naïve café 東京 🚀 1234567", "<|im_start|>user\nhi<|im_end|>", "a    b"]
N = 16


def _model(name: str) -> str:
    path = fetch_models.model_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not fetched: python scripts/fetch_models.py {name}")
    return str(path)


def _reference(path: str, tmp_path: Path):
    """transformers' model from the same GGUF, dequantised to fp32 (helpers.hf_from_gguf)."""
    return hf_from_gguf(path, tmp_path)


def _check(llm: LLM, ref, prompts: list[list[int]]) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                        use_tqdm=False)
    for ids, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert len(got) == N
        assert_reference_greedy(ref, ids, got)


def test_qwen25_gguf_greedy_tokens_equal_transformers(tmp_path):
    path = _model("qwen25-coder-0.5b")
    # fp32 with the machine's kernels (the default path, tuning off for a fast start).
    llm = LLM(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=64 << 20,
              max_model_len=512)
    cfg = llm.engine.model_config
    assert (cfg.family, cfg.attention_bias, cfg.tie_word_embeddings) == ("qwen2", True, False)
    tok = llm.get_tokenizer()
    ref_tok = hf_tokenizer_from_gguf(path, "Qwen2Tokenizer")
    for text in RAW + TOKENIZER_TEXTS:
        assert tok.encode(text) == ref_tok.encode(text), text
    chats = [tok.apply_chat_template(c) for c in CHAT]
    for conv, text in zip(CHAT, chats):  # the chat template is the file's own
        assert text == ref_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    # Tools and a tool-call history render as transformers renders them, read by hermes.
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    history = [CHAT[0][0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    from servelm.server.protocol import ChatMessage
    from servelm.server.tools import parser_for_template
    ours = tok.apply_chat_template([ChatMessage(**m).to_template() for m in history],
                                   tools=tools)
    hf_history = [{**m, "tool_calls": [{**c, "function": {"name": "get_weather",
                                                          "arguments": {"city": "Oslo"}}}
                                       for c in m["tool_calls"]]} if m.get("tool_calls") else m
                  for m in history]
    assert ours == ref_tok.apply_chat_template(hf_history, tools=tools, tokenize=False,
                                               add_generation_prompt=True)
    assert "<tools>" in ours and '"arguments": {"city": "Oslo"}' in ours
    assert tok.renders_tools
    assert parser_for_template("auto", tok.chat_template).name == "hermes"
    ref = _reference(path, tmp_path)
    _check(llm, ref, [tok.encode(RAW[0])] +
           [tok.encode(c, add_special_tokens=False) for c in chats])


def test_gemma3_gguf_greedy_tokens_equal_transformers(tmp_path):
    path = _model("gemma3-270m")
    llm = LLM(model=path, dtype="float32", kernel_tuning="off", kv_cache_memory=64 << 20,
              max_model_len=1024)
    cfg = llm.engine.model_config
    assert cfg.family == "gemma3" and cfg.layer_types.count("full_attention") == 3
    tok = llm.get_tokenizer()
    ref_tok = hf_tokenizer_from_gguf(path, "GemmaTokenizer")
    for text in RAW + TOKENIZER_TEXTS:
        assert tok.encode(text) == ref_tok.encode(text), text
    ref = _reference(path, tmp_path)
    # A prompt past the 512-token window too: the sliding layers drop its first keys.
    long = tok.encode(" ".join(f"item {i}," for i in range(120)))
    assert cfg.sliding_window < len(long) < 1024 - N
    _check(llm, ref, [tok.encode(p) for p in RAW[:2]] + [long])
