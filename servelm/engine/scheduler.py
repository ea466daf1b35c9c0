"""Scheduler: continuous batching under a token budget, with recompute preemption (no torch)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # tokens to compute this step, from request.num_computed_tokens
    # Of those, draft tokens to verify (request.spec_token_ids, after its last token).
    num_draft: int = 0
    # (tokens into the step, snapshot): where the step's forward copies the request's
    # recurrent state into a snapshot for the prefix cache (BlockManager.reserve_snapshot).
    snapshot: tuple[int, int] | None = None
    start: int = field(init=False)     # request.num_computed_tokens when scheduled
    samples: bool = field(init=False)  # the step reaches the request's last token: sample
    num_rejected: int = field(init=False, default=0)  # drafts the verification rejected

    def __post_init__(self) -> None:
        self.start = self.request.num_computed_tokens
        self.samples = (self.start + self.num_new_tokens - self.num_draft
                        == self.request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Running requests go first (their decode token, or the next chunk of their prompt),
    in admission order; then waiting requests are admitted in arrival order while the
    token budget, the sequence limit and the free KV blocks allow. When a running
    request needs a block and none is free, the most recently admitted request is
    preempted: its blocks are freed and it goes back to the front of the queue, to be
    recomputed later.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_loras: int | None = None):
        """max_loras: distinct LoRA adapters one step may hold (their resident slots); a
        waiting request whose adapter would be one too many waits, and later ones are
        admitted past it."""
        self.config = config
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = req.num_tokens - req.num_computed_tokens
            # Drafts (a decoding request only) take budget and KV slots like any token;
            # they are trimmed to the budget and dropped before anything is preempted.
            n = min(pending + (len(req.spec_token_ids) if pending == 1 else 0), budget)
            n = split_at(req.state_point, req.num_computed_tokens, n)
            if n > pending and not bm.can_allocate(req.request_id, req.num_computed_tokens + n):
                n = pending
            num_draft = max(0, n - pending)
            if len(req.spec_token_ids) != num_draft:
                req.spec_token_ids = req.spec_token_ids[:num_draft]
            while not bm.can_allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: nothing after it is left to run
            bm.allocate(req.request_id, req.num_computed_tokens + n)
            out.scheduled.append(self._with_snapshot(ScheduledSeq(req, n, num_draft)))
            budget -= n
            i += 1
        # Only admit new work when no running request had to give up its blocks, and
        # only into blocks the running requests will not need for their next tokens.
        reserve = None  # computed at the first admission attempt: most steps admit none
        adapters = None  # the running requests' LoRA adapters, at the first one that has one
        j = 0  # waiting[:j]: requests passed over because their adapter has no slot
        while (j < len(self.waiting) and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[j]
            if req.lora_name is not None and self.max_loras is not None:
                if adapters is None:
                    adapters = {r.lora_name for r in self.running if r.lora_name is not None}
                if req.lora_name not in adapters and len(adapters) >= self.max_loras:
                    j += 1
                    continue
            if req.wait_for is not None and not _prompt_done(req.wait_for):
                break  # a sibling sample: admitted once the first has cached the prompt
            if bm.num_state_slots and not bm.num_free_slots:
                break  # every recurrent-state slot is held (linear-attention layers)
            lookup = (bm.enable_caching and not req.needs_prompt_logits
                      and req.pooling_params is None)
            tokens = req.token_slice(0, req.num_tokens) if lookup else []
            cached = bm.find_cached_prefix(tokens, req.cache_salt) if lookup else []
            num_cached = len(cached) * bm.block_size
            # (A recurrent state's restart point, where its tokens part from a cached prompt.)
            state_point = bm.snapshot_point(tokens, req.cache_salt) if lookup else 0
            n = split_at(state_point, num_cached, min(req.num_tokens - num_cached, budget))
            take = bm.num_blocks_to_take(req.request_id, num_cached + n, cached)
            if take > bm.num_free_blocks:
                break
            own = self._lookahead_blocks([req], num_cached + n)
            if reserve is None:
                reserve = self._lookahead_blocks(self.running)
            if self.running and bm.num_free_blocks - take - own < reserve:
                break  # the blocks are spoken for by running requests' next tokens
            del self.waiting[j]
            if adapters is not None and req.lora_name is not None:
                adapters.add(req.lora_name)
            bm.allocate(req.request_id, num_cached + n, cached)
            bm.record_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.state_point = state_point
            if req.num_output_tokens == 0:
                req.num_cached_tokens = num_cached
            req.wait_for = None
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._with_snapshot(ScheduledSeq(req, n)))
            budget -= n
            reserve += own
        return out

    def _with_snapshot(self, s: ScheduledSeq) -> ScheduledSeq:
        """A prompt chunk that reaches the end of the last full block of the tokens its
        request has to compute (its prompt; a readmitted one's outputs so far too) keeps
        the recurrent state there for the prefix cache (state snapshots: the chunk's forward
        copies it on the way). A decode step that ends on a block boundary keeps it in the
        request's trailing snapshot (one a request, moved along; only from the free ones,
        so that it never evicts a prompt's)."""
        bm = self.block_manager
        req = s.request
        if (not bm.num_state_snapshots or req.needs_prompt_logits
                or req.pooling_params is not None):
            return s
        point = req.num_tokens // bm.block_size * bm.block_size
        if s.start < req.state_point == s.start + s.num_new_tokens:
            point = req.state_point  # where another prompt went on from this one's tokens
        if s.start < point <= s.start + s.num_new_tokens:
            decode = s.samples and s.num_new_tokens == 1
            sid = bm.reserve_snapshot(req.request_id, point, trailing=decode)
            if sid is not None:
                s.snapshot = (point - s.start, sid)
        return s

    def _lookahead_blocks(self, reqs: list[Request], held_tokens: int | None = None) -> int:
        """Blocks these requests will still take to finish their prompt and grow by
        `admission_lookahead` tokens (no further than max_tokens), beyond the blocks they
        hold (or would hold with `held_tokens`). Admission keeps them free, so that
        admitting a request does not force a preemption, and a recompute, a few steps
        later."""
        h = self.config.admission_lookahead
        if not h:
            return 0
        bm = self.block_manager
        total = 0
        for r in reqs:
            # The last output token is sampled, never fed back: it takes no KV slot.
            end = min(r.num_tokens + h, r.num_prompt_tokens + r.max_tokens - 1)
            # (A windowed group holds no more than its reach and a step's tokens.)
            total += bm.num_to_grow(r.request_id, end, held_tokens,
                                    self.config.max_num_batched_tokens)
        return total

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and requeue it at the front; it is recomputed later
        (from its cached prefix, when prefix caching is on)."""
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # recompute prompt and outputs so far when readmitted
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Record that every scheduled request's new tokens are now in the cache, and offer
        newly filled blocks to the prefix cache.

        Speculated requests: called after verification (s.num_rejected set) and before the
        accepted tokens are appended. Rejected drafts are rolled back: they do not count as
        computed, the blocks wholly past the next token's position go back to the pool, and
        only accepted tokens can ever fill a block the prefix cache registers.

        A model with windowed attention layers (BlockManager.reach, or block groups with a
        reach) gives back their blocks out of the window of the request's next token."""
        bm = self.block_manager
        bs = bm.block_size
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens - s.num_rejected
            if s.num_rejected:
                # The next step runs the token after the accepted ones: keep its slot.
                bm.truncate(req.request_id, req.num_computed_tokens + 1)
            if (bm.enable_caching and req.pooling_params is None
                    and req.num_computed_tokens // bs > s.start // bs):
                tokens = req.token_slice(0, min(req.num_computed_tokens, req.num_tokens))
                if s.num_draft:  # the accepted drafts are not appended yet
                    tokens += req.spec_token_ids[:req.num_computed_tokens - len(tokens)]
                bm.cache_full_blocks(req.request_id, tokens, req.num_computed_tokens,
                                     req.cache_salt)
            if bm.releases:  # windowed layers: the blocks out of their reach go back
                bm.release_behind(req.request_id, req.num_computed_tokens)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks at once."""
        assert status.is_finished
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.is_finished and req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.block_manager.free(req.request_id)


def split_at(point: int, start: int, n: int) -> int:
    """A step of n tokens from `start`, shortened to end at `point` (a request's state
    point: where its prompt parts from a cached one with no recurrent-state snapshot there)
    when it would pass it; that step then keeps the state there (_with_snapshot)."""
    return point - start if start < point < start + n else n


def _prompt_done(req: Request) -> bool:
    """Whether the request's prompt is computed (so its blocks are in the prefix cache)."""
    return req.is_finished or (req.status is RequestStatus.RUNNING
                               and req.num_computed_tokens >= req.num_prompt_tokens)
