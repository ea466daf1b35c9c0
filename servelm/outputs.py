"""What the engine hands back: per-request outputs, per-sample completions, timings; a pooling
request's vector (vLLM's PoolingRequestOutput, and EmbeddingRequestOutput for LLM.embed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from servelm.engine.request import Request

if TYPE_CHECKING:
    import torch


@dataclass
class RequestMetrics:
    """Timings of one sample (seconds, perf_counter clock) and the numbers derived from them."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if self.num_output_tokens < 2 or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        end = self.finished_time or self.last_token_time
        return None if end is None else end - self.arrival_time

    @classmethod
    def of(cls, req: Request) -> "RequestMetrics":
        times = req.token_times
        return cls(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=times[0] if times else None,
            last_token_time=times[-1] if times else None,
            finished_time=req.finished_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
            inter_token_latencies=[b - a for a, b in zip(times, times[1:])],
        )


@dataclass
class Logprob:
    """One token's entry in a prompt position's logprobs (vLLM's shape)."""

    logprob: float
    rank: int | None = None       # 1: the most likely token at that position
    decoded_token: str | None = None


# Per prompt position: None for the first (nothing predicts it), else token id -> Logprob
# for the prompt's own token and the top-N alternatives (vLLM's PromptLogprobs).
PromptLogprobs = list["dict[int, Logprob] | None"]


@dataclass
class CompletionOutput:
    """One sample of a request: text and tokens so far, and what this step added."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop", "length", "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list | None = None          # list[TokenLogprobs] when asked for
    delta_text: str = ""                  # text released this step (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None  # set once the sample has finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request (all its n samples) after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs: one entry per prompt token (first None), once the
    # whole prompt is computed; None before then and without it.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def metrics(self) -> RequestMetrics | None:
        """Timings of the first sample (the only one when n == 1)."""
        return self.outputs[0].metrics if self.outputs else None


@dataclass
class PoolingOutput:
    """A pooling request's result: the pooled vector (fp32, 1-D, on the CPU)."""

    data: "torch.Tensor"


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """A pooling request when it has finished (vLLM's shape; the engine reports it once).
    num_cached_tokens is always 0: pooling requests never read the prefix cache."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None  # queue time and end-to-end latency


@dataclass
class EmbeddingOutput:
    """An embedding as a list of floats (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        if output.data.ndim != 1:
            raise ValueError("an embedding is a 1-D vector")
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """What LLM.embed returns per prompt: `.outputs.embedding`."""

    @staticmethod
    def from_base(out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(out.request_id, EmbeddingOutput.from_base(out.outputs),
                                      out.prompt_token_ids, out.num_cached_tokens,
                                      out.finished, out.prompt, out.metrics)
