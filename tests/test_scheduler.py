"""Scheduler tests: a simulated engine loop (no model) drives Scheduler + BlockManager.

"Sampling" appends a fixed token; a request finishes after max_tokens outputs, exactly as the
engine's step() does: schedule, update_after_step, append a token to every ScheduledSeq with
samples=True, finish_request when done.
"""

from __future__ import annotations

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

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096):
        self.bm = BlockManager(num_blocks, block_size)
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens)
        self.sched = Scheduler(self.config, self.bm)
        self.now = 0.0

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> Request:
        req = make_request(rid, prompt_len, max_tokens)
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


# ---- property test --------------------------------------------------------------------------

@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 8))
    reqs = []
    for i in range(n):
        prompt_len = draw(st.integers(1, 24))
        max_tokens = draw(st.integers(1, 8))
        arrival = draw(st.integers(0, 12))
        # None: never aborted; else aborted this many steps after arriving.
        abort_after = draw(st.one_of(st.none(), st.none(), st.integers(0, 15)))
        reqs.append((f"r{i}", prompt_len, max_tokens, arrival, abort_after))
    # Big enough for any one request alone: its prompt and all outputs but the last, which is
    # sampled and never computed.
    largest = max(-(-(p + m - 1) // block_size) for _, p, m, _, _ in reqs)
    num_blocks = largest + draw(st.sampled_from([0, 0, 1, 1, 2, 3, 5, 10]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(1, 32))
    return block_size, num_blocks, max_num_seqs, budget, reqs


def check_blocks(sim: Sim) -> None:
    owners = sim.bm.owners()
    running = {r.request_id for r in sim.sched.running}
    assert set(owners) <= running, "a non-running request owns blocks"
    owned = [b for table in owners.values() for b in table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert all(0 <= b < sim.bm.num_blocks for b in owned)
    assert len(owned) + sim.bm.num_free_blocks == sim.bm.num_blocks


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_random_workloads_keep_invariants_and_finish(scenario):
    block_size, num_blocks, max_num_seqs, budget, specs = scenario
    sim = Sim(num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    sched, bm = sim.sched, sim.bm
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    # The fake KV cache: slot (block, offset) -> (request, position, token) written there.
    kv: dict[tuple[int, int], tuple[str, int, int]] = {}

    def slot(req: Request, pos: int) -> tuple[int, int]:
        table = bm.block_table(req.request_id)
        return table[pos // block_size], pos % block_size

    chunked = False
    step = 0
    max_steps = 2000
    while step < max_steps:
        for rid, p, m, arrival, _ in specs:
            if arrival == step:
                reqs[rid] = sim.add(rid, p, m)
        for rid, _, _, arrival, abort_after in specs:
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
        check_blocks(sim)

        # The fake forward pass: what the request cached before must still be there, intact;
        # then this step's tokens are written into its blocks.
        for s in out.scheduled:
            req, rid = s.request, s.request.request_id
            tokens = req.token_slice(0, s.start + s.num_new_tokens)
            for pos in range(s.start):
                assert kv.get(slot(req, pos)) == (rid, pos, tokens[pos]), "KV cache clobbered"
            for pos in range(s.start, s.start + s.num_new_tokens):
                kv[slot(req, pos)] = (rid, pos, tokens[pos])

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
    assert sim.sched.num_running == 0 and sim.sched.num_waiting == 0
