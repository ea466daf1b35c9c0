"""Speculative decoding (servelm.spec): config checks, the ngram proposer, KV rollback under
random accept/reject/abort (no model), the rejection sampler's distribution, and the engine
with and without speculation on a tiny random model and on the embedded SmolLM2 (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import EngineConfig, SpeculativeConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.request import Request, RequestStatus
from servelm.engine.scheduler import Scheduler
from servelm.config import SchedulerConfig
from servelm.sampling_params import SamplingParams
from servelm.spec.ngram import NgramIndex

# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 1.5}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"prompt_lookup_max": "3"}, "prompt_lookup_max"),
    ({"method": "ngram", "model": "x.gguf"}, "model"),
    ({"method": "draft_model"}, "model"),
    ({"num_speculative_token": 3}, "num_speculative_token"),
])
def test_bad_configs_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)


def test_lookup_bounds_default_as_vllm():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(prompt_lookup_max=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    assert EngineConfig(speculative=c).speculative is c


def test_cli_rejects_bad_speculative_config(capsys):
    from servelm.cli import make_parser

    with pytest.raises(SystemExit):
        make_parser().parse_args(["generate", "hi", "--speculative-config",
                                  '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert "num_speculative_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--speculative-config", "{not json"])
    assert "not JSON" in capsys.readouterr().err
    args = make_parser().parse_args(["serve", "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config.num_speculative_tokens == 3


# ---- the ngram proposer ----------------------------------------------------------------------


def test_ngram_copies_what_followed_the_longest_recurring_suffix():
    ix = NgramIndex(1, 3)  # one index, grown step by step as a sequence is
    t = [1, 2, 3, 4, 9, 2, 3]
    assert ix.propose(t, 2) == [4, 9]   # "2 3" recurs ("9 2 3" does not)
    t += [8]
    assert ix.propose(t, 2) == []       # "8" never occurred before
    t += [1, 2, 3]
    assert ix.propose(t, 3) == [4, 9, 2]  # "1 2 3" recurs: longer than "2 3"


def test_ngram_prefers_longest_match_then_latest_occurrence():
    t = [1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3]
    # 3-gram "1 2 3" occurred first at 0 and is followed by 4 9 2.
    assert NgramIndex(1, 3).propose(t, 3) == [4, 9, 2]
    # Only 2-grams allowed: "2 3" last occurred at 5..7, followed by 8 1 2.
    assert NgramIndex(1, 2).propose(t, 3) == [8, 1, 2]
    assert NgramIndex(4, 4).propose(t, 3) == []


def test_ngram_repeating_pattern_drafts_past_its_period():
    assert NgramIndex(1, 2).propose([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert NgramIndex(1, 1).propose([5, 5], 3) == [5, 5, 5]


# ---- rollback under random accept / reject / abort (no model) --------------------------------

REJECTED = 999_999  # a draft token no true sequence holds: must never reach the prefix cache


def _true_token(prompt: list[int], pos: int) -> int:
    return (sum(prompt[:4]) * 7 + pos * 13) % 50 + 100


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_accept_reject_abort_never_leaks_a_block(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    caching = data.draw(st.booleans())
    n = data.draw(st.integers(1, 5))
    specs = [(data.draw(st.integers(1, 12)), data.draw(st.integers(1, 10)),
              data.draw(st.one_of(st.none(), st.integers(0, 12)))) for _ in range(n)]
    shared = data.draw(st.booleans())  # identical prompts: the prefix cache shares blocks
    largest = max(-(-(p + m + 4) // block_size) for p, m, _ in specs)
    bm = BlockManager(largest + data.draw(st.integers(0, 6)), block_size, enable_caching=caching)
    budget = data.draw(st.integers(n, 24))
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget,
                                      admission_lookahead=0), bm)
    reqs = []
    for i, (p, m, _) in enumerate(specs):
        prompt = [10 + j for j in range(p)] if shared else [10 + 17 * i + j for j in range(p)]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=m), m, arrival_time=0.0)
        reqs.append(r)
        sched.add_request(r)
    for step in range(400):
        for i, (_, _, abort_at) in enumerate(specs):
            if abort_at == step and not reqs[i].is_finished:
                sched.finish_request(reqs[i], RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished():
            break
        plan = {}
        for r in sched.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                k = data.draw(st.integers(0, 4))
                good = data.draw(st.integers(0, k))
                true = [_true_token(r.prompt_token_ids, r.num_tokens + j) for j in range(good)]
                r.spec_token_ids = true + [REJECTED] * (k - good)
                plan[r.request_id] = good
        out = sched.schedule()
        assert out.num_tokens <= budget
        for s in out.scheduled:
            assert s.num_draft == len(s.request.spec_token_ids)
            if s.num_draft:
                s.num_rejected = s.num_draft - min(plan[s.request.request_id], s.num_draft)
        sched.update_after_step(out)
        for s in out.scheduled:
            r = s.request
            if not s.samples:
                continue
            accepted = s.num_draft - s.num_rejected
            for tok in r.spec_token_ids[:accepted] + [_true_token(r.prompt_token_ids, r.num_tokens + accepted)]:
                r.append_output_token(tok, 0.0)
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                    break
            r.spec_token_ids = []
            if not r.is_finished:
                # Rolled back: computed = everything but the last token; no block is held
                # wholly past that token's position.
                assert r.num_computed_tokens == r.num_tokens - 1
                assert len(bm.block_table(r.request_id)) <= bm.num_blocks_for(r.num_tokens)
        owned = [b for t in bm.owners().values() for b in t]
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == owned.count(b)
        assert len(set(owned)) + bm.num_free_blocks == bm.num_blocks
        assert all(REJECTED not in key[1] for key in bm._cached), "a rejected draft was cached"
    assert not sched.has_unfinished()
    assert bm.owners() == {} and bm.num_free_blocks == bm.num_blocks
    for r in reqs:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens  # never overshoots
