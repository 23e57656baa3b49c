"""CLI: serve a trained workdir's model over HTTP, OpenAI-compatible, with continuous batching.

    python -m sbd_jax.serve --workdir=DIR [--port=8000 --rows=8 --max_prompt_tokens=512
        --max_new_tokens=0 --decoding=sbd --forwards_per_call=8 --max_queue=256]

Requests choose `decoding` ("sbd" / "ntp"), `gamma`, `rule`, `block_size` and `verify` (NTP's text
at SBD's forwards) as extra body fields; unset, they are the run's `sample` settings. SIGTERM stops
admission, lets in-flight requests finish for --shutdown_deadline seconds with the port open
(/health answers 503 "draining"), answers the rest 503 and exits 0; a second signal closes it at
once. Ctrl-C (SIGINT) while the model loads and compiles exits 130. If the engine fails (the device
is gone), /health turns 503 and the process exits 1, for a supervisor to restart it. --api_key (or
SBD_API_KEY) makes /v1 require "Authorization: Bearer <key>". The server decodes what it compiled
before its port opened: NTP, the run's own SBD setting and those --block_sizes / --rules add (a pool
that does not fit stops the start with one line); a request for another setting gets 400 naming what
is served (`serving.server`). --draft, --adaptive and --wide_cost (verified SBD's drafting, each
forward chosen by expected tokens per second, and what a wide forward costs, by default measured
when a pool is made: docs/decoding.md) replace the run's. --structured_output (on by default)
serves OpenAI's response_format and vLLM's structured_outputs: constraints compiled off the
event loop, every pool compiled constrained with tables of --constraint_states and
--constraint_moves (`serving.structured`, docs/serving.md).
The library pieces are `sbd_jax.serving`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from absl import flags

from sbd_jax import cli

flags.DEFINE_string("workdir", None, "Training workdir with config.json and params/.")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string(
  "model_name", "", "The model id /v1/models reports (default: the workdir's name)."
)
flags.DEFINE_enum("decoding", "sbd", ["sbd", "ntp"], "Decoding of requests that name none.")
flags.DEFINE_integer("rows", 8, "Rows decoded together per compiled setting (slots on device).")
flags.DEFINE_integer("max_prompt_tokens", 512, "Longest prompt accepted, in tokens.")
flags.DEFINE_integer("max_new_tokens", 0, "Largest max_tokens accepted; 0 = the run's setting.")
flags.DEFINE_integer("forwards_per_call", 8, "Forwards per device call between admissions.")
flags.DEFINE_integer("max_queue", 256, "Requests that may wait for a row; more get 503.")
flags.DEFINE_integer(
  "max_body_bytes",
  4 * 2**20,
  "Largest request body accepted, in bytes; a larger one gets 413 before it is parsed.",
)
flags.DEFINE_integer(
  "max_pools",
  0,
  "Compiled settings with rows on device at once (each holds its own KV cache); 0 = as many "
  "as are served (--compile_on_demand: 2).",
)
flags.DEFINE_list(
  "block_sizes",
  [],
  "SBD block sizes served besides the run's own (with --rules: each block size with each "
  "rule). Only NTP, the run's SBD setting and these are served, every one allocated and "
  "compiled before the port opens; other settings get 400.",
)
flags.DEFINE_list("rules", [], "Reveal rules served besides the run's own; see --block_sizes.")
flags.DEFINE_bool(
  "compile_on_demand",
  False,
  "Serve any trained block size and rule, each compiled at its first request on the engine "
  "thread (every other request waits for it), at most --max_pools at once: trusted clients only.",
)
flags.DEFINE_list(
  "stop_token_ids",
  [],
  "Token ids that end every choice as EOS does, besides the tokenizer's EOS (e.g. a chat "
  "model's end-of-turn ids); requests may add their own (`stop_token_ids`).",
)
flags.DEFINE_string("api_key", None, "Key /v1 requires as a Bearer token (default: $SBD_API_KEY).")
flags.DEFINE_bool(
  "access_log", True, "One line per request on stderr (logger sbd_jax.serve.access)."
)
flags.DEFINE_bool("continuous", True, "A finished row takes the next request at once.")
flags.DEFINE_float("shutdown_deadline", 30.0, "Seconds in-flight requests get after SIGTERM.")
flags.DEFINE_float(
  "request_timeout",
  None,
  "Seconds a request may take, queueing included (positive); past them it is cancelled (its "
  "rows freed at the next step) and answered 504 (streamed: an error event). Unset: no limit.",
)
flags.DEFINE_float(
  "step_timeout",
  300.0,
  "A device step, or the making of a pool (--compile_on_demand), running longer than this many "
  "seconds fails the engine (/health 503, exit 1); 0 = no watchdog.",
)
flags.DEFINE_bool(
  "structured_output",
  True,
  "Serve constraints (response_format json_object / json_schema, structured_outputs): every "
  "pool is compiled constrained, with a table set of --constraint_states and --constraint_moves "
  "(off: such requests get 400, and the pools decode a little faster).",
)
flags.DEFINE_integer(
  "constraint_states",
  1024,
  "Automaton states a pool's constraint tables hold, its rows' constraints together (rounded up "
  "to 2^k or 3 * 2^(k-1)): 16 KiB a state at a 128k vocabulary, 1 KiB at 8k.",
)
flags.DEFINE_integer(
  "constraint_moves",
  131072,
  "Automaton moves (transitions apart from a state's default) a pool's tables hold: 8 bytes each.",
)
flags.DEFINE_float(
  "constraint_timeout",
  30.0,
  "Seconds one constraint may take to compile (in a worker process); past them it is refused.",
)
cli.define_verification_flags()  # the run's own when not given
flags.mark_flags_as_required(["workdir"])


def build(workdir: str, **options):
  """The FastAPI app and its engine (started) for a workdir: `options` are the flags."""
  import jax

  from sbd_jax.decode import settings as settings_lib
  from sbd_jax.evals import runner
  from sbd_jax.run.loading import load_sampling_model, mesh_for
  from sbd_jax.run.workdir import read_trained_config
  from sbd_jax.serving import protocol, server

  server.check_options(options)
  if jax.process_count() > 1:
    raise ValueError("serve runs in one process: its mesh is this host's devices")
  config = read_trained_config(workdir)
  mesh = mesh_for(config)
  model, _, tokenizer, mask_id = load_sampling_model(workdir, mesh=mesh)
  run = settings_lib.from_config(
    config.sample,
    tokenizer,
    mask_id,
    max_new_tokens=options["max_new_tokens"] or None,
    **options.get("verification", {}),
  )
  limits = protocol.Limits(
    max_prompt_tokens=options["max_prompt_tokens"],
    max_new_tokens=run.max_new_tokens,
    largest_block=config.sbd.k_max,
    vocab_size=model.cfg.vocab_size,
    structured_output=options.get("structured_output", True),
  )
  name = options["model_name"] or os.path.basename(os.path.normpath(workdir))
  template = runner.resolve_template(tokenizer, "auto")
  print(f"compiling what {name} serves", flush=True)
  if limits.structured_output:
    tables_mib = server.capacity(options).table_bytes(limits.vocab_size) / 2**20
    print(f"constraint tables: {tables_mib:.1f} MiB per pool", flush=True)
  return server.start(
    model, tokenizer, run, limits, options, template=template, model_name=name, mesh=mesh
  )


def serve(app, engine, host: str, port: int, shutdown_deadline: float) -> None:
  """Run `app` with uvicorn until SIGTERM / SIGINT, then drain the engine and return; exit 1
  if the engine failed. The first signal drains with the port still open (/health answers 503
  "draining", for a load balancer to see; new requests get 503), then uvicorn closes it and
  waits for the last responses; a second signal closes it at once, cancelling what is in flight
  (each then answered 503 or ended by an error event, as far as the closing allows)."""
  import uvicorn

  class Server(uvicorn.Server):
    draining = False

    def handle_exit(self, sig, frame):
      if self.draining or self.should_exit:
        engine.cancel_all("shutdown")
        self.force_exit = self.should_exit = True  # uvicorn waits for no connection
      else:
        self.draining = True
        threading.Thread(target=self._drain, name="sbd-drain", daemon=True).start()
      # A drained shutdown is a clean exit (status 0): uvicorn would re-raise the signal.
      self._captured_signals.clear()

    def _drain(self):
      engine.drain(shutdown_deadline)
      self.should_exit = True

  config = uvicorn.Config(
    app,
    host=host,
    port=port,
    log_level="warning",
    timeout_graceful_shutdown=int(shutdown_deadline) + 10,
  )
  server = Server(config)

  def stop_serving(error: BaseException) -> None:
    print(f"error: the decode engine failed: {error}", file=sys.stderr, flush=True)
    server.should_exit = True

  engine.on_failure = stop_serving
  server.run()
  engine.drain(0)
  compiler = getattr(app.state, "compiler", None)  # the server's own (`server.start`)
  if compiler is not None:
    compiler.close()  # and its worker process
  if engine.error is not None:
    sys.exit(1)


def log_access(stream) -> logging.Handler:
  """Print the access log's lines (logger `sbd_jax.serve.access`) on `stream`, each once: the
  logger's own handler, not passed on to the root logger's (absl's prints every record)."""
  handler = logging.StreamHandler(stream)
  handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
  access = logging.getLogger("sbd_jax.serve.access")
  access.addHandler(handler)
  access.setLevel(logging.INFO)
  access.propagate = False
  return handler


def main(argv):
  del argv
  f = flags.FLAGS
  options = {
    name: f[name].value
    for name in (
      "model_name decoding rows max_prompt_tokens max_new_tokens forwards_per_call max_queue "
      "continuous max_pools api_key block_sizes rules stop_token_ids step_timeout "
      "request_timeout max_body_bytes compile_on_demand structured_output constraint_states "
      "constraint_moves constraint_timeout"
    ).split()
  }
  options["verification"] = cli.verification_settings()
  handlers = {sig: signal.signal(sig, _interrupted_at_start) for sig in STARTING_SIGNALS}
  try:
    app, engine = build(f.workdir, **options)
  except (FileNotFoundError, ValueError, RuntimeError) as e:
    cli.fail(e)
  for sig, handler in handlers.items():  # the server's own take over in `serve`
    signal.signal(sig, handler)
  if f.access_log:
    log_access(sys.stderr)
  print(f"serving {f.workdir} on http://{f.host}:{f.port}/v1", flush=True)
  serve(app, engine, f.host, f.port, f.shutdown_deadline)


STARTING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupted_at_start(sig, frame) -> None:
  """A signal while the model loads and compiles: exit at once, 128 + the signal's number (as a
  shell reports it). Python's KeyboardInterrupt there, raised between XLA's calls while its
  compiler threads run, can hang the process or end it in a segmentation fault."""
  del frame
  name = signal.Signals(sig).name
  print(f"error: {name} while starting: not serving", file=sys.stderr, flush=True)
  os._exit(128 + sig)


if __name__ == "__main__":
  cli.run(main)
