"""Scheduler tests: a simulated engine loop (no model) drives Scheduler + BlockManager.

"Sampling" appends a fixed token; a request finishes after max_tokens outputs, exactly as the
engine's step() does: schedule, update_after_step, append a token to every ScheduledSeq with
samples=True, finish_request when done.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.request import Request, RequestStatus
from servelm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from servelm.sampling_params import SamplingParams

TOKEN = 5  # what the fake sampler always picks


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    prompt = [(sum(map(ord, rid)) * 31 + i) % 1000 + 10 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens,
                   arrival_time=0.0)


class Sim:
    """A tiny engine: the scheduler's step protocol with a fake model and sampler."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int = 4096, enable_caching: bool = False,
                 admission_lookahead: int = 0, num_state_slots: int = 0,
                 num_state_snapshots: int = 0):
        self.bm = BlockManager(num_blocks, block_size, enable_caching=enable_caching,
                               num_state_slots=num_state_slots,
                               num_state_snapshots=num_state_snapshots)
        if max_num_seqs is None:  # the config requires a budget of a token per sequence
            max_num_seqs = min(256, max_num_batched_tokens)
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      admission_lookahead=admission_lookahead)
        self.sched = Scheduler(self.config, self.bm)
        self.now = 0.0

    def add(self, rid: str, prompt_len: int, max_tokens: int, prompt: list[int] | None = None,
            wait_for: Request | None = None) -> Request:
        """Queue a request; `prompt` overrides the made-up one, `wait_for` makes it a sibling
        sample of an earlier request (as the engine does for n > 1 with prefix caching)."""
        req = make_request(rid, prompt_len, max_tokens)
        if prompt is not None:
            req.prompt_token_ids = list(prompt)
        req.wait_for = wait_for
        self.sched.add_request(req)
        return req

    def schedule(self) -> SchedulerOutput:
        return self.sched.schedule()

    def finish_step(self, out: SchedulerOutput) -> None:
        """What the engine does after the forward pass."""
        self.sched.update_after_step(out)
        self.now += 1.0
        for s in out.scheduled:
            if s.samples:
                s.request.append_output_token(TOKEN, self.now)
                if s.request.num_output_tokens >= s.request.max_tokens:
                    self.sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.finish_step(out)
        return out

    def abort(self, req: Request) -> None:
        self.sched.finish_request(req, RequestStatus.FINISHED_ABORTED)

    def run_to_end(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            out = self.step()
            assert not out.is_empty, "no progress"
            steps += 1
            assert steps <= max_steps
        return steps


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled]


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# ---- unit tests -----------------------------------------------------------------------------

def test_scheduled_seq_records_start_and_samples():
    req = make_request("a", 6, 3)
    s = ScheduledSeq(req, 4)
    assert (s.start, s.samples) == (0, False)
    s = ScheduledSeq(req, 6)
    assert (s.start, s.samples) == (0, True)
    req.num_computed_tokens = 4
    s = ScheduledSeq(req, 2)
    assert (s.start, s.samples) == (4, True)
    out = SchedulerOutput([ScheduledSeq(req, 2), ScheduledSeq(make_request("b", 3, 1), 3)])
    assert out.num_tokens == 5 and not out.is_empty
    assert SchedulerOutput().is_empty


