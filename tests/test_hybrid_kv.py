"""A hybrid model's pool in block groups (ModelConfig.kv_groups): sliding-window and
full-attention layers in groups of equal size, the sliding groups' pages out of the window
given back as sequences grow. Against one block table for every layer (hybrid_kv_cache
off) and transformers: the same tokens through chunked prefill, prefix-cache hits and
preemption, bit-identical on the kernel paths, and longer sequences in the same memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import (assert_prefix_travels_between_engines, assert_reference_greedy,
                     assert_stack_decodes_as_per_op, prompt_logits, tiny_hf_checkpoint)
from servelm import LLM, SamplingParams
from servelm.kernels import load_ops
from servelm.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

WINDOW = 8
# Sliding, sliding, full, sliding, sliding, full: two layers a group, the full layers'
# group first, then two sliding groups (each sliding layer's pages in slab 0 or 1).
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
PROMPTS = ["The capital of France is Paris, the capital of Spain is Madrid, and the capital "
           "of Italy is Rome. " * 3,
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib(n - 1) " * 3,
           "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BASE = dict(dtype="float32", kernel_tuning="off", block_size=4, max_num_seqs=4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, hf_tokenizer):
    d = tmp_path_factory.mktemp("hf-gemma3-hybrid")
    model = tiny_hf_checkpoint(d, "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=LAYER_TYPES), hf_tokenizer, seed=7)
    return str(d), model


def _ids(llm):
    return [llm.get_tokenizer().encode(p) for p in PROMPTS]


def _tokens(llm, prompts, sp=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_kv_groups_cut_a_hybrid_model_into_groups_of_equal_size(gemma3):
    cfg = ModelConfig.from_hf_dir(gemma3[0])
    groups = cfg.kv_groups
    assert groups.layers == ((2, 5), (0, 1), (3, 4)) and groups.reaches == (0, WINDOW, WINDOW)
    assert groups.place(3) == (2, 0) and groups.place(5) == (0, 1)
    # Five sliding layers to one full one: the sliding ones in groups of the full ones' count.
    five = replace(cfg, num_layers=12, layer_types=(("sliding_attention",) * 5
                                                    + ("full_attention",)) * 2)
    assert five.kv_groups.layers == ((5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10))
    # One reach serves a model whose every layer slides (BlockManager.reach), none a model
    # of full layers.
    assert replace(cfg, layer_types=("sliding_attention",) * 6).kv_groups is None
    assert replace(cfg, layer_types=("full_attention",) * 6).kv_groups is None
    # Layers of other shapes fill pages of one size (the smaller kind's whole): full layers
    # of half the KV heads two to a page, the sliding ones one; global layers of twice the
    # head size two to a page, the sliding ones four.
    narrow = replace(cfg, layer_kv_heads=(2, 2, 1, 2, 2, 1))
    assert narrow.kv_groups.layers == ((2, 5), (0,), (1,), (3,), (4,))
    wide = replace(cfg, layer_head_dims=(32, 32, 64, 32, 32, 64))
    assert wide.kv_groups.layers == ((2, 5), (0, 1, 3, 4))
    assert wide.kv_groups.reaches == (0, WINDOW)
    # A KV-shared layer reads its source's pages, unless their reaches differ.
    shared = replace(cfg, kv_source_layers=(0, 1, 2, 3, 1, 2))
    assert shared.kv_groups.layers == ((2,), (0,), (1,), (3,))
    assert shared.kv_groups.place(4) == (2, 0) and shared.kv_groups.place(5) == (0, 0)
    assert replace(cfg, kv_source_layers=(0, 1, 2, 3, 4, 4)).kv_groups is None


def test_the_pool_in_groups_gives_the_one_table_tokens_and_transformers(gemma3):
    """Prompts past the window, prefilled in 8-token chunks on the reference and the kernel
    attention, a second round from the prefix cache, then a pool so tight it preempts: the
    tokens of one table for every layer, and transformers' greedy tokens."""
    path, ref = gemma3
    one = LLM(model=path, **BASE, hybrid_kv_cache=False, kv_cache_memory=8 << 20)
    assert one.engine.executor.kv_groups is None and not one.engine.block_manager.groups
    prompts = _ids(one)
    assert min(map(len, prompts)) > 3 * WINDOW
    want = _tokens(one, prompts)
    for ids, got in zip(prompts, want):
        assert_reference_greedy(ref, ids, got, banned=(ref.config.eos_token_id,))
    for kernels in ([False, True] if load_ops("ops") else [False]):
        llm = LLM(model=path, **BASE, cpu_kernels=kernels, kv_cache_memory=8 << 20,
                  max_num_batched_tokens=8)
        engine = llm.engine
        assert engine.block_manager.groups == (WINDOW, WINDOW)
        torch.testing.assert_close(prompt_logits(engine, prompts),
                                   prompt_logits(one.engine, prompts), rtol=1e-4, atol=1e-4)
        for round_ in range(2):  # the second from the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want, (kernels, round_)
        assert all(o.metrics.num_cached_tokens >= 2 * WINDOW for o in outs)
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    # A pool of 40 pages: the three sequences cannot all hold their keys at once.
    page = LLM(model=path, **BASE, kv_cache_memory=8 << 20).engine.executor.block_bytes
    tight = LLM(model=path, **BASE, kv_cache_memory=40 * page, admission_lookahead=0,
                max_num_batched_tokens=8)
    assert _tokens(tight, prompts) == want
    assert tight.engine.scheduler.num_preemptions > 0


