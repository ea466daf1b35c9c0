"""Issue 4 on the real model: prefix caching, chunked prefill and preemption never change tokens."""

from __future__ import annotations

import dataclasses

import pytest

from servelm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, cite nothing, and "
          "never invent facts you are unsure about. ") * 3


def _prompts():
    # Shared system prefix (several blocks), then different questions; one exact repeat.
    qs = ["What is a KV cache?", "Name a prime.", "What is 2+2?", "Say hi.", "What is a KV cache?"]
    return [SYSTEM + q for q in qs]


@pytest.fixture(scope="module")
def llm_nocache():
    return LLM(dtype="float32", kv_cache_memory=128 << 20, enable_prefix_caching=False)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_outputs_identical_with_and_without_prefix_caching(llm, llm_nocache):
    prompts = _prompts()
    without = _tokens(llm_nocache, prompts)
    assert llm_nocache.engine.block_manager.num_hit_tokens == 0
    hits0 = llm.engine.block_manager.num_hit_tokens
    first = _tokens(llm, prompts)   # all admitted in one step: nothing cached yet
    second = _tokens(llm, prompts)  # every whole block of each prompt is now a hit
    assert first == without and second == without
    assert llm.engine.block_manager.num_hit_tokens > hits0


def test_shared_long_prefix_is_reported_cached_and_skips_prefill(llm):
    engine = llm.engine
    tok = llm.get_tokenizer()
    prefix = tok.encode("Once upon a time there was a cache. " * 200)[:1000]
    assert len(prefix) == 1000
    a = prefix + tok.encode(" and then the first question?")
    b = prefix + tok.encode(" but a different ending.")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out_a = llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0]
    assert out_a.metrics.num_cached_tokens == 0
    prefill0 = engine.stats.num_prefill_tokens
    out_b = llm.generate([{"prompt_token_ids": b}], params, use_tqdm=False)[0]
    cached = out_b.metrics.num_cached_tokens
    assert cached == 1000 // 16 * 16  # every whole block of the shared prefix
    assert engine.stats.num_prefill_tokens - prefill0 == len(b) - cached


def test_cached_prefix_tokens_equal_cold_run(llm, llm_nocache):
    tok = llm.get_tokenizer()
    prefix = tok.encode("Once upon a time there was a cache. " * 200)[:1000]
    b = prefix + tok.encode(" with yet another ending.")
    llm.generate([{"prompt_token_ids": prefix + [13]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)  # puts the prefix in the cache
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    warm = llm.generate([{"prompt_token_ids": b}], params, use_tqdm=False)[0]
    assert warm.metrics.num_cached_tokens > 0
    cold = llm_nocache.generate([{"prompt_token_ids": b}], params, use_tqdm=False)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.parametrize("budget", [7, 32, 100])
def test_chunked_prefill_at_several_chunk_sizes(llm_nocache, budget):
    engine = llm_nocache.engine
    prompts = _prompts()[:3]
    expected = _tokens(llm_nocache, prompts)
    cfg = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(cfg, max_num_batched_tokens=budget,
                                                  max_num_seqs=min(budget, cfg.max_num_seqs))
    try:
        steps0 = engine.stats.num_steps
        got = _tokens(llm_nocache, prompts)
        # The prompts (~60 tokens each) cannot fit one step at these budgets: they were chunked.
        assert engine.stats.num_steps - steps0 > GREEDY.max_tokens
    finally:
        engine.scheduler.config = cfg
    assert got == expected


def test_n_samples_share_the_prompt_blocks(llm):
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    prompt = SYSTEM + "Tell me a short fact."
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    n_prompt = len(out.prompt_token_ids)
    whole = (n_prompt - 1) // 16 * 16
    cached = [c.metrics.num_cached_tokens for c in out.outputs]
    assert cached[1:] == [whole, whole]  # siblings reuse the first sample's prompt blocks
    assert all(len(c.token_ids) == 6 for c in out.outputs)