def test_whole_prompt_in_one_step_when_it_fits():
    sim = Sim(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    a = sim.add("a", 10, 3)
    assert a.status is RequestStatus.WAITING and sim.sched.num_waiting == 1
    out = sim.schedule()
    assert summary(out) == [("a", 0, 10, True)]
    assert out.preempted == []
    assert a.status is RequestStatus.RUNNING
    assert sim.sched.num_running == 1 and sim.sched.num_waiting == 0
    assert len(sim.bm.block_table("a")) == 3  # 10 tokens in blocks of 4
    sim.finish_step(out)
    assert a.num_computed_tokens == 10 and a.output_token_ids == [TOKEN]
    # Then one decode token per step, each sampling.
    out = sim.step()
    assert summary(out) == [("a", 10, 1, True)]
    assert a.num_computed_tokens == 11 and a.num_output_tokens == 2
    assert len(sim.bm.block_table("a")) == 3
    out = sim.step()
    assert summary(out) == [("a", 11, 1, True)]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [TOKEN] * 3
    assert sim.bm.num_free_blocks == 16 and sim.bm.owners() == {}
    assert not sim.sched.has_unfinished()
    assert sim.schedule().is_empty


def test_long_prompt_is_chunked_by_budget_and_samples_only_at_the_end():
    sim = Sim(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    a = sim.add("a", 10, 2)
    chunks = []
    tables = []
    for _ in range(3):
        out = sim.schedule()
        chunks += summary(out)
        tables.append(len(sim.bm.block_table("a")))
        assert out.num_tokens <= 4
        sim.finish_step(out)
        if not chunks[-1][3]:
            assert a.num_output_tokens == 0  # nothing sampled from a partial prompt
    assert chunks == [("a", 0, 4, False), ("a", 4, 4, False), ("a", 8, 2, True)]
    assert tables == [1, 2, 3]  # the table grows with the computed prefix, not all at once
    assert a.num_output_tokens == 1 and a.num_computed_tokens == 10
    out = sim.step()
    assert summary(out) == [("a", 10, 1, True)]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert sim.bm.num_free_blocks == 16


def test_prompt_of_exactly_the_budget_is_one_step():
    sim = Sim(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    sim.add("a", 8, 1)
    assert summary(sim.schedule()) == [("a", 0, 8, True)]


def test_running_decodes_come_before_new_admissions():
    sim = Sim(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    a = sim.add("a", 5, 10)
    b = sim.add("b", 3, 10)
    sim.step()
    c = sim.add("c", 6, 10)
    out = sim.schedule()
    assert summary(out) == [("a", 5, 1, True), ("b", 3, 1, True), ("c", 0, 6, True)]
    assert ids(sim.sched.running) == ["a", "b", "c"]
    sim.finish_step(out)
    assert [r.num_output_tokens for r in (a, b, c)] == [2, 2, 1]


def test_budget_left_after_decodes_chunks_the_new_prompt():
    sim = Sim(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    a = sim.add("a", 3, 10)
    assert summary(sim.step()) == [("a", 0, 3, True)]
    b = sim.add("b", 9, 10)
    assert summary(sim.step()) == [("a", 3, 1, True), ("b", 0, 3, False)]
    assert summary(sim.step()) == [("a", 4, 1, True), ("b", 3, 3, False)]
    assert summary(sim.step()) == [("a", 5, 1, True), ("b", 6, 3, True)]
    assert a.num_output_tokens == 4 and b.num_output_tokens == 1


def test_budget_exhausted_by_running_requests_leaves_the_rest_for_later():
    sim = Sim(num_blocks=32, block_size=4, max_num_batched_tokens=2)
    for rid in "abc":
        sim.add(rid, 1, 5)
    assert summary(sim.step()) == [("a", 0, 1, True), ("b", 0, 1, True)]
    # Budget 2: a and b decode; c is not admitted while they use all of it.
    assert summary(sim.step()) == [("a", 1, 1, True), ("b", 1, 1, True)]
    assert ids(sim.sched.waiting) == ["c"]


def test_max_num_seqs_respected():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    a = sim.add("a", 4, 2)
    b = sim.add("b", 4, 3)
    c = sim.add("c", 4, 2)
    out = sim.step()
    assert ids(s.request for s in out.scheduled) == ["a", "b"]
    assert c.status is RequestStatus.WAITING and sim.bm.block_table("c") == []
    out = sim.step()  # a finishes at the end of this step
    assert ids(s.request for s in out.scheduled) == ["a", "b"]
    assert a.status is RequestStatus.FINISHED_LENGTH
    out = sim.step()  # a's place goes to c
    assert summary(out) == [("b", 5, 1, True), ("c", 0, 4, True)]
    assert sim.sched.num_running <= 2
    sim.run_to_end()
    assert [r.num_output_tokens for r in (a, b, c)] == [2, 3, 2]


def test_admission_stops_when_blocks_run_out():
    sim = Sim(num_blocks=4, block_size=4, max_num_batched_tokens=100)
    a = sim.add("a", 8, 1)   # 2 blocks
    b = sim.add("b", 5, 1)   # 2 blocks
    c = sim.add("c", 1, 1)   # 1 block: none left
    out = sim.schedule()
    assert ids(s.request for s in out.scheduled) == ["a", "b"]
    assert c.status is RequestStatus.WAITING
    assert sim.bm.num_free_blocks == 0 and sim.bm.block_table("c") == []
    sim.finish_step(out)  # a and b finish (max_tokens=1) and free their blocks
    assert sim.bm.num_free_blocks == 4
    assert summary(sim.step()) == [("c", 0, 1, True)]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, c))


@pytest.mark.parametrize("lookahead, admitted", [(0, ["a", "b", "c"]), (8, ["a", "b"])])
def test_admission_keeps_the_blocks_running_requests_will_grow_into(lookahead, admitted):
    sim = Sim(num_blocks=8, block_size=4, max_num_batched_tokens=100,
              admission_lookahead=lookahead)
    sim.add("a", 4, 10)  # 1 block now; 8 more tokens take 2 more
    sim.step()
    b = sim.add("b", 4, 10)  # 1 block, and 2 kept for its growth
    c = sim.add("c", 4, 10)
    out = sim.schedule()
    running = ids(sim.sched.running)
    assert running == admitted
    if lookahead:
        # 8 blocks: a holds 2 (its decode token opened a second) and keeps 2 for its next
        # 8 tokens; b takes 1 and keeps 2; admitting c (1 + 2) would leave 2 free where
        # a and b will need 4: c would soon force a preemption, so it waits.
        assert c.status is RequestStatus.WAITING
        assert sim.bm.num_free_blocks == 5
    sim.finish_step(out)
    sim.run_to_end()
    assert b.num_output_tokens == c.num_output_tokens == 10


def test_lookahead_stops_at_max_tokens_and_never_blocks_an_idle_engine():
    # A pool that holds one 8-token request: with nothing running, admission ignores the
    # lookahead (it would otherwise wait forever); a max_tokens=1 request reserves nothing
    # beyond its prompt.
    sim = Sim(num_blocks=2, block_size=4, max_num_batched_tokens=100, admission_lookahead=64)
    a = sim.add("a", 7, 1)
    b = sim.add("b", 1, 1)
    out = sim.schedule()
    assert ids(s.request for s in out.scheduled) == ["a"]  # b would take a's last block
    sim.finish_step(out)
    sim.run_to_end()
    assert a.num_output_tokens == b.num_output_tokens == 1
    sim2 = Sim(num_blocks=3, block_size=4, max_num_batched_tokens=100, admission_lookahead=64)
    sim2.add("a", 4, 1)  # 1 block; its one output token needs no second block
    sim2.add("b", 8, 1)  # 2 blocks
    assert ids(s.request for s in sim2.schedule().scheduled) == ["a", "b"]


def test_admission_waits_while_the_running_request_grows_into_the_free_blocks():
    # 6 blocks of 4. a (prompt 4, 14 outputs) grows to 5 blocks over the next 13 steps;
    # b (prompt 4, 17 outputs) would take 1 block and grow too: with a's growth and b's
    # there are not enough blocks for both inside the window, so b waits for a.
    sim = Sim(num_blocks=6, block_size=4, max_num_batched_tokens=100, admission_lookahead=16)
    a = sim.add("a", 4, 14)
    sim.step()
    b = sim.add("b", 4, 17)
    out = sim.schedule()
    assert ids(s.request for s in out.scheduled) == ["a"] and b.status is RequestStatus.WAITING
    sim.finish_step(out)
    sim.run_to_end()
    assert (a.num_output_tokens, b.num_output_tokens) == (14, 17)
    assert sim.sched.num_preemptions == 0


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_whole_horizon_lookahead_never_preempts_requests_that_run_to_max_tokens(data):
    # Prompts fit the budget (no chunking) and every request runs to max_tokens, as the
    # lookahead assumes: then admission never lets the pool run short, whatever arrives when.
    bs = data.draw(st.sampled_from([2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(3, 40), label="num_blocks")
    sim = Sim(num_blocks=num_blocks, block_size=bs, max_num_batched_tokens=4096,
              admission_lookahead=10_000)
    cap = num_blocks * bs
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 20), st.integers(1, cap),
                                            st.integers(1, 30)), min_size=1, max_size=12))
    reqs, step = [], 0
    pending = sorted(arrivals)
    while pending or sim.sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, plen, mt = pending.pop(0)
            mt = max(1, min(mt, cap - plen + 1))  # prompt + max_tokens - 1 fits the pool
            reqs.append(sim.add(f"r{len(reqs)}", plen, mt))
        sim.step()
        step += 1
        assert step < 2000
    assert sim.sched.num_preemptions == 0
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)


