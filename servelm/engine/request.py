"""Request: one sequence's state and timings as it moves through the engine (no torch)."""

from __future__ import annotations

import enum
import time
from typing import Any

from servelm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; back in the waiting queue to be recomputed
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED}


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_REASONS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
            RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
            RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}


class Request:
    """A prompt, its generated tokens, and how far its KV cache has been computed.

    Invariant: num_computed_tokens <= num_tokens; the tokens in [num_computed_tokens,
    num_tokens) are the ones the next step must run (the whole prompt at first, then one).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 arrival_time: float | None = None, generator: Any = None,
                 cache_salt: str | None = None):
        self.request_id = request_id
        self.cache_salt = cache_salt  # prefix-cache namespace (None: the shared one)
        self.lora_name: str | None = None  # the LoRA adapter it runs with (None: the base)
        self.grammar: Any = None      # its structured-outputs matcher (llguidance), if any
        # Until its prompt logprobs are complete: every prompt position's logits are wanted,
        # so the prefix cache is not read (cached positions would never be computed).
        self.needs_prompt_logits = False
        # A pooling request's PoolingParams: its prompt is pooled, never sampled, and it
        # neither reads nor fills the prefix cache (mean pooling needs every position).
        self.pooling_params: Any = None
        # Speculative decoding: the draft tokens to verify in the next step (after the last
        # token; never part of output_token_ids until accepted), and the proposer's state.
        self.spec_token_ids: list[int] = []
        self.draft_state: Any = None
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # effective: the params' value capped by the context
        self.generator = generator    # a torch.Generator when the request is seeded
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        # A recurrent-state model's block boundary where this request's tokens part from
        # a cached prefix that has no state snapshot there (0: none): its steps end there
        # once and keep the state, so the next request sharing that prefix starts from it.
        self.state_point = 0
        # A sibling sample (n > 1) waits for this one to compute the shared prompt.
        self.wait_for: Request | None = None
        self.stop_reason: str | int | None = None  # the stop string or token id that ended it
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASONS.get(self.status)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.token_times.append(now)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
