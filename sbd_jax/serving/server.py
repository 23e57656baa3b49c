"""A loaded model served: its engine started and its application made, with what the server
compiles and serves decided once (`served_pools`).

By default the server decodes exactly what it compiled before its port opened: NTP, the run's
own SBD setting (block size and rule), and any others an allow-list names (`--block_sizes`,
`--rules`). A request for another setting gets 400 naming what is served: no client can make
the engine stop to compile. `--compile_on_demand` instead compiles any trained setting at its
first request, on the engine thread (every other request waits for it), at most `--max_pools`
at once: for trusted clients.

With structured output (`--structured_output`, the CLI's default) every pool is compiled
constrained, with a table set of `--constraint_states` and `--constraint_moves`
(`pool_tables`), and constraints compile in a worker process bounded by
`--constraint_timeout` (`serving.structured`); no constraint compiles a decode.
"""

from __future__ import annotations

import os

from sbd_jax.constrain.compiler import CompilerSettings, ConstraintCompiler
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.serving import app as app_lib
from sbd_jax.serving import engine as engine_lib
from sbd_jax.serving import guard, pool_tables, protocol
from sbd_jax.serving.pool_tables import Capacity
from sbd_jax.serving.structured import StructuredOutput


def check_options(options: dict) -> None:
  """A one-line ValueError for a flag no server runs with, before anything is loaded."""
  timeout = options.get("request_timeout")
  if timeout is not None and not timeout > 0:  # (NaN included)
    raise ValueError(
      f"--request_timeout={timeout:g}: give a positive number of seconds (unset: no limit)"
    )
  step = options.get("step_timeout", 300.0)
  if not step >= 0:
    raise ValueError(f"--step_timeout={step:g}: give seconds >= 0 (0: no watchdog)")
  capacity(options)
  compile_s = options.get("constraint_timeout", CompilerSettings.timeout_s)
  if not compile_s > 0:
    raise ValueError(f"--constraint_timeout={compile_s:g}: give a positive number of seconds")


def capacity(options: dict) -> Capacity:
  """A constrained pool's table capacity (--constraint_states, --constraint_moves)."""
  states = options.get("constraint_states") or pool_tables.STATES
  return Capacity(states, options.get("constraint_moves") or pool_tables.MOVES)


def served_pools(
  run: SamplerSettings, limits: protocol.Limits, block_sizes, rules, compile_on_demand: bool
) -> list[SamplerSettings]:
  """The pools made before the port opens, the only settings served; none (any setting, made
  on first use) when compiling on demand."""
  if compile_on_demand:
    if block_sizes or rules:
      raise ValueError("--compile_on_demand serves any setting: drop --block_sizes / --rules")
    return []
  return protocol.allowed_pools(run, limits, block_sizes, rules)


def start(model, tokenizer, run, limits: protocol.Limits, options: dict, *, template=None,
          model_name: str, mesh=None):  # fmt: skip
  """The application and its engine, started (its pools made: one that does not fit raises a
  one-line RuntimeError). `options` are `sbd_jax.serve`'s flags by name. With structured output
  (`limits.structured_output`), the constraint compiler's worker is started first."""
  blocks = [_block_size(b) for b in options.get("block_sizes") or ()]
  rules = list(options.get("rules") or ())
  on_demand = bool(options.get("compile_on_demand"))
  allowed = served_pools(run, limits, blocks, rules, on_demand)
  engine = engine_lib.Engine(
    model,
    rows=options["rows"],
    max_prompt_tokens=limits.max_prompt_tokens,
    max_queue=options["max_queue"],
    forwards_per_call=options["forwards_per_call"],
    continuous=options.get("continuous", True),
    max_pools=options.get("max_pools") or max(2, len(allowed)),
    mesh=mesh,
    serve_only=allowed,
    step_timeout_s=options.get("step_timeout", 300.0),
    capacity=capacity(options),
  )
  structured = None
  if limits.structured_output:
    timeout_s = options.get("constraint_timeout", CompilerSettings.timeout_s)
    compiler = ConstraintCompiler(CompilerSettings(timeout_s=timeout_s))
    structured = StructuredOutput.of(compiler, tokenizer, run, limits.vocab_size)
    structured.warm()
  try:
    engine.start()
  except Exception as e:  # a pool that does not fit, or fails to compile: before the port opens
    if structured is not None:
      structured.compiler.close()
    reason = " ".join(str(e).split())[:300]
    raise RuntimeError(f"the served pools could not be made: {reason}") from e
  served = app_lib.Served(
    engine=engine,
    tokenizer=tokenizer,
    template=template,
    run_settings=run,
    default_mode=options.get("decoding", "sbd"),
    limits=limits,
    model_name=model_name,
    api_key=options.get("api_key") or os.environ.get("SBD_API_KEY") or None,
    stop_token_ids=_token_ids(options.get("stop_token_ids") or (), limits.vocab_size),
    request_timeout_s=options.get("request_timeout") or 0.0,
    max_body_bytes=options.get("max_body_bytes") or guard.MAX_BODY_BYTES,
    structured=structured,
  )
  app = app_lib.create_app(served)
  app.state.compiler = None if structured is None else structured.compiler  # `serve` closes it
  return app, engine


def _token_ids(texts, vocab_size: int) -> tuple[int, ...]:
  ids = []
  for text in texts:
    try:
      ids.append(int(text))
    except ValueError:
      raise ValueError(f"--stop_token_ids: {text!r} is not a token id") from None
    if not 0 <= ids[-1] < vocab_size:
      raise ValueError(f"--stop_token_ids: {ids[-1]} is outside the vocabulary [0, {vocab_size})")
  return tuple(ids)


def _block_size(text) -> int:
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--block_sizes: {text!r} is not a whole number") from None