def test_admission_is_in_arrival_order():
    # b does not fit the free blocks, so c (which would) is not admitted ahead of it.
    sim = Sim(num_blocks=4, block_size=4, max_num_batched_tokens=100)
    a = sim.add("a", 8, 3)    # 2 blocks
    b = sim.add("b", 12, 1)   # 3 blocks
    c = sim.add("c", 2, 1)    # 1 block
    out = sim.schedule()
    assert ids(s.request for s in out.scheduled) == ["a"]
    assert ids(sim.sched.waiting) == ["b", "c"]
    sim.finish_step(out)
    sim.run_to_end()
    assert [r.num_output_tokens for r in (a, b, c)] == [3, 1, 1]


def test_preempts_most_recent_request_and_recomputes_it_later():
    # 4 blocks of 2 tokens. a needs up to 3 + 4 = 7 tokens (4 blocks); b 2 blocks at first.
    sim = Sim(num_blocks=4, block_size=2, max_num_batched_tokens=100)
    a = sim.add("a", 3, 5)
    b = sim.add("b", 3, 3)
    assert summary(sim.step()) == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert sim.bm.num_free_blocks == 0
    assert summary(sim.step()) == [("a", 3, 1, True), ("b", 3, 1, True)]
    # a's next token needs a third block: b, admitted last, gives up its two.
    out = sim.schedule()
    assert summary(out) == [("a", 4, 1, True)]
    assert out.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sim.sched.num_preemptions == 1
    assert ids(sim.sched.waiting) == ["b"] and ids(sim.sched.running) == ["a"]
    assert sim.bm.block_table("b") == []
    assert len(sim.bm.block_table("a")) == 3 and sim.bm.num_free_blocks == 1
    assert b.output_token_ids == [TOKEN, TOKEN]  # its outputs so far are kept
    sim.finish_step(out)
    # b (5 tokens: 3 blocks) does not fit in the one free block while a runs.
    out = sim.step()
    assert summary(out) == [("a", 5, 1, True)] and out.preempted == []
    out = sim.step()
    assert summary(out) == [("a", 6, 1, True)]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 5
    # b is readmitted and recomputes its prompt and both outputs in one go, then samples.
    out = sim.step()
    assert summary(out) == [("b", 0, 5, True)]
    assert b.status is RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [TOKEN] * 3  # exactly max_tokens, none lost or doubled
    assert sim.bm.num_free_blocks == 4 and sim.bm.owners() == {}
    assert not sim.sched.has_unfinished()


def test_preemption_takes_the_last_admitted_not_an_earlier_one():
    sim = Sim(num_blocks=6, block_size=2, max_num_batched_tokens=100)
    a, b, c = (sim.add(rid, 4, 4) for rid in "abc")
    sim.step()  # 2 blocks each: the pool is full
    assert sim.bm.num_free_blocks == 0
    out = sim.schedule()
    # a takes one of c's freed blocks, b the other.
    assert out.preempted == [c]
    assert summary(out) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert c.status is RequestStatus.PREEMPTED and b.status is RequestStatus.RUNNING
    assert ids(sim.sched.running) == ["a", "b"]
    sim.finish_step(out)
    sim.run_to_end()
    assert [r.num_output_tokens for r in (a, b, c)] == [4, 4, 4]
    assert c.num_preemptions >= 1 and a.num_preemptions == 0
    assert sim.bm.num_free_blocks == 6


def test_request_that_is_last_preempts_itself():
    sim = Sim(num_blocks=4, block_size=2, max_num_batched_tokens=100)
    a = sim.add("a", 3, 3)  # 4 tokens after a sample: still 2 blocks
    b = sim.add("b", 4, 3)  # 5 tokens after a sample: needs a third block
    sim.step()
    out = sim.schedule()
    assert summary(out) == [("a", 3, 1, True)]
    assert out.preempted == [b]
    assert ids(sim.sched.waiting) == ["b"]
    sim.finish_step(out)
    sim.run_to_end()
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3
    assert b.num_preemptions == 1


def test_no_admission_in_a_step_that_preempted():
    sim = Sim(num_blocks=6, block_size=2, max_num_batched_tokens=100)
    a = sim.add("a", 4, 4)   # 2 blocks, a third for its next token
    b = sim.add("b", 3, 4)   # 2 blocks, enough for its next token
    c = sim.add("c", 4, 4)   # 2 blocks: the pool is full
    sim.step()
    d = sim.add("d", 1, 1)  # would fit in the block left over after the preemption
    out = sim.schedule()
    assert out.preempted == [c]
    assert ids(s.request for s in out.scheduled) == ["a", "b"]
    assert sim.bm.num_free_blocks == 1
    assert ids(sim.sched.waiting) == ["c", "d"]  # the preempted one goes to the front
    assert d.status is RequestStatus.WAITING
    sim.finish_step(out)
    sim.run_to_end()
    assert [r.num_output_tokens for r in (a, b, c, d)] == [4, 4, 4, 1]


