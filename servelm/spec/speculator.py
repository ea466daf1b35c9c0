"""Speculator: which sequences speculate in a step, and how many draft tokens each.

Decode reads every weight once per step whatever the number of tokens it computes, so while
a step is memory-bound, verifying extra tokens in it costs almost nothing: one stream
computes 1 token per weight read and leaves the compute idle. The roofline gives the tokens
per weight read at which a step turns compute-bound (`roofline.ridge_tokens`, R); in units
of one weight read a step of n tokens takes max(1, n / R). With b decoding sequences, the
step's other tokens c (pending prompt chunks, waiting prompts) and d drafts each accepted
with probability a (the recent acceptance rate), a step does c + b (1 - a^(d+1)) / (1 - a)
useful tokens in max(1, (b + c + b d) / R): the speculator picks the d in 0..k with the most
per unit of time. A batch already past the ridge gets d = 0 (every draft would cost its
full share of arithmetic and some are rejected): speculation is off for that step.

A proposer that runs a model (draft_model) costs time of its own: d sequential draft
forwards, each reading the draft's weights, `draft_cost` (the draft's weight bytes over the
target's) of a target weight read each, max(1, b / R) of them past the ridge. The step then
takes max(1, (b + c + b d) / R) + d draft_cost max(1, b / R); prompt lookup costs nothing.

The proposer is pluggable: anything with `propose(reqs, ks) -> drafts` (up to ks[i] tokens to
follow reqs[i]'s tokens so far; they count as point masses, q(d) = 1, in the rejection
sampler, so they must be a deterministic function of the request's tokens) and
`release(req)` (the request finished, was aborted or preempted: drop what it holds).
"""

from __future__ import annotations

from typing import Protocol

from servelm.config import SpeculativeConfig
from servelm.spec.ngram import NgramProposer

_DECAY = 0.99  # the acceptance rate counts the last ~100 verifications


class Proposer(Protocol):
    """Where drafts come from (ngram.NgramProposer, draft_model.DraftModelProposer)."""

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow each reqs[i]'s tokens (prompt + output)."""

    def release(self, req) -> None:
        """Drop what the proposer holds for req (finished, aborted or preempted)."""


class Speculator:
    """Sets request.spec_token_ids on the running requests before each step is scheduled."""

    def __init__(self, config: SpeculativeConfig, ridge_tokens: float, budget: int,
                 proposer: Proposer | None = None, draft_cost: float = 0.0):
        """ridge_tokens: tokens per weight read where a step turns compute-bound (roofline);
        budget: the scheduler's max_num_batched_tokens; proposer: where drafts come from
        (None: prompt lookup, for method ngram); draft_cost: one draft forward's time in
        target weight reads (0 for prompt lookup)."""
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"speculative_config method {config.method!r} needs its "
                                 f"proposer built by the engine")
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.ridge_tokens = ridge_tokens
        self.budget = budget
        self.draft_cost = draft_cost
        self.enabled = True  # benchmarks toggle it to compare on and off in one process
        self._accepted, self._drafted = 1.0, 2.0  # a prior of 1/2, soon outweighed

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One verification's outcome, into the recent acceptance rate (decaying counts)."""
        self._drafted = self._drafted * _DECAY + num_draft
        self._accepted = self._accepted * _DECAY + num_accepted

    @property
    def acceptance(self) -> float:
        return self._accepted / self._drafted

    def num_drafts(self, num_decoding: int, other_tokens: int) -> int:
        """Drafts per decoding sequence for a step of num_decoding decodes and other_tokens
        other tokens: the d in 0..k with the most useful tokens (the others, and the
        decodes' expected emitted ones) per unit of step time on the roofline, within the
        token budget."""
        a, ridge = min(self.acceptance, 0.999), max(self.ridge_tokens, 1e-9)
        base = num_decoding + other_tokens
        best_d, best = 0, base / max(1.0, base / ridge)
        draft_step = self.draft_cost * max(1.0, num_decoding / ridge)
        for d in range(1, self.k + 1):
            rows = base + num_decoding * d
            if rows > self.budget:
                break
            emitted = num_decoding * (1 - a ** (d + 1)) / (1 - a)
            rate = (other_tokens + emitted) / (max(1.0, rows / ridge) + d * draft_step)
            if rate > best * (1 + 1e-9):
                best_d, best = d, rate
        return best_d

    def propose(self, running: list, waiting: list) -> int:
        """Drafts for this step's decoding requests (spec_token_ids, [] for the rest);
        returns the number of draft tokens handed out."""
        decoding, base = [], 0
        for r in running:
            pending = r.num_tokens - r.num_computed_tokens
            base += pending
            if r.spec_token_ids:
                r.spec_token_ids = []
            # Not while prefilling; never with a grammar (its matcher would have to run
            # ahead over guesses); not past max_tokens (the last token is the target's).
            if pending == 1 and r.grammar is None and r.max_tokens - r.num_output_tokens > 1:
                decoding.append(r)
        if not self.enabled or not decoding:
            return 0
        other = base - len(decoding)
        for r in waiting:
            other += r.num_tokens - r.num_computed_tokens
            if other >= self.budget:
                break
        d = self.num_drafts(len(decoding), other)
        if d == 0:
            return 0
        shares = [min(d, r.max_tokens - r.num_output_tokens - 1) for r in decoding]
        total = 0
        for r, drafts in zip(decoding, self.proposer.propose(decoding, shares)):
            r.spec_token_ids = drafts
            total += len(drafts)
        return total

    def release(self, req) -> None:
        """req finished, was aborted or preempted: the proposer drops what it holds for it."""
        self.proposer.release(req)
