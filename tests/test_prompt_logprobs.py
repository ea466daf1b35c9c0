"""prompt_logprobs (vLLM's): every prompt position scored by the model, offline.

The reference for a position is the sampler's own logprob of that token when it is forced as
the next token of the prefix before it (logit_bias +100: reported logprobs are the raw
model's, before any bias)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from servelm import SamplingParams

PROMPT = ("The capital of France is Paris, and the capital of Germany is Berlin. "
          "The capital of Italy is")


def _run(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, **kw),
                        use_tqdm=False)[0]


@pytest.fixture(scope="module")
def scored(llm):
    return _run(llm, PROMPT, prompt_logprobs=3)


def test_prompt_logprobs_shape(scored):
    ids, plp = scored.prompt_token_ids, scored.prompt_logprobs
    assert len(plp) == len(ids) > 10 and plp[0] is None
    for tok, entry in zip(ids[1:], plp[1:]):
        assert tok in entry and 3 <= len(entry) <= 4  # the top 3 and the prompt's own token
        top = sorted((e for t, e in entry.items() if e.rank <= 3), key=lambda e: e.rank)
        assert [e.rank for e in top] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        assert all(e.logprob <= 0 and isinstance(e.decoded_token, str) for e in entry.values())
    assert scored.outputs[0].logprobs is None  # only prompt logprobs were asked for


def test_prompt_logprobs_match_forced_next_token(llm, scored):
    ids, plp = scored.prompt_token_ids, scored.prompt_logprobs
    for j in (1, 7, len(ids) - 1):
        out = llm.generate([{"prompt_token_ids": ids[:j]}],
                           SamplingParams(temperature=0, max_tokens=1, logprobs=0,
                                          logit_bias={ids[j]: 100}), use_tqdm=False)[0]
        ref = out.outputs[0].logprobs[0]
        assert ref.token_id == ids[j]
        assert plp[j][ids[j]].logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert plp[j][ids[j]].rank == ref.rank


def test_prompt_logprobs_across_chunks_and_cache(llm, scored, monkeypatch):
    """A prompt prefilled in 8-token chunks gives the same logprobs; a second request for the
    same prompt bypasses the prefix cache (so every position is computed), while one without
    prompt_logprobs finds the blocks the first put there."""
    sched = llm.engine.scheduler
    monkeypatch.setattr(sched, "config", replace(sched.config, max_num_batched_tokens=8,
                                                       max_num_seqs=8))
    chunked = _run(llm, PROMPT, prompt_logprobs=3)
    monkeypatch.undo()
    again = _run(llm, PROMPT, prompt_logprobs=3)
    for out in (chunked, again):
        assert out.outputs[0].token_ids == scored.outputs[0].token_ids
        for a, b in zip(out.prompt_logprobs[1:], scored.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert again.outputs[0].metrics.num_cached_tokens == 0
    plain = _run(llm, PROMPT)
    assert plain.prompt_logprobs is None and plain.outputs[0].metrics.num_cached_tokens > 0


def test_prompt_logprobs_with_n_and_logprobs(llm, scored):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=3,
                                                logprobs=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    # prompt_logprobs=0: the prompt token's own entry only
    assert all(list(e) == [t] for t, e in zip(ids[1:], out.prompt_logprobs[1:]))
    assert [e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:])] == pytest.approx(
        [e[t].logprob for t, e in zip(ids[1:], scored.prompt_logprobs[1:])], abs=1e-4)
    assert [len(o.logprobs) for o in out.outputs] == [3, 3]


def test_one_token_prompt(llm):
    out = _run(llm, [1], prompt_logprobs=2)
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_validated(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
