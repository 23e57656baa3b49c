"""What the server exports at GET /metrics (Prometheus' text format), and its access log.

The names are vLLM's core ones under the prefix `sbd:` (vLLM's `vllm:num_requests_running` is
`sbd:num_requests_running` here), so a dashboard built for vLLM needs only the prefix changed:
requests running and waiting, time to first token, inter-token latency, time per output token,
end-to-end latency, and prompt and generation token counters. SBD adds its own: forwards per
request, tokens per forward, rollbacks under verification, the share of wide forwards, row
occupancy, pools and compilations; and verified SBD's drafts under vLLM's spec-decode names
(`sbd:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos` by position), which sum the requests' `usage.spec_decode`.

As vLLM's, the counters count a request once, whatever its `n`: its prompts once each (a
request's `usage.prompt_tokens`), the tokens it generated, and one `request_success` when it was
answered, labelled `length` when one of its choices ran out of tokens, else `stop`. A request
that reached the engine but was not answered (the client left, a timeout, an error, a shutdown)
counts its tokens and one `sbd:request_failure` by reason. The latency histograms observe each
answered request. An SBD row settles a block of tokens at a time, so the inter-token latency is
observed once per chunk a request receives (the gap since its previous chunk, of any of its
choices), as vLLM observes it once per engine step under speculative decoding. No `*_created`
series are exported.
"""

from __future__ import annotations

import dataclasses
import time

import prometheus_client as prom

# Seconds: from a few milliseconds (a warm forward on an accelerator) to minutes (a CPU decode).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKENS_PER_FORWARD_BUCKETS = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)


class Metrics:
  """The server's Prometheus collectors, in a registry of their own (one per application)."""

  def __init__(self, engine):
    prom.disable_created_metrics()  # process-wide: no `*_created` series
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
    # Verified SBD's drafts, as vLLM's spec-decode counters (`vllm:spec_decode_*`).
    self.drafts = prom.Counter(
      "sbd:spec_decode_num_drafts", "Drafts verification checked (verified SBD).", registry=r
    )
    self.draft_tokens = prom.Counter(
      "sbd:spec_decode_num_draft_tokens", "Drafted tokens verification checked.", registry=r
    )
    self.accepted_tokens = prom.Counter(
      "sbd:spec_decode_num_accepted_tokens", "Drafted tokens verification accepted.", registry=r
    )
    self.accepted_per_pos = prom.Counter(
      "sbd:spec_decode_num_accepted_tokens_per_pos",
      "Drafted tokens accepted, by position in the draft (0: the first).",
      ["position"],
      registry=r,
    )
    self.success = prom.Counter(
      "sbd:request_success", "Requests answered, by finish reason.", ["finished_reason"], registry=r
    )
    self.failure = prom.Counter(
      "sbd:request_failure",
      "Requests the engine took but did not answer, by reason (cancelled, timeout, error, "
      "shutdown).",
      ["reason"],
      registry=r,
    )

  def exposition(self) -> tuple[bytes, str]:
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST

  def request_done(self, timer: "RequestTimer", usage, reasons: list[str], answered: bool):
    """Count a request that reached the engine, once (`usage`: its `shapes.Usage`; `reasons`:
    each choice's finish reason; `answered`: the client received every choice whole)."""
    self.prompt_tokens.inc(usage.prompt_tokens)
    self.generation_tokens.inc(usage.completion_tokens)
    self.forwards.inc(usage.forwards)
    self.rollbacks.inc(usage.rollbacks)
    self.drafts.inc(usage.drafts)
    self.draft_tokens.inc(usage.draft_tokens)
    self.accepted_tokens.inc(usage.accepted_tokens)
    for position, n in enumerate(usage.accepted_by_position):
      self.accepted_per_pos.labels(str(position)).inc(n)
    if not answered:
      failed = [r for r in reasons if r not in ("stop", "length")] or ["cancelled"]
      self.failure.labels(failed[0]).inc()
      return
    self.success.labels("length" if "length" in reasons else "stop").inc()
    latency, ttft, tokens = time.monotonic() - timer.arrival, timer.ttft(), usage.completion_tokens
    self.e2e.observe(latency)
    if tokens > 1:
      self.tpot.observe((latency - ttft) / (tokens - 1))
    if usage.forwards:
      self.tokens_per_forward.observe(tokens / usage.forwards)


@dataclasses.dataclass
class RequestTimer:
  """One request's clock: arrival (monotonic), first chunk, the previous chunk."""

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

  def ttft(self) -> float:
    """Seconds from arrival to the first chunk (to now, before one)."""
    return (self.first or time.monotonic()) - self.arrival
