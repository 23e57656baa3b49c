"""Shared command-line plumbing: one-line errors for bad flags and config overrides."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from absl import app, flags
from absl import logging as absl_logging

from sbd_jax import platforms


def _one_line(error: Exception) -> str:
  text = str(error).strip().strip("'\"").replace("\\n", " ").replace("\\'", "'")
  return " ".join(text.split())


def parse_flags(argv: list[str]) -> list[str]:
  """Parse absl flags; a config override naming a missing field or a wrong type becomes a
  one-line flags error instead of a traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"error: {_one_line(e)}")
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    sys.exit(f"error: invalid config override: {_one_line(e)}")


def fail(error: Exception) -> None:
  """Exit with a one-line message for errors the user can fix (bad config, missing files)."""
  sys.exit(f"error: {_one_line(error)}")


def run(main: Callable[[list[str]], None]) -> None:
  """app.run with one-line flag errors, and library INFO logs (Orbax, XLA) hidden unless
  --verbosity is given. On a CPU machine with libtpu installed, JAX starts on the CPU without
  probing for a TPU (`platforms`)."""
  platforms.quiet_cpu_default()

  def quiet_main(argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      absl_logging.set_verbosity(absl_logging.WARNING)
    show_decode_costs()
    main(argv)

  app.run(quiet_main, flags_parser=parse_flags)


def show_decode_costs() -> None:
  """Print what each decode program's forwards were measured to cost (`decode.costs`) to
  stderr, one line per program, whatever the verbosity."""
  costs_log = logging.getLogger("sbd_jax.decode.costs")
  if not costs_log.handlers:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    costs_log.addHandler(handler)
    costs_log.setLevel(logging.INFO)
    costs_log.propagate = False


# The verification settings of `decode.settings.SamplerSettings` (their doc there): flags of the
# CLIs that decode (`sample`, `evaluate`), None when not given (the run's setting).
VERIFICATION_FLAGS = ("draft", "check_every_forward", "adaptive", "wide_cost")


def define_verification_flags() -> None:
  flags.DEFINE_enum(
    "draft",
    None,
    ["all", "rule", "none"],
    "Verified: draft every masked position, the rule's, none.",
  )
  flags.DEFINE_bool(
    "check_every_forward", None, "Verified: every forward checks its drafts (else per block)."
  )
  flags.DEFINE_bool(
    "adaptive", None, "Verified: each forward chosen by expected tokens per second (else widest)."
  )
  flags.DEFINE_float(
    "wide_cost",
    None,
    "Verified: a whole block's wide forward costs this many one-token forwards (0: measured).",
  )


def define_constraint_flags() -> None:
  """--regex, --json_schema, --choices: structured output (`SamplerSettings.constraint`)."""
  flags.DEFINE_string("regex", None, "Structured output: every answer matches this regex.")
  flags.DEFINE_string(
    "json_schema", None, "Structured output: every answer is JSON valid against this schema file."
  )
  flags.DEFINE_list("choices", None, "Structured output: every answer is one of these strings.")
  flags.DEFINE_bool(
    "forced_tokens", None, "Structured output, verified: masked drafts (forced tokens; default)."
  )


def constraint_setting() -> dict:
  """The structured-output flags as `SamplerSettings` overrides ({} without them); one
  constraint given at most, and a schema file that can be read (ValueError otherwise)."""
  f = flags.FLAGS
  forced = {} if f.forced_tokens is None else {"forced_tokens": f.forced_tokens}
  return {**_constraint(f), **forced}


def _constraint(f) -> dict:
  from sbd_jax.constrain.spec import Constraint

  given = [name for name in ("regex", "json_schema", "choices") if getattr(f, name) is not None]
  if len(given) > 1:
    raise ValueError(f"give one of --regex, --json_schema, --choices, not {given}")
  if f.regex is not None:
    return {"constraint": Constraint.regex(f.regex)}
  if f.choices is not None:
    return {"constraint": Constraint.choice(f.choices)}
  if f.json_schema is not None:
    try:
      with open(f.json_schema, encoding="utf-8") as fh:
        return {"constraint": Constraint.json_schema(fh.read())}
    except OSError as e:
      raise ValueError(f"--json_schema={f.json_schema}: {e.strerror}") from None
  return {}


def verification_settings() -> dict:
  """The verification flags' values, as `SamplerSettings` overrides."""
  return {name: getattr(flags.FLAGS, name) for name in VERIFICATION_FLAGS}
