"""The engine on the real model: KV cache correctness, batch invariance, requests' life."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import TEXT_PROMPTS
from helpers import prompt_logits, release, run_seqs
from servelm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_cached_decode_logits_equal_full_forward(llm):
    """Each decode step reads earlier K/V from the cache; it must equal recomputing everything."""
    engine = llm.engine
    ids = llm.get_tokenizer().encode("The paged KV cache keeps keys and values in blocks")
    try:
        logits = run_seqs(engine, [(ids, 0, "cached")])[0]
        for _ in range(20):  # crosses block boundaries (block size 16)
            nxt = int(logits.argmax())
            logits = run_seqs(engine, [([nxt], len(ids), "cached")])[0]
            ids = ids + [nxt]
            full = prompt_logits(engine, [ids])[0]
            assert (logits - full).abs().max().item() <= 1e-4 * full.abs().max().item()
    finally:
        release(engine, "cached")


def test_decode_and_prefill_in_one_batch(llm):
    """A decode token and another sequence's prompt in one forward give the same logits as apart."""
    engine = llm.engine
    tok = llm.get_tokenizer()
    a, b = tok.encode(TEXT_PROMPTS[0]), tok.encode(TEXT_PROMPTS[2])
    try:
        first = run_seqs(engine, [(a, 0, "a")])[0]
        nxt = int(first.argmax())
        mixed = run_seqs(engine, [(b, 0, "b"), ([nxt], len(a), "a")])
    finally:
        release(engine, "a", "b")
    alone = prompt_logits(engine, [b, a + [nxt]])
    assert torch.allclose(mixed, alone, atol=1e-4 * alone.abs().max().item())


def test_decodes_of_different_lengths_in_one_batch(llm):
    """A 300-token and a 10-token sequence decode in one step (different attention groups)."""
    engine = llm.engine
    tok = llm.get_tokenizer()
    short = tok.encode("Hello there, how")
    long = tok.encode("A long, winding story about the sea and its sailors. " * 25)
    try:
        s = int(run_seqs(engine, [(short, 0, "short")])[0].argmax())
        lg = int(run_seqs(engine, [(long, 0, "long")])[0].argmax())
        both = run_seqs(engine, [([s], len(short), "short"), ([lg], len(long), "long")])
    finally:
        release(engine, "short", "long")
    alone = prompt_logits(engine, [short + [s], long + [lg]])
    assert torch.allclose(both, alone, atol=1e-4 * alone.abs().max().item())


