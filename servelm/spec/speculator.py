"""Speculator: which sequences speculate in a step, and how many draft tokens each.

Decode reads every weight once per step whatever the number of tokens it computes, so while
a step is memory-bound, verifying extra tokens in it costs almost nothing: one stream
computes 1 token per weight read and leaves the compute idle. The roofline gives the
tokens per weight read at which a step turns compute-bound (`roofline.ridge_tokens`); the
speculator hands out draft tokens only up to that, less the tokens the step computes anyway
(every running sequence's next token and pending prompt chunks, and the prompts waiting to
be admitted). A batch already at the ridge gets none: speculation is off for that step.
"""

from __future__ import annotations

import math

from servelm.config import SpeculativeConfig
from servelm.spec.ngram import NgramProposer


class Speculator:
    """Sets request.spec_token_ids on the running requests before each step is scheduled."""

    def __init__(self, config: SpeculativeConfig, ridge_tokens: float, budget: int):
        """ridge_tokens: tokens per weight read where a step turns compute-bound (roofline);
        budget: the scheduler's max_num_batched_tokens."""
        if config.method != "ngram":
            raise ValueError(f"speculative_config method {config.method!r} is not built yet")
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.ridge_tokens = ridge_tokens
        self.budget = budget
        self.enabled = True  # benchmarks toggle it to compare on and off in one process

    def draft_budget(self, base_tokens: int) -> int:
        """Draft tokens a step that computes base_tokens anyway can take while it stays
        memory-bound (0: the batch is compute-bound, no speculation)."""
        room = min(math.floor(self.ridge_tokens), self.budget) - base_tokens
        return max(0, room)

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
        for r in waiting:
            base += r.num_tokens - r.num_computed_tokens
            if base >= self.budget:
                break
        room = self.draft_budget(base)
        if room == 0:
            return 0
        total = 0
        for n, r in enumerate(decoding):
            # Share what is left evenly among the requests still to draft for.
            share = min(self.k, r.max_tokens - r.num_output_tokens - 1,
                        room // (len(decoding) - n))
            if share <= 0:
                continue
            drafts = self.proposer.propose(r, share)
            r.spec_token_ids = drafts
            room -= len(drafts)
            total += len(drafts)
        return total