def test_several_preemptions_in_one_step_keep_admission_order_in_the_queue():
    # Blocks of one token: the pool holds exactly the four prompts.
    sim = Sim(num_blocks=6, block_size=1, max_num_batched_tokens=100)
    a = sim.add("a", 2, 3)
    b = sim.add("b", 2, 3)
    c = sim.add("c", 1, 3)
    d = sim.add("d", 1, 3)
    sim.step()
    assert sim.bm.num_free_blocks == 0
    # a's decode preempts d; then b's preempts c. c goes back in front of d.
    out = sim.schedule()
    assert out.preempted == [d, c]
    assert summary(out) == [("a", 2, 1, True), ("b", 2, 1, True)]
    assert ids(sim.sched.waiting) == ["c", "d"]
    assert sim.sched.num_preemptions == 2
    sim.finish_step(out)
    sim.run_to_end()
    assert [r.num_output_tokens for r in (a, b, c, d)] == [3, 3, 3, 3]
    assert sim.bm.num_free_blocks == 6


def test_abort_running_request_frees_blocks_at_once():
    sim = Sim(num_blocks=4, block_size=4, max_num_batched_tokens=100)
    a = sim.add("a", 12, 5)  # 3 blocks
    b = sim.add("b", 8, 5)   # 2 blocks: does not fit
    sim.step()
    assert sim.bm.num_free_blocks == 1 and b.status is RequestStatus.WAITING
    sim.abort(a)
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert a.finish_reason is not None and a.finish_reason.value == "abort"
    assert sim.bm.num_free_blocks == 4 and sim.bm.block_table("a") == []
    assert ids(sim.sched.running) == []
    # The freed blocks go to b on the very next step; a is never scheduled again.
    out = sim.step()
    assert summary(out) == [("b", 0, 8, True)]
    sim.run_to_end()
    assert a.num_output_tokens == 1 and b.num_output_tokens == 5


def test_abort_mid_prefill_frees_its_partial_table():
    sim = Sim(num_blocks=8, block_size=2, max_num_batched_tokens=4)
    a = sim.add("a", 11, 2)
    sim.step()
    sim.step()
    assert a.num_computed_tokens == 8 and len(sim.bm.block_table("a")) == 4
    sim.abort(a)
    assert sim.bm.num_free_blocks == 8
    assert not sim.sched.has_unfinished()
    assert sim.schedule().is_empty
    assert a.num_output_tokens == 0


def test_abort_waiting_request():
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=100)
    a = sim.add("a", 4, 2)
    b = sim.add("b", 4, 2)
    c = sim.add("c", 4, 2)
    sim.step()
    free = sim.bm.num_free_blocks
    sim.abort(b)
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert ids(sim.sched.waiting) == ["c"]
    assert sim.bm.num_free_blocks == free
    sim.run_to_end()
    assert b.num_output_tokens == 0 and b.num_computed_tokens == 0
    assert a.num_output_tokens == 2 and c.num_output_tokens == 2
    assert sim.bm.num_free_blocks == 8


def test_abort_preempted_request_in_queue():
    sim = Sim(num_blocks=4, block_size=2, max_num_batched_tokens=100)
    a = sim.add("a", 3, 5)
    b = sim.add("b", 3, 3)
    sim.step()
    sim.step()
    out = sim.schedule()
    assert out.preempted == [b]
    sim.finish_step(out)
    sim.abort(b)
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert ids(sim.sched.waiting) == []
    sim.run_to_end()
    assert a.num_output_tokens == 5 and b.num_output_tokens == 2
    assert sim.bm.num_free_blocks == 4


def test_finish_request_twice_is_harmless():
    sim = Sim(num_blocks=4, block_size=4)
    a = sim.add("a", 4, 1)
    b = sim.add("b", 4, 3)
    sim.step()
    assert a.status is RequestStatus.FINISHED_LENGTH
    sim.abort(a)  # already finished: nothing else changes
    assert ids(sim.sched.running) == ["b"]
    assert sim.bm.block_table("b") != []
    assert sim.bm.num_free_blocks == 3


def test_finish_stopped_frees_blocks_at_once():
    sim = Sim(num_blocks=4, block_size=4)
    a = sim.add("a", 6, 10)
    sim.step()
    sim.sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert sim.bm.num_free_blocks == 4
    assert not sim.sched.has_unfinished()
    assert a.finish_reason.value == "stop"


# ---- prefix caching -------------------------------------------------------------------------

PROMPT = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]  # 2 full blocks of 4 + 2 tokens


def test_caching_off_by_default_no_hits_for_the_same_prompt():
    sim = Sim(num_blocks=16, block_size=4)
    a = sim.add("a", 0, 1, prompt=PROMPT)
    sim.step()
    b = sim.add("b", 0, 1, prompt=PROMPT)
    assert summary(sim.step()) == [("b", 0, 10, True)]
    assert a.num_cached_tokens == b.num_cached_tokens == 0


