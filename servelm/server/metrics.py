"""Prometheus metrics of one server: per-request latencies and counts, engine state.

Each ServerMetrics has its own CollectorRegistry, so several apps can live in one process.
Engine state (running, waiting, KV usage, preemptions, aborts) is read at scrape time from
the snapshot the engine thread publishes, never from the engine itself.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from servelm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5, 5.0)
# How many finished requests' TTFT and TPOT the console's percentiles are taken over.
RECENT_REQUESTS = 1000


class _EngineCollector:
    """Gauges and engine-side counters, from the engine thread's latest snapshot."""

    def __init__(self, engine):
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        s = self._engine.snapshot
        yield GaugeMetricFamily("servelm_num_requests_running",
                                "Sequences in the running batch.", value=s.num_running)
        yield GaugeMetricFamily("servelm_num_requests_waiting",
                                "Sequences waiting to be scheduled.", value=s.num_waiting)
        yield GaugeMetricFamily("servelm_kv_cache_usage_ratio",
                                "Fraction of the KV block pool in use.", value=s.kv_cache_usage)
        yield CounterMetricFamily("servelm_num_preemptions",
                                  "Sequences preempted (KV blocks freed, recomputed later).",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("servelm_requests_aborted",
                                  "Requests aborted before they finished (e.g. client gone).",
                                  value=s.stats.num_aborted)
        yield CounterMetricFamily("servelm_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("servelm_prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not recomputed).",
                                  value=s.prefix_cache_hits)
        yield GaugeMetricFamily("servelm_prefix_cache_hit_rate",
                                "Prefix cache hits / queries, in tokens, since start.",
                                value=s.prefix_cache_hits / max(1, s.prefix_cache_queries))
        yield CounterMetricFamily("servelm_engine_steps", "Engine steps (forward passes).",
                                  value=s.stats.num_steps)
        # Step composition: these over engine_steps give prefill and decode tokens per step.
        yield CounterMetricFamily("servelm_step_prefill_tokens",
                                  "Prompt tokens computed, summed over steps.",
                                  value=s.stats.num_prefill_tokens)
        yield CounterMetricFamily("servelm_step_decode_tokens",
                                  "Decode tokens computed, summed over steps.",
                                  value=s.stats.num_decode_tokens)
        # Speculative decoding: drafts verified and accepted; their ratio and the tokens
        # each verification emitted (accepted drafts + the target's own token).
        st = s.stats
        yield CounterMetricFamily("servelm_spec_decode_num_drafts",
                                  "Sequences verified with draft tokens (speculative decoding).",
                                  value=st.num_spec_verifications)
        yield CounterMetricFamily("servelm_spec_decode_num_draft_tokens",
                                  "Draft tokens verified.", value=st.num_spec_draft_tokens)
        yield CounterMetricFamily("servelm_spec_decode_num_accepted_tokens",
                                  "Draft tokens accepted.", value=st.num_spec_accepted_tokens)
        yield GaugeMetricFamily("servelm_spec_decode_acceptance_rate",
                                "Accepted / verified draft tokens, since start.",
                                value=st.spec_acceptance_rate or 0.0)
        yield GaugeMetricFamily("servelm_spec_decode_mean_accepted_length",
                                "Tokens emitted per verification (accepted drafts + 1), since start.",
                                value=st.spec_mean_accepted_length or 0.0)
        # Against the roofline: bytes and FLOPs the model says each step needs, over the
        # time the steps took (rate(bytes) / rate(seconds) is the achieved bandwidth).
        yield CounterMetricFamily("servelm_decode_step_seconds",
                                  "Time spent in decode-only steps.", value=s.stats.decode_seconds)
        yield CounterMetricFamily("servelm_decode_step_bytes",
                                  "Weight and KV bytes those steps read (roofline model).",
                                  value=s.stats.decode_bytes)
        yield CounterMetricFamily("servelm_prefill_step_seconds",
                                  "Time spent in steps with prompt tokens.",
                                  value=s.stats.prefill_seconds)
        yield CounterMetricFamily("servelm_prefill_step_flops",
                                  "Matmul FLOPs of the prompt tokens of those steps.",
                                  value=s.stats.prefill_flops)
        if getattr(self._engine, "lora_enabled", False):
            yield GaugeMetricFamily("servelm_lora_adapters_loaded",
                                    "LoRA adapters registered (requests may name them).",
                                    value=len(self._engine.loras))
            yield GaugeMetricFamily("servelm_lora_adapters_resident",
                                    "LoRA adapters in the model's slots (at most --max-loras).",
                                    value=len(s.lora_resident))
            yield CounterMetricFamily("servelm_lora_adapter_loads",
                                      "LoRA adapters written into a slot (residency misses).",
                                      value=s.lora_loads)
        shape = getattr(self._engine.engine, "shape", None)
        if shape is not None:
            # The model's side of the roofline, so a client (servelm bench --plot) can draw
            # the prediction: bytes per decode step, KV bytes per token, FLOPs per token.
            yield GaugeMetricFamily("servelm_roofline_weight_bytes_per_step",
                                    "Weight bytes one decode step reads.",
                                    value=shape.weight_bytes_per_step)
            yield GaugeMetricFamily("servelm_roofline_kv_bytes_per_token",
                                    "KV-cache bytes of one token (KV heads only).",
                                    value=shape.kv_bytes_per_token or 0.0)
            yield GaugeMetricFamily("servelm_roofline_flops_per_token",
                                    "Matmul FLOPs of one token, without attention.",
                                    value=shape.flops_per_token(0))
            yield GaugeMetricFamily("servelm_roofline_attention_flops_per_token_context",
                                    "Attention FLOPs of one token per earlier token attended.",
                                    value=shape.flops_per_token(1) - shape.flops_per_token(0))
            yield GaugeMetricFamily("servelm_roofline_lm_head_flops_per_token",
                                    "LM-head FLOPs of one token (within flops_per_token; "
                                    "a prompt runs it for its last position only).",
                                    value=shape.lm_head_flops)
            yield GaugeMetricFamily("servelm_roofline_sampled_row_flops_per_token",
                                    "FLOPs of one token a prompt runs for its last position "
                                    "only: the LM head and the last layer past attention "
                                    "(within flops_per_token).",
                                    value=shape.sampled_row_flops)
        hw = getattr(self._engine.engine, "hardware", None)
        if hw is not None:
            yield GaugeMetricFamily("servelm_roofline_bandwidth_bytes_per_second",
                                    "The machine's memory bandwidth (measured or given).",
                                    value=hw.bandwidth)
            yield GaugeMetricFamily("servelm_roofline_flops_per_second",
                                    "The machine's matmul peak in the compute dtype.",
                                    value=hw.flops)
            if hw.int8_ops:
                yield GaugeMetricFamily("servelm_roofline_int8_ops_per_second",
                                        "The machine's int8 matmul peak (whole rows).",
                                        value=hw.int8_ops)
            if hw.q8act_ops:
                yield GaugeMetricFamily("servelm_roofline_q8act_ops_per_second",
                                        "The q8act kernel's rate: the compute roof of layers "
                                        "with int8 activations.", value=hw.q8act_ops)
            if hw.w8a8_ops:
                yield GaugeMetricFamily("servelm_roofline_w8a8_ops_per_second",
                                        "The w8a8 kernel's rate: the compute roof of the "
                                        "layers on int8 activations.", value=hw.w8a8_ops)
            if s.stats.decode_seconds:
                yield GaugeMetricFamily(
                    "servelm_decode_bandwidth_utilization",
                    "Achieved decode bytes/s over the machine's memory bandwidth.",
                    value=s.stats.decode_bytes / s.stats.decode_seconds / hw.bandwidth)
            if s.stats.prefill_seconds:
                yield GaugeMetricFamily(
                    "servelm_prefill_flops_utilization",
                    "Achieved prefill FLOP/s over the machine's matmul peak.",
                    value=s.stats.prefill_flops / s.stats.prefill_seconds / hw.flops)


