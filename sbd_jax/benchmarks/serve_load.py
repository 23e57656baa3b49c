"""The server under load: closed-loop clients at several concurrencies, NTP against SBD, with
continuous batching on and off.

    python -m sbd_jax.benchmarks.serve_load --workdir=DIR --out=DIR [--concurrency=1,4,16,64
        --rows=16 --requests=2 --num_problems=128]

For each batching mode a server (`python -m sbd_jax.serve`, --rows rows) is started on a
loopback port. At each concurrency c, c clients each send a streamed completion, wait for its
last chunk and send the next, until --requests x max(c, 16) requests have been answered; the
prompts are the run's held-out arithmetic problems, in order, with `evaluate`'s token budget.
Per (batching, decoding, c): generated tokens per second of wall time, time to the first text
chunk (p50), request latency (p50 / p99) and forwards per generated token. One warm-up request
per decoding and prompt bucket compiles first. Outputs: DIR/results.json, DIR/serve_load.md, DIR/serve_load.png.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import statistics
import threading
import time

from absl import flags

from sbd_jax import cli
from sbd_jax.benchmarks import report

DECODINGS = ("ntp", "sbd")


@dataclasses.dataclass
class Answer:
  latency_s: float
  first_text_s: float
  tokens: int
  forwards: int


def _stream(url: str, prompt: str, decoding: str, max_tokens: int) -> Answer:
  """One streamed completion, timed: its latency and the time to its first text chunk."""
  import urllib.request

  body = {
    "prompt": prompt,
    "max_tokens": max_tokens,
    "stream": True,
    "stream_options": {"include_usage": True},
    "decoding": decoding,
  }
  request = urllib.request.Request(
    f"{url}/v1/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json"},
  )
  start = time.perf_counter()
  first, usage = None, None
  with urllib.request.urlopen(request, timeout=600) as r:
    for raw in r:  # server-sent events, a line at a time
      line = raw.decode().strip()
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if first is None and any(c.get("text") for c in chunk["choices"]):
        first = time.perf_counter() - start
      usage = chunk.get("usage") or usage
  latency = time.perf_counter() - start
  return Answer(latency, first or latency, usage["completion_tokens"], usage["forwards"])


def closed_loop(url, prompts, decoding, max_tokens, concurrency, total) -> dict:
  """`concurrency` clients, each sending its next request when its last is answered."""
  counter = itertools.count()
  lock = threading.Lock()
  answers: list[Answer] = []

  def client():
    while (i := next(counter)) < total:
      answer = _stream(url, prompts[i % len(prompts)], decoding, max_tokens)
      with lock:
        answers.append(answer)

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    for f in [pool.submit(client) for _ in range(concurrency)]:
      f.result()
  wall = time.perf_counter() - start
  latencies = sorted(a.latency_s for a in answers)
  tokens = sum(a.tokens for a in answers)
  return {
    "requests": len(answers),
    "tokens_per_s": tokens / wall,
    "first_text_p50_s": statistics.median(a.first_text_s for a in answers),
    "latency_p50_s": statistics.median(latencies),
    "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    "forwards_per_token": sum(a.forwards for a in answers) / max(1, tokens),
  }


def measure(workdir, concurrency, rows, requests, num_problems) -> list[dict]:
  from sbd_jax.data.tokenizer import load_tokenizer
  from sbd_jax.decode.sampler import prompt_bucket
  from sbd_jax.evals import runner
  from sbd_jax.evals.tasks import arithmetic
  from sbd_jax.serving.process import ServerProcess
  from sbd_jax.training.workdir import read_trained_config

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
      f"--max_queue={max(concurrency) * 2}", flag,
    )  # fmt: skip
    try:
      for decoding in DECODINGS:
        for prompt in warm_up:  # compile every prompt bucket first
          _stream(server.url, prompt, decoding, budget)
        for c in concurrency:
          row = closed_loop(server.url, prompts, decoding, budget, c, requests * max(c, 16))
          row.update(continuous=continuous, decoding=decoding, concurrency=c)
          rows_out.append(row)
          print(format_markdown([row]).splitlines()[-1], flush=True)
    finally:
      server.stop()
  return rows_out


HEADER = [
  "batching", "decoding", "clients", "requests", "tokens/s", "first text p50 s",
  "latency p50 s", "latency p99 s", "forwards/token",
]  # fmt: skip


def format_markdown(rows: list[dict]) -> str:
  body = [
    [
      "continuous" if r["continuous"] else "static",
      r["decoding"],
      str(r["concurrency"]),
      str(r["requests"]),
      f"{r['tokens_per_s']:.0f}",
      f"{r['first_text_p50_s']:.2f}",
      f"{r['latency_p50_s']:.2f}",
      f"{r['latency_p99_s']:.2f}",
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
      latency.plot(xs, [r["latency_p50_s"] for r in series], style, label=label)
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
  rows = measure(f.workdir, concurrency, f.rows, f.requests, f.num_problems)
  table = format_markdown(rows)
  print(table)
  settings = {"workdir": f.workdir, "rows": f.rows, "requests": f.requests}
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
  cli.run(main)