def test_a_sequence_holds_only_the_window_in_its_sliding_groups(gemma3):
    """In memory for 16 blocks of every layer, one table caps a sequence at 64 tokens; in
    groups a block of tokens takes one page of the full layers, and the sliding groups
    hold the window and a step's tokens, so a sequence grows past 128."""
    path, ref = gemma3
    block = LLM(model=path, **BASE, hybrid_kv_cache=False,
                kv_cache_memory=1 << 20).engine.executor.block_bytes
    kw = dict(model=path, **BASE, kv_cache_memory=16 * block, max_num_batched_tokens=8,
              max_model_len=512)
    one = LLM(**kw, hybrid_kv_cache=False)
    assert one.engine.max_model_len == 64
    llm = LLM(**kw)
    engine = llm.engine
    assert engine.block_manager.num_blocks == 48  # pages of two layers
    assert engine.kv_capacity_tokens == 64 and engine.max_model_len > 128
    prompt = llm.get_tokenizer().encode(PROMPTS[0] * 2)[:120]
    held = []
    step = engine.step

    def watched():
        out = step()
        held.extend(engine.block_manager.num_held(r.request_id)
                    for r in engine.scheduler.running)
        return out
    engine.step = watched
    got = _tokens(llm, [prompt])[0]
    assert_reference_greedy(ref, prompt, got, banned=(ref.config.eos_token_id,))
    # At its longest: 36 pages of the full group, at most 5 in each sliding group.
    assert max(held) <= 36 + 2 * 5 < 3 * 36
    assert engine.block_manager.num_free_blocks == 48


@pytest.mark.skipif(not load_ops("ops"), reason="needs the C++ kernels")
def test_the_kernel_paths_read_each_group_bit_for_bit(gemma3):
    """bf16 on the C++ kernels: the pool in groups gives the one-table logits exactly, and
    its decode steps run in the DecodeStack (each layer its group's tables and slots) with
    the per-op path's tokens and logprobs."""
    path, _ = gemma3
    kw = dict(model=path, dtype="bfloat16", kernel_tuning="off", block_size=4,
              kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4)
    one = LLM(**kw, hybrid_kv_cache=False)
    llm = LLM(**kw)
    prompts = _ids(llm)
    assert torch.equal(prompt_logits(llm.engine, prompts), prompt_logits(one.engine, prompts))
    assert llm.engine.executor.model.decode_stack_ranges()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    assert _tokens(llm, prompts, sp) == _tokens(one, prompts, sp)
    assert_stack_decodes_as_per_op(llm, prompts, sp)


def test_an_int8_pool_in_groups_reads_as_one_table(gemma3):
    """A quantised pool's scales follow the pages into their slabs: the int8 pool in groups
    gives the one-table int8 logits exactly (the reference attention and, where built, the
    C++ kernels)."""
    path, _ = gemma3
    kw = dict(model=path, **BASE, kv_cache_memory=8 << 20, kv_cache_dtype="int8",
              max_num_batched_tokens=16)
    for kernels in ([False, True] if load_ops("ops") else [False]):
        one = LLM(**kw, cpu_kernels=kernels, hybrid_kv_cache=False)
        llm = LLM(**kw, cpu_kernels=kernels)
        assert llm.engine.executor.kv_cache.scales is not None
        prompts = _ids(llm)
        assert torch.equal(prompt_logits(llm.engine, prompts),
                           prompt_logits(one.engine, prompts))
        assert _tokens(llm, prompts) == _tokens(one, prompts)


def test_a_prefix_in_groups_travels_between_engines(gemma3):
    """Disaggregated prefill: a pool in groups sends its prefix's blocks and its sliding
    groups' pages in reach of the end; the receiver runs the prompt from them."""
    assert_prefix_travels_between_engines(
        dict(model=gemma3[0], **BASE, kv_cache_memory=8 << 20), PROMPTS[0], GREEDY)


def test_a_draft_beside_a_pool_in_groups_takes_a_block_per_block_of_tokens(
        gemma3, tmp_path, hf_tokenizer):
    """Speculative decoding with a hybrid target: the draft's pool holds a block for each
    block of tokens the target's pages hold (one page of each group), not one per page,
    and the greedy tokens are the target's own, through rejected drafts (a draft of other
    weights: each group's pages past the accepted tokens go back)."""
    path, _ = gemma3
    tiny_hf_checkpoint(tmp_path, "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=LAYER_TYPES[:3]), hf_tokenizer, seed=8)
    kw = dict(model=path, **BASE, kv_cache_memory=8 << 20)
    plain = LLM(**kw)
    llm = LLM(**kw, speculative_config={"method": "draft_model", "model": str(tmp_path),
                                        "num_speculative_tokens": 3})
    ex = llm.engine.executor
    groups = len(ex.kv_groups.layers)
    assert ex.draft.block_manager.num_blocks == ex.num_blocks // groups
    # Its bytes: the target's pages and the draft's blocks fill the same budget.
    page = ex.worker.bytes_per_block(4, ex.kv_cache.dtype, ex.kv_groups)
    draft = ex.draft.bytes_per_block(4, ex.kv_cache.dtype)
    assert ex.num_blocks * page + ex.draft.block_manager.num_blocks * draft <= 8 << 20
    assert (ex.num_blocks + groups) * page + (ex.num_blocks // groups + 1) * draft > 8 << 20
    # Speculate every step, whatever this machine measured (a self-draft costs as much as
    # the target, so the roofline alone would not).
    llm.engine.speculator.ridge_tokens, llm.engine.speculator.draft_cost = 1e9, 0.0
    prompts = _ids(llm)
    assert _tokens(llm, prompts) == _tokens(plain, prompts)
    stats = llm.engine.stats
    assert stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens  # drafts rejected
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