def test_sibling_waits_for_the_first_prompt_then_shares_its_blocks():
    sim = Sim(num_blocks=16, block_size=4, enable_caching=True)
    a = sim.add("a", 0, 3, prompt=PROMPT)
    b = sim.add("b", 0, 3, prompt=PROMPT, wait_for=a)
    out = sim.step()
    assert summary(out) == [("a", 0, 10, True)]
    assert b.status is RequestStatus.WAITING and sim.bm.block_table("b") == []
    out = sim.schedule()
    # b starts after a's two full prompt blocks: only the last two prompt tokens are computed.
    assert summary(out) == [("a", 10, 1, True), ("b", 8, 2, True)]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert b.wait_for is None
    ta, tb = sim.bm.block_table("a"), sim.bm.block_table("b")
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [sim.bm.ref_count(x) for x in ta] == [2, 2, 1]
    assert sim.bm.num_free_blocks == 16 - 4
    sim.finish_step(out)
    sim.run_to_end()
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 3
    assert sim.bm.num_free_blocks == 16 and sim.bm.owners() == {}
    assert sim.bm.hit_rate == pytest.approx(8 / 20)


def test_sibling_waits_through_a_chunked_prompt():
    sim = Sim(num_blocks=16, block_size=4, max_num_batched_tokens=4, enable_caching=True)
    a = sim.add("a", 0, 2, prompt=PROMPT)
    b = sim.add("b", 0, 2, prompt=PROMPT, wait_for=a)
    c = sim.add("c", 0, 2, prompt=PROMPT, wait_for=a)
    assert summary(sim.step()) == [("a", 0, 4, False)]
    assert summary(sim.step()) == [("a", 4, 4, False)]
    assert summary(sim.step()) == [("a", 8, 2, True)]  # budget left, but b must wait
    assert b.status is RequestStatus.WAITING and c.status is RequestStatus.WAITING
    assert summary(sim.step()) == [("a", 10, 1, True), ("b", 8, 2, True), ("c", 8, 1, False)]
    assert b.num_cached_tokens == c.num_cached_tokens == 8
    assert summary(sim.step()) == [("b", 10, 1, True), ("c", 9, 1, True)]
    sim.run_to_end()
    assert [r.num_output_tokens for r in (a, b, c)] == [2, 2, 2]
    assert sim.bm.num_free_blocks == 16


def test_aborting_the_first_sample_releases_its_sibling_and_keeps_its_work():
    sim = Sim(num_blocks=16, block_size=4, max_num_batched_tokens=4, enable_caching=True)
    a = sim.add("a", 0, 2, prompt=PROMPT)
    b = sim.add("b", 0, 2, prompt=PROMPT, wait_for=a)
    sim.step()  # a computed its first block
    sim.abort(a)
    assert sim.bm.num_free_blocks == 16
    # b no longer waits, and a's full block is a hit even though a is gone.
    assert summary(sim.step()) == [("b", 4, 4, False)]
    assert b.num_cached_tokens == 4
    sim.run_to_end()
    assert b.num_output_tokens == 2


def test_later_request_hits_the_blocks_of_a_finished_one():
    sim = Sim(num_blocks=16, block_size=4, enable_caching=True)
    a = sim.add("a", 0, 1, prompt=PROMPT)
    sim.step()
    assert a.is_finished and sim.bm.num_free_blocks == 16
    b = sim.add("b", 0, 2, prompt=PROMPT + [7, 7, 7])
    assert summary(sim.step()) == [("b", 8, 5, True)]
    assert b.num_cached_tokens == 8
    # Exactly whole blocks: the last one is recomputed, so there is a token to sample from.
    c = sim.add("c", 0, 1, prompt=PROMPT[:8])
    d = sim.add("d", 0, 1, prompt=PROMPT[:4])
    assert summary(sim.step()) == [("b", 13, 1, True), ("c", 4, 4, True), ("d", 0, 4, True)]
    assert c.num_cached_tokens == 4 and d.num_cached_tokens == 0
    # A different first block: no hit, even for the same later tokens.
    e = sim.add("e", 0, 1, prompt=[9, 9, 9, 9] + PROMPT[4:])
    assert summary(sim.step()) == [("e", 0, 10, True)]
    assert e.num_cached_tokens == 0
    assert sim.bm.num_free_blocks == 16


def test_preempted_request_resumes_from_what_is_left_of_its_cached_blocks():
    sim = Sim(num_blocks=5, block_size=2, max_num_batched_tokens=100, enable_caching=True)
    a = sim.add("a", 0, 4, prompt=[1, 2, 3, 4])
    b = sim.add("b", 0, 2, prompt=[6, 7, 8, 9])
    assert summary(sim.step()) == [("a", 0, 4, True), ("b", 0, 4, True)]
    # a needs a third block: the one free block. b needs one too and preempts itself; its
    # two full blocks stay cached.
    out = sim.step()
    assert summary(out) == [("a", 4, 1, True)] and out.preempted == [b]
    b0, b1 = sim.bm.find_cached_prefix(b.token_slice(0, b.num_tokens))
    # b would fit from its cached blocks (2 of them free, 1 new) only with 3 free: it waits.
    assert summary(sim.step()) == [("a", 5, 1, True)]
    # a's fourth block evicts b's tail block (least recently freed, tail first), not its head.
    assert summary(sim.step()) == [("a", 6, 1, True)]
    assert a.is_finished
    assert sim.bm.find_cached_prefix(b.token_slice(0, b.num_tokens)) == [b0]
    # b is recomputed from its cached first block, outputs included.
    assert summary(sim.step()) == [("b", 2, 3, True)]
    assert b.num_cached_tokens == 0  # what it found at its first admission
    assert b.is_finished and b.output_token_ids == [TOKEN, TOKEN]
    assert sim.bm.num_free_blocks == 5


