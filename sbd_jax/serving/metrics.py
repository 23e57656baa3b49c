"""What the server exports at GET /metrics (Prometheus' text format), and its access log.

The names are vLLM's core ones under the prefix `sbd:` (vLLM's `vllm:num_requests_running` is
`sbd:num_requests_running` here), so a dashboard built for vLLM needs only the prefix changed:
requests running and waiting, time to first token, inter-token latency, time per output token,
end-to-end latency, and prompt and generation token counters. SBD adds its own: forwards per
request, tokens per forward (speculative decoding's acceptance length), rollbacks under
verification, the share of wide forwards, row occupancy, pools and compilations.

An SBD row settles a block of tokens at a time, so the inter-token latency is observed once per
chunk a request receives (the gap since its previous chunk), as vLLM observes it once per engine
step under speculative decoding.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import prometheus_client as prom

access_log = logging.getLogger("sbd_jax.serve.access")

# Seconds: from a few milliseconds (a warm forward on an accelerator) to minutes (a CPU decode).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKENS_PER_FORWARD_BUCKETS = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)


class Metrics:
  """The server's Prometheus collectors, in a registry of their own (one per application)."""

  def __init__(self, engine):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    gauge = lambda name, doc, fn: prom.Gauge(name, doc, registry=r).set_function(fn)  # noqa: E731
    gauge("sbd:num_requests_running", "Requests holding a row.", engine.busy_rows)
    gauge("sbd:num_requests_waiting", "Requests waiting for a row.", engine.waiting)
    gauge(
      "sbd:num_pools", "Compiled decode settings with rows on device.", lambda: len(engine.pools)
    )
    gauge("sbd:row_occupancy", "Busy rows over the rows on device.", engine.row_occupancy)
    gauge(
      "sbd:wide_forward_share",
      "Share of device forwards that were wide (2P tokens: a block's first pass).",
      engine.wide_forward_share,
    )
    gauge(
      "sbd:device_forwards",
      "Device forwards of every pool (prefills apart).",
      lambda: engine.forwards,
    )
    gauge("sbd:compilations", "Decode programs compiled by this process.", engine.compilations)
    gauge("sbd:engine_alive", "1 while the engine steps and admits requests.", engine.alive)

    def histogram(name, doc, buckets=LATENCY_BUCKETS):
      return prom.Histogram(name, doc, buckets=buckets, registry=r)

    self.ttft = histogram("sbd:time_to_first_token_seconds", "Arrival to the first token sent.")
    self.itl = histogram(
      "sbd:inter_token_latency_seconds", "Gap between a request's chunks (a block under SBD)."
    )
    self.tpot = histogram(
      "sbd:request_time_per_output_token_seconds", "(Latency - TTFT) / (tokens - 1)."
    )
    self.e2e = histogram("sbd:e2e_request_latency_seconds", "Arrival to the last token.")
    self.tokens_per_forward = histogram(
      "sbd:tokens_per_forward",
      "A request's generated tokens over its forwards (its acceptance length).",
      TOKENS_PER_FORWARD_BUCKETS,
    )
    self.prompt_tokens = prom.Counter("sbd:prompt_tokens", "Prompt tokens.", registry=r)
    self.generation_tokens = prom.Counter("sbd:generation_tokens", "Tokens generated.", registry=r)
    self.forwards = prom.Counter("sbd:forwards", "Forwards run for requests.", registry=r)
    self.rollbacks = prom.Counter(
      "sbd:rollbacks", "Drafts that verification rejected (verified SBD).", registry=r
    )
    self.finished = prom.Counter(
      "sbd:request_success", "Requests finished, by reason.", ["finished_reason"], registry=r
    )

  def exposition(self) -> tuple[bytes, str]:
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST


@dataclasses.dataclass
class RequestTimer:
  """One request's clock: arrival, first token, the previous chunk."""

  arrival: float = dataclasses.field(default_factory=time.monotonic)
  first: float | None = None
  last: float | None = None

  def chunk(self, metrics: Metrics) -> None:
    now = time.monotonic()
    if self.first is None:
      self.first = now
      metrics.ttft.observe(now - self.arrival)
    else:
      metrics.itl.observe(now - self.last)
    self.last = now

  def done(
    self, metrics: Metrics, prompt_tokens: int, tokens: int, forwards: int, rollbacks: int = 0
  ) -> dict:
    """Observe the finished request; returns its latencies (seconds) for the access log."""
    end = time.monotonic()
    latency = end - self.arrival
    ttft = (self.first or end) - self.arrival
    metrics.e2e.observe(latency)
    metrics.prompt_tokens.inc(prompt_tokens)
    metrics.generation_tokens.inc(tokens)
    metrics.forwards.inc(forwards)
    metrics.rollbacks.inc(rollbacks)
    if tokens > 1:
      metrics.tpot.observe((latency - ttft) / (tokens - 1))
    if forwards:
      metrics.tokens_per_forward.observe(tokens / forwards)
    return {"ttft_s": round(ttft, 4), "latency_s": round(latency, 4)}
