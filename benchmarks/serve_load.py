"""The server under load, measured as serving stacks measure themselves (`vllm bench serve`'s
numbers): closed-loop clients at several concurrencies, NTP against SBD and verified SBD, with
continuous batching on and off.

    python -m benchmarks.serve_load --workdir=DIR --out=DIR [--concurrency=1,4,16,64
        --rows=16 --requests=2 --num_problems=128]

For each batching mode a server (`python -m sbd_jax.serve`, --rows rows) is started on a
loopback port. At each concurrency c, c clients each send a streamed completion, wait for its
last chunk and send the next, until --requests x max(c, 16) requests have been answered; the
prompts are the run's held-out arithmetic problems, in order, with `evaluate`'s token budget.
Per (batching, decoding, c), as vLLM reports them:
- request and output-token throughput (per second of wall time);
- TTFT, the time to the first text chunk; TPOT, a request's (latency - TTFT) / (tokens - 1);
  ITL, the gaps between a request's chunks (SBD sends a block per chunk, so its ITL is per
  block, as vLLM's is per step under speculative decoding); end-to-end latency: each as mean,
  p50 and p99;
- forwards per generated token, and the mean generated tokens per request.
One warm-up request per decoding and prompt bucket compiles first. Outputs: DIR/results.json,
DIR/serve_load.md, DIR/serve_load.png.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import threading
import time

import numpy as np
from absl import flags

from benchmarks import report
from sbd_jax import cli

# name -> the request's body fields
DECODINGS = {
  "ntp": {"decoding": "ntp"},
  "sbd": {"decoding": "sbd", "verify": False},
  "sbd verified": {"decoding": "sbd", "verify": True},
}


@dataclasses.dataclass
class Answer:
  """One streamed request: when each text chunk arrived (seconds after sending), when the
  stream ended, and what usage reported."""

  chunk_s: list[float]
  latency_s: float
  tokens: int
  forwards: int

  @property
  def ttft_s(self) -> float:
    return self.chunk_s[0] if self.chunk_s else self.latency_s

  @property
  def tpot_s(self) -> float | None:
    return (self.latency_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None

  @property
  def itl_s(self) -> list[float]:
    return list(np.diff(self.chunk_s))


def _stream(url: str, prompt: str, body: dict, max_tokens: int) -> Answer:
  """One streamed completion, timed chunk by chunk."""
  import urllib.request

  body = {
    "prompt": prompt,
    "max_tokens": max_tokens,
    "stream": True,
    "stream_options": {"include_usage": True},
    **body,
  }
  request = urllib.request.Request(
    f"{url}/v1/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json"},
  )
  start = time.perf_counter()
  chunks, usage = [], None
  with urllib.request.urlopen(request, timeout=600) as r:
    for raw in r:  # server-sent events, a line at a time
      line = raw.decode().strip()
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if any(c.get("text") for c in chunk["choices"]):
        chunks.append(time.perf_counter() - start)
      usage = chunk.get("usage") or usage
  latency = time.perf_counter() - start
  return Answer(chunks, latency, usage["completion_tokens"], usage["forwards"])


def summary(answers: list[Answer], wall_s: float) -> dict:
  """vLLM's serving numbers over the answers of one level."""
  tokens = sum(a.tokens for a in answers)
  out = {
    "requests": len(answers),
    "request_throughput": len(answers) / wall_s,
    "tokens_per_s": tokens / wall_s,
    "tokens_per_request": tokens / len(answers),
    "forwards_per_token": sum(a.forwards for a in answers) / max(1, tokens),
  }
  samples = {
    "ttft": [a.ttft_s for a in answers],
    "tpot": [t for a in answers if (t := a.tpot_s) is not None],
    "itl": [gap for a in answers for gap in a.itl_s],
    "e2e": [a.latency_s for a in answers],
  }
  for name, values in samples.items():
    values = values or [float("nan")]
    out[f"{name}_mean_s"] = float(np.mean(values))
    out[f"{name}_p50_s"] = float(np.percentile(values, 50))
    out[f"{name}_p99_s"] = float(np.percentile(values, 99))
  return out


def closed_loop(url, prompts, body, max_tokens, concurrency, total) -> dict:
  """`concurrency` clients, each sending its next request when its last is answered."""
  counter = itertools.count()
  lock = threading.Lock()
  answers: list[Answer] = []

  def client():
    while (i := next(counter)) < total:
      answer = _stream(url, prompts[i % len(prompts)], body, max_tokens)
      with lock:
        answers.append(answer)

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    for f in [pool.submit(client) for _ in range(concurrency)]:
      f.result()
  return summary(answers, time.perf_counter() - start)


