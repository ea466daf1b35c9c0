"""servelm's fp32 path against transformers loading the same GGUF: logits and greedy tokens."""

from __future__ import annotations

import pytest

from conftest import CHAT_PROMPTS, TEXT_PROMPTS
from helpers import assert_last_logits_match, assert_reference_greedy
from servelm import SamplingParams


def _chat_ids(llm, conv):
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)


def test_first_step_logits_match_reference(llm, hf_model):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in TEXT_PROMPTS] + [_chat_ids(llm, c) for c in CHAT_PROMPTS[:2]]
    for ours, ref in assert_last_logits_match(llm.engine, hf_model, prompts):
        assert int(ours.argmax()) == int(ref.argmax())


def test_greedy_continuations_match_reference(llm, hf_model):
    # min_tokens bans EOS, so every continuation is a full 48 tokens; the reference's argmax
    # is taken with EOS banned too, as its min_new_tokens would.
    prompts = [_chat_ids(llm, c) for c in CHAT_PROMPTS[2:]]  # system prompt, multi-turn, code
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=48, min_tokens=48),
                        use_tqdm=False)
    eos = hf_model.generation_config.eos_token_id
    for ids, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert len(got) == 48
        assert_reference_greedy(hf_model, ids, got, [eos] if isinstance(eos, int) else eos)
