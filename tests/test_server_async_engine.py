"""AsyncLLMEngine in-process, over the session's fp32 engine: outputs, validation, aborts,
admission, and what happens when a step raises."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import TEXT_PROMPTS
from servelm import SamplingParams
from servelm.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineStepError,
                                         QueueFullError, ShuttingDownError)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _no_idle_work(llm, monkeypatch):
    """These tests step the session's engine from the test thread (llm.generate) while an
    AsyncLLMEngine's thread owns it, which only holds while that thread is idle: it must
    not commit the pool then (CacheConfig.commit_while_idle), or it would step the engine
    itself when it next looks."""
    import dataclasses

    config = llm.engine.config
    monkeypatch.setattr(llm.engine, "config", dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, commit_while_idle=False)))
    monkeypatch.setattr(llm.engine, "retuner", None)  # nor re-tune its linear methods


@pytest.fixture
def aengine(llm):
    engine = AsyncLLMEngine(llm.engine, max_queue=8)
    engine.start()
    yield engine
    engine.stop()
    # The shared engine must be left as it was found.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


async def _collect(stream) -> list:
    return [out async for out in stream]


def test_outputs_equal_llm_generate_and_stream_step_by_step(aengine, llm):
    expected = [o.outputs[0] for o in llm.generate(TEXT_PROMPTS[:3], GREEDY, use_tqdm=False)]

    async def main():
        streams = [aengine.generate(p, GREEDY) for p in TEXT_PROMPTS[:3]]
        return await asyncio.gather(*(_collect(s) for s in streams))

    for outs, exp in zip(asyncio.run(main()), expected):
        assert len(outs) == 8 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == exp.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == exp.text


def test_event_loop_is_not_blocked_by_compute(aengine):
    async def main():
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await _collect(aengine.generate("Tell me a story.", SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True)))
        done.set()
        await tick
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 20 and max(gaps) < 0.5, max(gaps)


def test_validation_errors_raise_at_once(aengine, llm):
    async def main():
        with pytest.raises(ValueError, match="maximum context length"):
            aengine.generate([1] * (llm.engine.max_model_len + 1), GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            aengine.generate([10**9], GREEDY)

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks_within_one_step(aengine, llm):
    bm = llm.engine.block_manager

    async def main():
        stream = aengine.generate("Count to a thousand:", SamplingParams(
            temperature=0, max_tokens=500, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        assert bm.num_free_blocks < bm.num_blocks
        steps_at_abort = aengine.snapshot.stats.num_steps
        await stream.aclose()
        while aengine.snapshot.num_running:
            await asyncio.sleep(0.005)
        return steps_at_abort

    steps_at_abort = asyncio.run(main())
    assert aengine.snapshot.stats.num_steps - steps_at_abort <= 1
    assert bm.num_free_blocks == bm.num_blocks and aengine.snapshot.stats.num_aborted >= 1


def test_queue_bound_counts_only_sequences_beyond_the_running_batch(llm, monkeypatch):
    """max_queue=1 with room for 2 running: of a burst of 4, 2 would run, 1 would wait, the
    4th is refused; n=4 could never be admitted and is a ValueError, not a retry."""
    engine = AsyncLLMEngine(llm.engine, max_queue=1)
    monkeypatch.setattr(engine, "_max_seqs", lambda: 2)
    engine.start()

    async def main():
        with pytest.raises(ValueError, match="n \\(4\\)"):
            engine.generate("Too many", SamplingParams(n=4, max_tokens=8))
        streams, refused = [], 0
        for i in range(4):  # no await in between: the engine thread cannot catch up
            try:
                streams.append(engine.generate(f"Prompt {i}", GREEDY))
            except QueueFullError:
                refused += 1
        return refused, await asyncio.gather(*(_collect(s) for s in streams))

    try:
        refused, results = asyncio.run(main())
    finally:
        engine.stop()
    assert refused == 1 and len(results) == 3
    assert all(len(r[-1].outputs[0].token_ids) == 8 for r in results)


def test_expire_ends_requests_in_flight_and_refuses_new_ones(aengine):
    async def main():
        stream = aengine.generate("Tell me a long story.", SamplingParams(max_tokens=500,
                                                                          ignore_eos=True))
        first = await stream.__anext__()
        aengine.expire()
        with pytest.raises(ShuttingDownError):
            async for _ in stream:
                pass
        with pytest.raises(ShuttingDownError):
            aengine.generate("After", GREEDY)
        return first

    assert not asyncio.run(main()).finished
    assert not aengine.healthy


def test_step_error_reaches_every_request_and_loop_survives(aengine, llm, monkeypatch):
    executor = llm.engine.executor
    real_execute = executor.execute
    calls = {"n": 0}

    def flaky(seqs):
        calls["n"] += 1
        if calls["n"] == 2:  # blocks are allocated by now: cleanup must free them
            raise RuntimeError("injected fault")
        return real_execute(seqs)

    monkeypatch.setattr(executor, "execute", flaky)

    async def main():
        streams = [aengine.generate(p, GREEDY) for p in TEXT_PROMPTS[:2]]
        results = await asyncio.gather(*(_collect(s) for s in streams), return_exceptions=True)
        after = await _collect(aengine.generate(TEXT_PROMPTS[0], GREEDY))
        return results, after

    results, after = asyncio.run(main())
    assert all(isinstance(r, EngineStepError) and "injected fault" in str(r) for r in results)
    assert aengine.healthy and after[-1].finished and len(after[-1].outputs[0].token_ids) == 8


def test_stop_fails_requests_in_flight(llm):
    engine = AsyncLLMEngine(llm.engine)
    engine.start()

    async def main():
        stream = engine.generate("Go on forever:", SamplingParams(max_tokens=400,
                                                                  ignore_eos=True))
        await stream.__anext__()
        await asyncio.to_thread(engine.stop)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            engine.generate("Too late", GREEDY)

    asyncio.run(main())
    assert not engine.healthy and not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_build_runs_the_engine_on_the_thread_that_built_it(llm):
    import threading

    built_on = {}

    def factory():
        built_on["thread"] = threading.current_thread()
        return llm.engine

    engine = AsyncLLMEngine.build(factory, max_queue=4)
    try:
        assert built_on["thread"] is engine._thread and engine.healthy
        expected = llm.generate(TEXT_PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

        async def main():
            return await _collect(engine.generate(TEXT_PROMPTS[0], GREEDY))

        outs = asyncio.run(main())
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == expected
    finally:
        engine.stop()


def test_build_raises_what_the_factory_raised():
    def factory():
        raise ValueError("/nowhere.gguf: no such file or directory")

    with pytest.raises(ValueError, match="nowhere.gguf"):
        AsyncLLMEngine.build(factory)


def test_idle_engine_commits_the_kv_pool_and_serves_meanwhile(monkeypatch):
    # CacheConfig.commit_while_idle: the engine thread commits the pool a slice at a time
    # while nothing is queued, and a request arriving meanwhile is served at once. An engine
    # of its own: the shared one is stepped from the test thread too (_no_idle_work).
    import dataclasses

    from servelm import LLM, hugepages

    probe = hugepages.empty(hugepages.HUGE_PAGE)
    if not hugepages.populate(probe.data_ptr(), probe.numel()):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14+")
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, commit_kv_while_idle=False,
              retune_when_idle=False)
    kv, config = llm.engine.executor.kv_cache, llm.engine.config
    before = kv.uncommitted_bytes  # off: nothing committed
    assert not config.cache.commit_while_idle and before > 32 << 20
    assert not llm.engine.commit_idle() and kv.uncommitted_bytes == before
    monkeypatch.setattr(llm.engine, "config", dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, commit_while_idle=True)))
    expected = llm.generate(TEXT_PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    try:
        async def one():
            return await _collect(engine.generate(TEXT_PROMPTS[0], GREEDY))

        outs = asyncio.run(one())
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == expected
        deadline = time.monotonic() + 60
        while kv.uncommitted_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.uncommitted_bytes == 0
        outs = asyncio.run(one())
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == expected
    finally:
        engine.stop()


def test_serve_flag_turns_idle_commit_off(monkeypatch):
    import servelm.entrypoints.llm as entry
    from servelm.cli import build_llm, make_parser

    seen = {}
    monkeypatch.setattr(entry, "LLM", lambda **kw: seen.update(kw))
    for flags, want in (([], True), (["--no-kv-commit-while-idle"], False)):
        build_llm(make_parser().parse_args(["serve", *flags]))
        assert seen["commit_kv_while_idle"] is want


def test_a_call_republishes_the_adapters_before_its_caller_hears_back(aengine, llm, monkeypatch):
    """A client told "loaded" (load_lora_adapter) may name the adapter in its very next
    request: the engine thread republishes `loras` before it completes the call's future
    (a done-callback runs the moment the future completes, on that thread)."""
    import concurrent.futures
    from types import SimpleNamespace

    registered = []
    monkeypatch.setattr(llm.engine, "list_loras", lambda: list(registered), raising=False)
    seen = []
    future = concurrent.futures.Future()
    future.add_done_callback(lambda f: seen.append(set(aengine.loras)))
    with aengine._cond:
        aengine._inbox.append(("call", lambda engine: registered.append(
            SimpleNamespace(lora_name="fresh", lora_int_id=7)), future))
        aengine._cond.notify()
    future.result(timeout=30)
    assert seen == [{"fresh"}]