def _alone(llm, prompts, params):
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_batch_invariance_with_staggered_arrivals(llm):
    """10 prompts of different lengths joining at different steps decode as if each ran alone."""
    base = "Tell me something about the number"
    prompts = [f"{base} {i}" + " please" * (i % 5) + "." for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    expected = _alone(llm, prompts, params)
    engine = llm.engine
    done = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:  # a new request joins every other step
            for _ in range(2 if steps % 4 == 0 else 1):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(f"stagger-{i}", p, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    got = [done[f"stagger-{i}"] for i in range(10)]
    assert got == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_generate_returns_outputs_in_prompt_order_with_timings(llm):
    prompts = [f"Count to {i}:" for i in range(40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    tok = llm.get_tokenizer()
    for o, p in zip(outs, prompts):
        assert o.prompt_token_ids == tok.encode(p)
        c = o.outputs[0]
        assert 1 <= len(c.token_ids) <= 8 and c.finish_reason in ("stop", "length")
        m = o.metrics
        assert m.num_prompt_tokens == len(o.prompt_token_ids)
        assert m.num_output_tokens == len(c.token_ids)
        assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency
        assert len(m.inter_token_latencies) == len(c.token_ids) - 1
        if len(c.token_ids) > 1:
            assert m.tpot == pytest.approx(sum(m.inter_token_latencies) / (len(c.token_ids) - 1))


def test_max_tokens_and_eos(llm):
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    chat = llm.chat([{"role": "user", "content": "Say hello."}],
                    SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in llm.get_tokenizer().eos_token_ids
    assert "<|im_end|>" not in chat.text


def test_chat_takes_a_template_as_source_or_file_with_its_variables(llm, tmp_path):
    template = "{% for m in messages %}<<{{ m.content }}{{ mark }}>>{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    sp = SamplingParams(temperature=0, max_tokens=1)
    for given in (template, str(path)):
        out = llm.chat([{"role": "user", "content": "Hi"}], sp, use_tqdm=False,
                       chat_template=given, chat_template_kwargs={"mark": "!"})[0]
        assert out.prompt == "<<Hi!>>"
        assert out.prompt_token_ids == llm.get_tokenizer().encode("<<Hi!>>",
                                                                  add_special_tokens=False)


def test_stop_strings_and_stop_token_ids(llm):
    free = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0]
    assert " 7," in free.text
    cut = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20, stop=" 7"),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 7"
    assert cut.text == free.text[: free.text.index(" 7")]
    kept = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20, stop=[" 7"],
                                                          include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == cut.text + " 7"
    stop_id = free.token_ids[2]
    by_id = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20,
                                                           stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == free.token_ids[:3] and by_id.stop_reason == stop_id


def test_seed_gives_same_tokens_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate("Write a story:", p, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(["Other text", "Write a story:", "More"], [noise, p, noise],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate("Write a story:", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16,
                                                          seed=99, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_n_samples_and_logprobs(llm):
    p = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, logprobs=2, ignore_eos=True)
    out = llm.generate("Once upon a time", p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == 6 and len(c.logprobs) == 6
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 2
            assert lp.top[0][1] >= lp.top[1][1] and lp.rank >= 1


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    free0 = engine.block_manager.num_free_blocks
    engine.add_request("to-abort", "A long story begins", SamplingParams(max_tokens=100))
    engine.add_request("to-keep", "Another", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < free0
    assert engine.abort_request("to-abort")
    assert not engine.abort_request("to-abort")
    assert "to-abort" not in engine.block_manager.owners()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"to-keep"}
    assert engine.block_manager.num_free_blocks == free0


def test_preemption_under_a_tiny_pool_keeps_outputs_identical(llm):
    """10 requests through a pool a few blocks larger than one sequence: constant preemption,
    recompute from the prefix cache, and every request's tokens equal running it alone."""
    from servelm import LLM

    block_bytes = 16 * 30 * 2 * 3 * 64 * 4  # tokens x layers x (K, V) x KV heads x dim x fp32
    # No admission lookahead: admit whatever fits now, so the pool thrashes.
    small = LLM(dtype="float32", kv_cache_memory=5 * block_bytes, max_model_len=64,
                admission_lookahead=0)
    assert small.engine.block_manager.num_blocks == 5
    prompts = [f"Item {i}: the quick brown fox jumps over the lazy dog" for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Every request outgrows its first block while others hold theirs: the pool must thrash.
    assert all(len(small.get_tokenizer().encode(p)) + 8 > 20 for p in prompts)
    got = small.generate(prompts, params, use_tqdm=False)
    engine = small.engine
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == _alone(llm, prompts, params)
    assert sum(o.metrics.num_preemptions for o in got) == engine.scheduler.num_preemptions
    assert engine.block_manager.num_free_blocks == 5 and not engine.has_unfinished_requests()

    # The default admission lookahead keeps room for running requests' next tokens:
    # the same tokens, with fewer preemptions.
    careful = LLM(dtype="float32", kv_cache_memory=5 * block_bytes, max_model_len=64)
    again = careful.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]
    assert careful.engine.scheduler.num_preemptions < engine.scheduler.num_preemptions


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "prompt must not be empty"),
    ("x " * 9000, SamplingParams(max_tokens=1), "maximum context length"),
    ("Hello", SamplingParams(max_tokens=100_000), "max_tokens"),
    ([1, 2, 10**9], SamplingParams(), "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2]}, SamplingParams(), "prompt must be a string or a list"),
])
def test_bad_requests_are_rejected_with_a_clear_error(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(None, prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_request_ids_must_be_unique_including_samples(llm):
    engine = llm.engine
    engine.add_request("dup#1", "Hello", SamplingParams(max_tokens=2))
    try:
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup#1", "Again", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already in use"):  # its samples are dup#0, dup#1
            engine.add_request("dup", "Again", SamplingParams(n=2, max_tokens=2))
    finally:
        engine.abort_request("dup#1")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path_names_the_file(tmp_path):
    from servelm import LLM

    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=f"{missing}: no such file"):
        LLM(model=str(missing))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match=f"{junk}: not a GGUF file"):
        LLM(model=str(junk))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(model=str(tmp_path))


def test_step_accounting_against_the_roofline_model(llm):
    """Decode steps are charged weights + context KV bytes and their tokens' FLOPs; prefill
    steps the prompt's FLOPs and the bytes they read."""
    engine = llm.engine
    st, shape = engine.stats, engine.shape
    assert shape.weight_bits == 32 and shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    ids = [1000 + i for i in range(40)]  # no prefix cache hit: fresh tokens
    before = replace(st)
    llm.generate([{"prompt_token_ids": ids}],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    p = len(ids)
    decode_bytes = sum(shape.weight_bytes_per_step + (p + i) * shape.kv_bytes_per_token
                       for i in range(1, 5))  # four decode steps, context p+1 .. p+4
    assert st.decode_bytes - before.decode_bytes == pytest.approx(decode_bytes)
    # Each decode token: 2 FLOPs a weight, and attention over its context.
    assert st.decode_flops - before.decode_flops == pytest.approx(
        sum(shape.flops_per_token(p + i) for i in range(1, 5)))
    assert st.num_decode_steps - before.num_decode_steps == 4
    assert st.num_generated_tokens - before.num_generated_tokens == 5  # the prompt's one too
    # The prompt's step read every weight once and its own KV.
    assert st.prefill_bytes - before.prefill_bytes == pytest.approx(
        shape.weight_bytes(p) + p * shape.kv_bytes_per_token)
    # The LM head and the last layer past attention run for the prompt's last position only.
    tail = 2 * 49152 * 576 + 2 * (576 * 576 + 3 * 576 * 1536)
    assert shape.sampled_row_flops == tail
    want = p * (shape.flops_per_token(p // 2) - tail) + tail
    assert st.prefill_flops - before.prefill_flops == pytest.approx(want)
    assert st.decode_seconds > before.decode_seconds
    assert st.prefill_seconds > before.prefill_seconds
    assert st.decode_bandwidth > 0 and st.prefill_flops_rate > 0


def test_default_threads_one_per_physical_core():
    import os

    from servelm.config import EngineConfig
    from servelm.runtime import init_process, physical_cores

    n = physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        # The process's start-up without num_threads: one thread per physical core on CPU.
        init_process(EngineConfig(device="cpu"))
        assert torch.get_num_threads() == n
        init_process(EngineConfig(device="cpu", num_threads=n + 1))  # asked for: that
        assert torch.get_num_threads() == n + 1
    finally:
        torch.set_num_threads(before)