def test_preempted_request_resumes_after_its_cached_outputs():
    sim = Sim(num_blocks=5, block_size=2, max_num_batched_tokens=100, enable_caching=True)
    a = sim.add("a", 0, 3, prompt=[1, 2, 3, 4])
    b = sim.add("b", 0, 3, prompt=[6, 7, 8])
    assert summary(sim.step()) == [("a", 0, 4, True), ("b", 0, 3, True)]
    assert summary(sim.step()) == [("a", 4, 1, True), ("b", 3, 1, True)]
    # b's second block [8, TOKEN] is full: registered, with an output token in it.
    out = sim.step()
    assert summary(out) == [("a", 5, 1, True)] and out.preempted == [b]
    assert a.is_finished
    # Both of b's blocks survived; the lookup covers its outputs, not just its prompt.
    assert summary(sim.step()) == [("b", 4, 1, True)]
    assert b.output_token_ids == [TOKEN] * 3
    assert sim.bm.hit_rate == pytest.approx(4 / (4 + 3 + 5))


def test_sibling_shares_blocks_a_second_copy_would_not_fit_in():
    sim = Sim(num_blocks=4, block_size=4, enable_caching=True)
    a = sim.add("a", 0, 2, prompt=PROMPT)   # 3 blocks
    b = sim.add("b", 0, 2, prompt=PROMPT, wait_for=a)
    sim.step()
    assert sim.bm.num_free_blocks == 1
    # b needs only one block of its own: its first two are a's.
    out = sim.schedule()
    assert summary(out) == [("a", 10, 1, True), ("b", 8, 2, True)]
    assert sim.bm.num_free_blocks == 0
    sim.finish_step(out)
    sim.run_to_end()
    assert a.num_output_tokens == b.num_output_tokens == 2


def test_block_filled_by_a_decode_step_is_registered_at_once():
    sim = Sim(num_blocks=8, block_size=4, enable_caching=True)
    a = sim.add("a", 0, 4, prompt=[1, 2, 3])
    sim.step()
    assert sim.bm.find_cached_prefix([1, 2, 3, TOKEN, 0]) == []
    sim.step()  # position 3 (the first output) fills block 0
    assert a.num_computed_tokens == 4
    assert sim.bm.find_cached_prefix([1, 2, 3, TOKEN, 0]) == sim.bm.block_table("a")[:1]
    c = sim.add("c", 0, 1, prompt=[1, 2, 3, TOKEN, 9])
    assert summary(sim.step()) == [("a", 4, 1, True), ("c", 4, 1, True)]
    assert c.num_cached_tokens == 4


# ---- property test --------------------------------------------------------------------------

# With prefix caching, prompts start with one of a few shared prefixes and go on with tokens
# from a tiny alphabet, so whole blocks repeat across requests.
SHARED_PREFIXES = [
    [],
    [10, 11, 12, 13, 14, 15, 16, 17],
    [10, 11, 12, 13, 20, 21, 22, 23, 24, 25],
    [30, 30, 30, 30, 30, 30],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]
cached_prompts = st.builds(lambda p, t: (p + t) or [1], st.sampled_from(SHARED_PREFIXES),
                           st.lists(st.sampled_from([1, 2, 3]), max_size=8))