class ServerMetrics:
    """The server's metrics; record() is called once per API request when it ends."""

    def __init__(self, engine, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.ttft = Histogram("servelm_time_to_first_token_seconds",
                              "Arrival to first generated token.", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("servelm_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("servelm_inter_token_latency_seconds",
                             "Time between consecutive tokens of a sequence.",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("servelm_e2e_request_latency_seconds",
                             "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("servelm_request_queue_time_seconds",
                                    "Arrival to first scheduled.", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.prompt_tokens = Counter("servelm_prompt_tokens", "Prompt tokens of requests.",
                                     registry=r)
        self.generation_tokens = Counter("servelm_generation_tokens",
                                         "Tokens generated (all samples).", registry=r)
        self.success = Counter("servelm_request_success",
                               "Sequences that finished, by finish reason.", ["finish_reason"],
                               registry=r)
        for reason in ("stop", "length"):  # exported at 0 before the first request
            self.success.labels(finish_reason=reason)
        r.register(_EngineCollector(engine))
        # The latest requests' own values, for exact percentiles (/v1/stats), not buckets.
        self.recent_ttft: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.recent_tpot: deque[float] = deque(maxlen=RECENT_REQUESTS)

    def record(self, prompt_lens: list[int], outputs: list[RequestOutput | None],
               finished: bool) -> None:
        """Count one API request's tokens; time it if it finished (not aborted)."""
        self.prompt_tokens.inc(sum(prompt_lens))
        samples = [o for out in outputs if out is not None for o in out.outputs]
        self.generation_tokens.inc(sum(len(o.token_ids) for o in samples))
        if not finished:
            return
        for o in samples:
            self.success.labels(finish_reason=o.finish_reason).inc()
            m = o.metrics
            if m is None:
                continue
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot),
                                (self.e2e, m.e2e_latency), (self.queue_time, m.queue_time)):
                if value is not None:
                    hist.observe(value)
            if m.ttft is not None:
                self.recent_ttft.append(m.ttft)
            if m.tpot is not None:
                self.recent_tpot.append(m.tpot)
            for v in m.inter_token_latencies:
                self.itl.observe(v)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