def measure(workdir, concurrency, rows, requests, num_problems, server_flags=()) -> list[dict]:
  from sbd_jax.data.tokenizer import load_tokenizer
  from sbd_jax.decode.sampler import prompt_bucket
  from sbd_jax.evals import runner
  from sbd_jax.evals.tasks import arithmetic
  from sbd_jax.run.workdir import read_trained_config
  from sbd_jax.serving.process import ServerProcess

  config = read_trained_config(workdir)
  problems = arithmetic.problems(config.data, num_problems, config.train.seed)
  tokenizer = load_tokenizer(config.tokenizer, workdir)
  budget = config.sample.max_new_tokens or runner.reference_budget(
    problems, tokenizer, config.sample.block_size
  )
  prompts = [p.plain_prompt for p in problems]
  lengths = [len(tokenizer.encode_document(p)) for p in prompts]
  longest = max(lengths)
  warm_up = list({prompt_bucket(n): p for n, p in zip(lengths, prompts)}.values())
  rows_out = []
  for continuous in (True, False):
    flag = "--continuous" if continuous else "--nocontinuous"
    server = ServerProcess(
      workdir, f"--rows={rows}", f"--max_new_tokens={budget}", f"--max_prompt_tokens={longest}",
      f"--max_queue={max(concurrency) * 2}", f"--max_pools={len(DECODINGS)}", "--noaccess_log",
      flag, *server_flags,
    )  # fmt: skip
    try:
      for decoding, body in DECODINGS.items():
        for prompt in warm_up:  # compile every prompt bucket first
          _stream(server.url, prompt, body, budget)
        for c in concurrency:
          row = closed_loop(server.url, prompts, body, budget, c, requests * max(c, 16))
          row.update(continuous=continuous, decoding=decoding, concurrency=c)
          rows_out.append(row)
          print(format_markdown([row]).splitlines()[-1], flush=True)
    finally:
      server.stop()
  return rows_out


HEADER = [
  "batching", "decoding", "clients", "requests", "req/s", "tokens/s", "tokens/req",
  "TTFT mean / p50 / p99 s", "TPOT mean / p50 / p99 ms", "ITL mean / p50 / p99 ms",
  "E2E mean / p50 / p99 s", "forwards/token",
]  # fmt: skip


def _three(r: dict, name: str, scale: float = 1.0, digits: int = 2) -> str:
  return " / ".join(f"{scale * r[f'{name}_{k}_s']:.{digits}f}" for k in ("mean", "p50", "p99"))


def format_markdown(rows: list[dict]) -> str:
  body = [
    [
      "continuous" if r["continuous"] else "static",
      r["decoding"],
      str(r["concurrency"]),
      str(r["requests"]),
      f"{r['request_throughput']:.2f}",
      f"{r['tokens_per_s']:.0f}",
      f"{r['tokens_per_request']:.0f}",
      _three(r, "ttft"),
      _three(r, "tpot", 1e3, 1),
      _three(r, "itl", 1e3, 1),
      _three(r, "e2e"),
      f"{r['forwards_per_token']:.3f}",
    ]
    for r in rows
  ]
  return report.table(HEADER, body)


def plot(rows: list[dict], path: str):
  with report.figure(path, 2, size=(5, 4)) as (throughput, latency):
    for continuous, decoding in itertools.product((True, False), DECODINGS):
      series = [r for r in rows if r["continuous"] == continuous and r["decoding"] == decoding]
      if not series:
        continue
      label = f"{decoding.upper()}, {'continuous' if continuous else 'static'} batching"
      style = "-o" if continuous else "--s"
      xs = [r["concurrency"] for r in series]
      throughput.plot(xs, [r["tokens_per_s"] for r in series], style, label=label)
      latency.plot(xs, [r["e2e_p50_s"] for r in series], style, label=label)
    for ax, name in ((throughput, "generated tokens / s"), (latency, "request latency p50 (s)")):
      ax.set_xscale("log", base=2)
      ax.set_xlabel("concurrent clients")
      ax.set_ylabel(name)
    throughput.legend(fontsize=7)
    return report.drawn([throughput, latency])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    concurrency = [int(c) for c in f.concurrency.split(",")]
  except ValueError:
    cli.fail(ValueError(f"--concurrency must be comma-separated integers, got {f.concurrency!r}"))
  rows = measure(f.workdir, concurrency, f.rows, f.requests, f.num_problems, f.server_flags)
  table = format_markdown(rows)
  print(table)
  settings = {
    "workdir": f.workdir,
    "rows": f.rows,
    "requests": f.requests,
    "server_flags": f.server_flags,
  }
  report.save(
    f.out, "serve_load", {"settings": settings, "rows": rows}, table, lambda p: plot(rows, p)
  )


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "Trained workdir to serve.", required=True)
  flags.DEFINE_string("out", None, "Results directory.", required=True)
  flags.DEFINE_string("concurrency", "1,4,16,64", "Concurrent closed-loop clients per level.")
  flags.DEFINE_integer("rows", 16, "Server rows per decoding (--rows).")
  flags.DEFINE_integer("requests", 2, "Requests per level: this x max(clients, 16).")
  flags.DEFINE_integer("num_problems", 128, "Held-out problems used as prompts.")
  flags.DEFINE_list("server_flags", [], "More flags for the server, e.g. --nostructured_output.")
  cli.run(main)