@st.composite
def scenarios(draw, caching: bool = False):
    """Requests (rid, prompt_len, max_tokens, arrival, abort_after, prompt, first); with
    caching, also prompts from shared prefixes and sibling samples that wait for `first`."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 8 if not caching else 5))
    reqs = []
    for i in range(n):
        prompt_len = draw(st.integers(1, 24))
        max_tokens = draw(st.integers(1, 8))
        arrival = draw(st.integers(0, 12))
        # None: never aborted; else aborted this many steps after arriving.
        abort_after = draw(st.one_of(st.none(), st.none(), st.integers(0, 15)))
        if not caching:
            reqs.append((f"r{i}", prompt_len, max_tokens, arrival, abort_after, None, None))
            continue
        prompt = draw(cached_prompts)
        reqs.append((f"r{i}", len(prompt), max_tokens, arrival, abort_after, prompt, None))
        # n > 1: sibling samples arrive with it and wait for its prompt.
        for j in range(draw(st.sampled_from([0, 0, 1, 2]))):
            abort = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 15)))
            reqs.append((f"r{i}s{j}", len(prompt), max_tokens, arrival, abort, prompt, f"r{i}"))
    # Big enough for any one request alone: its prompt and all outputs but the last, which is
    # sampled and never computed.
    largest = max(-(-(spec[1] + spec[2] - 1) // block_size) for spec in reqs)
    num_blocks = largest + draw(st.sampled_from([0, 0, 1, 1, 2, 3, 5, 10]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 32))
    return block_size, num_blocks, max_num_seqs, budget, reqs


def check_blocks(sim: Sim) -> None:
    bm = sim.bm
    owners = bm.owners()
    running = {r.request_id for r in sim.sched.running}
    assert set(owners) <= running, "a non-running request owns blocks"
    for table in owners.values():
        assert len(table) == len(set(table)), "a block twice in one table"
    owned = [b for table in owners.values() for b in table]
    if not bm.enable_caching:
        assert len(owned) == len(set(owned)), "a block is owned twice"
    assert all(0 <= b < bm.num_blocks for b in owned)
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == owned.count(b), f"block {b}'s ref count"
    assert len(set(owned)) + bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_blocks == sum(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


@pytest.mark.parametrize("caching", [False, True])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_workloads_keep_invariants_and_finish(caching, data):
    scenario = data.draw(scenarios(caching), label="scenario")
    block_size, num_blocks, max_num_seqs, budget, specs = scenario
    lookahead = data.draw(st.sampled_from([0, 1, 8, 64]), label="admission_lookahead")
    sim = Sim(num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
              enable_caching=caching, admission_lookahead=lookahead)
    sched, bm = sim.sched, sim.bm
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    admitted_once: set[str] = set()
    firsts = {spec[0]: spec[6] for spec in specs}
    prompts = {spec[0]: spec[5] for spec in specs}
    # The fake KV cache: slot (block, offset) -> (request, every token up to that position):
    # what a real KV entry depends on. With caching a slot may be read by any request with
    # the same tokens so far, so the writer is not recorded.
    kv: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}
    queried = hit = 0  # expected prefix cache statistics
    sibling_hits = 0

    def slot(req: Request, pos: int) -> tuple[int, int]:
        table = bm.block_table(req.request_id)
        return table[pos // block_size], pos % block_size

    def entry(rid: str, tokens: list[int], pos: int) -> tuple[str | None, tuple[int, ...]]:
        return (None if caching else rid), tuple(tokens[:pos + 1])

    def unique_first_block(rid: str) -> bool:
        """No request outside rid's group can build rid's first prompt block (so all of its
        cached blocks are the group's own)."""
        mine = prompts[rid][:block_size]
        return all(prompts[o][:block_size] != mine[:len(prompts[o][:block_size])]
                   for o in prompts if o != rid and firsts[o] != rid)

    chunked = False
    step = 0
    max_steps = 2000
    while step < max_steps:
        for rid, p, m, arrival, _, prompt, first in specs:
            if arrival == step:
                reqs[rid] = sim.add(rid, p, m, prompt=prompt,
                                    wait_for=reqs[first] if first is not None else None)
        for rid, _, _, arrival, abort_after, _, _ in specs:
            if abort_after is not None and arrival + abort_after == step:
                req = reqs[rid]
                if not req.is_finished:
                    sim.abort(req)
                    aborted.add(rid)
                    assert req.status is RequestStatus.FINISHED_ABORTED
                    assert bm.block_table(rid) == []
                    assert req not in sched.running and req not in sched.waiting
                    check_blocks(sim)
        all_arrived = len(reqs) == len(specs)
        if not sched.has_unfinished():
            if all_arrived:
                break
            assert sched.schedule().is_empty
            step += 1
            continue

        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        out = sched.schedule()

        # Progress: with a pool big enough for any single request, something always runs.
        assert not out.is_empty, f"stalled at step {step}"
        # Limits.
        assert out.num_tokens <= budget
        assert len(out.scheduled) <= max_num_seqs
        assert sched.num_running <= max_num_seqs
        scheduled_reqs = [s.request for s in out.scheduled]
        assert len({id(r) for r in scheduled_reqs}) == len(scheduled_reqs)
        # Running requests come first, in admission order; then admissions in queue order.
        carried = [r for r in scheduled_reqs if any(r is x for x in running_before)]
        admitted = scheduled_reqs[len(carried):]
        assert scheduled_reqs[:len(carried)] == carried
        assert carried == [r for r in running_before if any(r is x for x in carried)]
        assert admitted == waiting_before[:len(admitted)]
        chunked = chunked or any(not s.samples for s in out.scheduled)
        if out.preempted:
            assert admitted == []
        for victim in out.preempted:
            assert victim.status is RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0
            assert bm.block_table(victim.request_id) == []
            assert victim in sched.waiting and victim not in sched.running
            assert all(victim is not r for r in scheduled_reqs)
            assert any(victim is x for x in running_before)
        survivors = [r for r in running_before if all(r is not v for v in out.preempted)]
        assert survivors == [r for r in sched.running if any(r is x for x in running_before)]
        # Only the most recently admitted are preempted: the survivors are a prefix.
        assert running_before[:len(survivors)] == survivors, "preempted a non-latest request"
        for s in out.scheduled:
            req = s.request
            assert req.status is RequestStatus.RUNNING and req in sched.running
            assert s.num_new_tokens >= 1
            assert s.start == req.num_computed_tokens
            assert s.start + s.num_new_tokens <= req.num_tokens
            assert s.samples == (s.start + s.num_new_tokens == req.num_tokens)
            assert len(bm.block_table(req.request_id)) == bm.num_blocks_for(
                s.start + s.num_new_tokens)
        for s in out.scheduled[len(carried):]:
            # Admission starts after whole cached blocks, leaving at least one token.
            req, rid = s.request, s.request.request_id
            assert s.start % block_size == 0 and s.start < req.num_tokens
            if not caching:
                assert s.start == 0
            queried += req.num_tokens
            hit += s.start
            if req.num_output_tokens == 0:
                assert req.num_cached_tokens == s.start
            first = reqs.get(firsts[rid]) if firsts[rid] is not None else None
            if first is not None and rid not in admitted_once:
                # A sibling is only admitted once the first sample's prompt is computed.
                assert first.is_finished or (
                    first.status is RequestStatus.RUNNING
                    and first.num_computed_tokens >= first.num_prompt_tokens)
                # While the first sample runs, it holds its prompt's blocks: all of their
                # whole blocks but the one with the last token are hits.
                if first.status is RequestStatus.RUNNING and unique_first_block(first.request_id):
                    assert s.start == (req.num_prompt_tokens - 1) // block_size * block_size
                sibling_hits += s.start > 0
            admitted_once.add(rid)
        assert (bm.num_queried_tokens, bm.num_hit_tokens) == (queried, hit)
        check_blocks(sim)

        # The fake forward pass: what the request cached before (or found in the prefix cache)
        # must be there, intact; then this step's tokens are written into its own blocks.
        for s in out.scheduled:
            req, rid = s.request, s.request.request_id
            tokens = req.token_slice(0, s.start + s.num_new_tokens)
            for pos in range(s.start):
                assert kv.get(slot(req, pos)) == entry(rid, tokens, pos), "KV cache clobbered"
            for pos in range(s.start, s.start + s.num_new_tokens):
                assert bm.ref_count(slot(req, pos)[0]) == 1, "writing into a shared block"
                kv[slot(req, pos)] = entry(rid, tokens, pos)

        outputs_before = {rid: r.num_output_tokens for rid, r in reqs.items()}
        sim.finish_step(out)
        sampled = {s.request.request_id for s in out.scheduled if s.samples}
        for rid, r in reqs.items():
            assert r.num_output_tokens == outputs_before[rid] + (rid in sampled)
            assert r.num_computed_tokens <= r.num_tokens
            assert r.num_output_tokens <= r.max_tokens
            if r.status is RequestStatus.RUNNING:
                # Between steps a running request holds exactly the blocks for what it computed.
                assert len(bm.block_table(rid)) == bm.num_blocks_for(r.num_computed_tokens)
                assert r.num_tokens - r.num_computed_tokens >= 1
            elif r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                assert bm.block_table(rid) == []
                assert r in sched.waiting
            else:
                assert r.is_finished and bm.block_table(rid) == []
        check_blocks(sim)
        step += 1

    assert step < max_steps, "did not finish"
    event(f"preemptions: {min(sched.num_preemptions, 3)}{'+' if sched.num_preemptions >= 3 else ''}")
    event(f"aborted: {bool(aborted)}")
    event(f"chunked prefill: {chunked}")
    if caching:
        event(f"prefix cache hits: {hit > 0}; sibling hits: {sibling_hits > 0}")
    assert len(reqs) == len(specs)
    assert not sched.has_unfinished()
    assert sched.schedule().is_empty
    for rid, req in reqs.items():
        assert req.is_finished
        if rid in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            assert req.num_output_tokens < req.max_tokens
        else:
            assert req.status is RequestStatus.FINISHED_LENGTH
            assert req.output_token_ids == [TOKEN] * req.max_tokens
    assert bm.num_free_blocks == num_blocks
    assert bm.owners() == {}
    assert all(bm.ref_count(b) == 0 for b in range(num_blocks))
    assert sim.sched.num_running == 0 and sim.sched.num_waiting == 0


def test_config_needs_a_budget_token_per_running_sequence():
    import pytest

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8)


def test_config_rejects_a_negative_admission_lookahead():
    import pytest

    with pytest.raises(ValueError, match="admission_lookahead must be >= 0, got -1"):
        SchedulerConfig(admission_lookahead=-1)
    assert SchedulerConfig(admission_lookahead=0).admission_lookahead == 0


# ---- recurrent-state slots (linear-attention layers) ----------------------------------------

def test_admission_waits_for_a_free_state_slot():
    """Two slots, plenty of blocks: a third request waits until one of the first two
    finishes, then takes the freed slot; every slot is free at the end."""
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=100, num_state_slots=2)
    a, b, c = sim.add("a", 3, 2), sim.add("b", 3, 4), sim.add("c", 3, 1)
    out = sim.step()
    assert ids(s.request for s in out.scheduled) == ["a", "b"]
    assert c.status is RequestStatus.WAITING and sim.bm.num_free_slots == 0
    assert {sim.bm.state_slot("a"), sim.bm.state_slot("b")} == {0, 1}
    out = sim.step()  # a finishes: its slot is free for c next step
    assert a.status is RequestStatus.FINISHED_LENGTH and sim.bm.num_free_slots == 1
    out = sim.step()
    assert "c" in ids(s.request for s in out.scheduled)
    sim.run_to_end()
    assert sim.bm.num_free_slots == 2 and sim.bm.owners() == {}


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_loads_with_few_state_slots_finish_and_leak_no_slot(data):
    """Random prompts and lengths over a small pool (preemptions) with fewer slots than
    requests: every request finishes with exactly max_tokens outputs, running requests
    always hold distinct slots, and all slots are free at the end."""
    slots = data.draw(st.integers(1, 3))
    sim = Sim(num_blocks=data.draw(st.integers(6, 12)), block_size=2,
              max_num_batched_tokens=data.draw(st.sampled_from([4, 8, 100])),
              num_state_slots=slots)
    reqs = [sim.add(f"r{i}", data.draw(st.integers(1, 6)), data.draw(st.integers(1, 4)))
            for i in range(data.draw(st.integers(1, 6)))]
    steps = 0
    while sim.sched.has_unfinished():
        out = sim.step()
        held = [sim.bm.state_slot(r.request_id) for r in sim.sched.running]
        assert -1 not in held and len(set(held)) == len(held) <= slots
        steps += 1
        assert steps < 500
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert sim.bm.num_free_slots == slots and sim.bm.owners() == {}


def test_a_recurrent_prompt_keeps_its_state_at_its_last_block_and_a_longer_one_starts_there():
    """With state snapshots: a 37-token prompt's step keeps its state 32 tokens in (its last
    block boundary), in the snapshot the block manager reserved, which joins block 1 when
    the step registers it; its decodes keep a trailing one at each later boundary. A later
    prompt extending it is admitted on its 2 cached blocks with the state restored, and
    keeps its own at 64."""
    sim = Sim(32, 16, enable_caching=True, num_state_slots=2, num_state_snapshots=2)
    a = sim.add("a", 37, 20)
    out = sim.schedule()
    assert [(s.num_new_tokens, s.snapshot) for s in out.scheduled] == [(37, (32, 0))]
    assert out.scheduled[0].samples
    sim.finish_step(out)
    assert sim.bm.num_snapshots == 1
    kept = []
    for _ in range(12):  # decodes, through the boundary at 48: a's trailing snapshot there
        out = sim.schedule()
        kept.append(out.scheduled[0].snapshot)
        sim.finish_step(out)
    assert kept == [None] * 10 + [(1, 1), None]
    assert a.num_computed_tokens == 49 and sim.bm.num_snapshots == 2
    b = sim.add("b", 0, 4, prompt=a.prompt_token_ids + [1] * 30)
    out = sim.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.snapshot)
            for s in out.scheduled] == [("a", 49, 1, None), ("b", 32, 35, (32, 1))]
    assert sim.bm.take_restores() == [(0, sim.bm.state_slot("b"))]
    # b's prompt snapshot took the least recently used one: a's trailing one (b's restore
    # had just used a's prompt's).
    assert b.num_cached_tokens == 32
    sim.finish_step(out)
    assert sim.bm.num_snapshots == 2 and not sim.bm._trailing
