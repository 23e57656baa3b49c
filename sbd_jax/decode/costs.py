"""What a verified decode's forwards cost on the device that decodes, one table per compiled
program: the table `policy` chooses each forward by (`policy.Tuning.cost_K`).

`measure` times the very program that will decode, run with every forward of one kind
(`policy.Tuning.force`: NTP's one-token forward, or a wide forward of each draft width), every
draft rejected (`policy.Tuning.reject`: one token a forward, so a call makes as many forwards
whatever its drafts, in every row; accepted drafts would leave a wide kind a few forwards to
time) and no row ending at an EOS. A forward of a kind costs the difference
between a call that generates `TIMED_TOKENS` tokens and one that generates one, over the
forwards between them (the prefill and the call's own cost cancel), from the fastest calls of a
few rounds that alternate the kinds (load on a shared machine only adds time). After the first
round each kind is timed for about as long as the dearest, the cheap ones repeated: the host's
jitter in a call (about a millisecond on a CPU) then weighs alike on every kind, NTP's included,
whose cost divides all the others. So the table holds what the loop pays for a forward of each
kind at the program's batch size (its check and reveal included), on this device. A table is
kept in memory for the process and, where JAX's persistent compilation cache is on
(`sbd_jax.compile_cache`), as a JSON file beside the compiled programs, so that a restart reuses
it (`table_for`). With `SamplerSettings.wide_cost` >= 1 nothing is measured (`fixed`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sbd_jax import paths
from sbd_jax.decode import acceptance_prior, policy
from sbd_jax.decode.settings import SamplerSettings

log = logging.getLogger(__name__)

TIMED_TOKENS = 32  # tokens (forwards) a timed call generates (fewer where the rows hold fewer)
# Rounds of timed calls: at most, and the time after which no more start; the most calls of one
# kind in a round. At batch 1 on a 2-core CPU, paper_small's one-token forward costs 0.18 ms,
# against about a millisecond of jitter per call, and a call of the same work takes up to twice
# as long from one second to the next: its tables differ by about 15 % from one measurement to
# the next (BENCHMARKS.md, "How precise a cost table is").
ROUNDS, BUDGET_S, MAX_REPEATS = 9, 3.0, 8
SUBDIR = "sbd_decode_costs"  # under the compilation cache's directory


@dataclasses.dataclass(frozen=True)
class CostTable:
  """What a forward of each kind costs one program: NTP's one-token forward, then a wide
  forward of each draft width (2D tokens a row)."""

  kinds: tuple[str, ...]  # "ntp", "2x2", "2x4", ... (`kind_names`)
  seconds: tuple[float, ...]  # per forward of each kind; relative costs where not measured
  rows: int  # the program's batch size
  source: str  # "measured", "reused" (from the file of an earlier measurement), or "wide_cost=X"
  device: str

  @property
  def cost_K(self) -> np.ndarray:
    """float32 [K]: each kind's cost in NTP forwards (`policy.Tuning.cost_K`)."""
    return np.asarray(self.seconds, np.float32) / np.float32(self.seconds[0])

  def describe(self) -> str:
    """One line: `ntp 0.21 ms, 2x2 0.31 ms (1.48x), ...` (measured) or the relative costs."""
    measured = self.source in ("measured", "reused")
    parts = []
    for name, seconds, cost in zip(self.kinds, self.seconds, self.cost_K):
      here = f"{seconds * 1e3:.3g} ms" if measured else ""
      parts.append(f"{name} {here}{'' if name == 'ntp' else f' ({cost:.2f}x)'}".replace("  ", " "))
    return f"{self.rows} rows on {self.device} ({self.source}): " + ", ".join(parts)

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def kind_names(s: SamplerSettings) -> tuple[str, ...]:
  """The kinds of forward a verified decode chooses between: `ntp`, and `2xD` per width D."""
  return ("ntp", *(f"2x{d}" for d in s.draft_widths))


def device_name() -> str:
  d = jax.devices()[0]
  return f"{jax.device_count()}x {d.device_kind}" if jax.device_count() > 1 else d.device_kind


def fixed(s: SamplerSettings, rows: int) -> CostTable:
  """Costs from `s.wide_cost` (>= 1): a wide forward of the whole block (2P tokens a row) costs
  that many one-token forwards, a narrower one in proportion to its extra tokens. 0 (measured)
  reads as 1 here: every kind costs the same."""
  wide = max(s.wide_cost, 1.0)
  p = s.block_size
  relative = [1.0] + [1.0 + (wide - 1.0) * (2 * d - 1) / (2 * p - 1) for d in s.draft_widths]
  return CostTable(kind_names(s), tuple(relative), rows, f"wide_cost={wide:g}", device_name())


def measure(run: Callable[[int, int], tuple[float, int]], s: SamplerSettings, rows: int):
  """Time each kind of forward (module docstring). `run(kind, limit)` runs the program with
  every forward of `kind`, its rows generating `limit` tokens, and returns (seconds, forwards).
  A kind's cost is the difference of its fastest long and fastest short call over the forwards
  between them: load on a shared machine only adds time, so the fastest calls are the least
  disturbed. Where noise leaves that at or below 0, the fastest long call over its forwards
  (an upper bound) stands in."""
  kinds = kind_names(s)
  long = min(TIMED_TOKENS, s.max_new_tokens)
  if long < 2:
    return fixed(s.replace(wide_cost=1.0), rows)  # nothing to time: a single token
  for kind in range(len(kinds)):
    run(kind, 1)  # the first call compiles; every call after it times the program alone
  short: list[list[tuple[float, int]]] = [[] for _ in kinds]
  calls: list[list[tuple[float, int]]] = [[] for _ in kinds]
  repeats_K = np.ones(len(kinds), int)
  start = time.perf_counter()
  for _ in range(ROUNDS):
    for kind in range(len(kinds)):
      for _ in range(repeats_K[kind]):
        short[kind].append(run(kind, 1))
        calls[kind].append(run(kind, long))
    # From the next round, each kind for about as long as the dearest, by the fastest calls.
    span_K = np.asarray([min(c)[0] + min(sh)[0] for c, sh in zip(calls, short)])
    repeats_K = np.clip(np.round(span_K.max() / np.maximum(span_K, 1e-9)), 1, MAX_REPEATS)
    repeats_K = _from_process_0(repeats_K.astype(int))
    # Every process of a multi-host program makes the same calls (each is one SPMD program),
    # so none stops early on its own clock.
    if jax.process_count() == 1 and time.perf_counter() - start > BUDGET_S:
      break
  seconds = []
  for kind in range(len(kinds)):
    (t_long, f_long), (t_short, f_short) = min(calls[kind]), min(short[kind])
    per_forward = (t_long - t_short) / max(f_long - f_short, 1)
    seconds.append(per_forward if per_forward > 0 else t_long / max(f_long, 1))
  table = CostTable(kinds, tuple(seconds), rows, "measured", device_name())
  timed = ", ".join(f"{len(c)}" for c in calls)
  log.info(
    "decode costs timed in %.1f s (calls of each kind: %s): %s",
    time.perf_counter() - start,
    timed,
    table.describe(),
  )
  return table


@functools.lru_cache(maxsize=1024)  # a decode asks once per call
def program_key(*parts: Any) -> str:
  """A stable name for one compiled program on this runtime: its parts' reprs (model config,
  settings, shapes), the devices, JAX's version and this package's code (`code_digest`),
  hashed."""
  text = repr((parts, device_name(), jax.default_backend(), jax.__version__, code_digest()))
  return hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.cache
def code_digest() -> str:
  """A hash of the sources of the `sbd_jax` package: a table measured by other code (an upgrade,
  an edited loop) is measured again, not reused."""
  root = pathlib.Path(__file__).resolve().parents[1]
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()[:16]


_TABLES: dict[str, CostTable] = {}


def table_for(
  key: str, s: SamplerSettings, rows: int, run: Callable[[int, int], tuple[float, int]]
) -> CostTable:
  """The cost table of the program `key`: fixed by `s.wide_cost`, else this process's earlier
  measurement, else the file beside the compilation cache, else measured now (and kept in
  both). Every process of a multi-host decode uses process 0's table (the choice of each
  forward is part of one SPMD program)."""
  if s.wide_cost >= 1:
    return fixed(s, rows)
  if key in _TABLES:
    return _TABLES[key]
  table = _read(key)
  if table is None:
    table = _agree(measure(run, s, rows))
    _write(key, table)
  else:
    log.info("decode costs reused: %s", table.describe())
  _TABLES[key] = table
  return table


def forced(s: SamplerSettings, kind: int) -> policy.Tuning:
  """The tuning that runs every forward of `kind`, ignoring EOS and rejecting every draft (one
  token a forward): a program timed (`measure`)."""
  ones_K = np.ones(len(kind_names(s)), np.float32)
  return policy.Tuning.of(ones_K, force=kind, block_size=s.block_size, reject=True)


def tuning(s: SamplerSettings, rows: int, key: str, run, prior: acceptance_prior.Prior):
  """(the tuning of the program `key` of `rows` rows, its cost table): where `s` chooses its
  forwards, its costs (`table_for`: measured through `run`, once per program) and `prior`;
  else every kind at one cost, and no table."""
  p = s.block_size
  if not s.chooses_forwards:
    return policy.Tuning.of(np.ones(len(kind_names(s)), np.float32), block_size=p), None
  table = table_for(key, s, rows, run)
  prior_P = prior.by_position(p)
  return policy.Tuning.of(table.cost_K, prior_P, learned=prior.learned, block_size=p), table


def _agree(table: CostTable) -> CostTable:
  """Process 0's measurement on every process."""
  seconds = _from_process_0(np.asarray(table.seconds, np.float64))
  return dataclasses.replace(table, seconds=tuple(float(x) for x in seconds))


def _from_process_0(values: np.ndarray) -> np.ndarray:
  """Process 0's values on every process: each makes the same calls (one SPMD program) and
  chooses the same forwards."""
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.broadcast_one_to_all(values))


def cache_directory() -> str | None:
  """Where the tables are kept: JAX's persistent compilation cache's directory, if one is set."""
  return jax.config.jax_compilation_cache_dir or None


def _path(key: str):
  directory = cache_directory()
  return None if directory is None else paths.resolve(directory) / SUBDIR / f"{key}.json"


def _read(key: str) -> CostTable | None:
  path = _path(key)
  if path is None or not path.exists():
    return None
  try:
    fields = json.loads(path.read_text())
    table = CostTable(**{**fields, "kinds": tuple(fields["kinds"])})
    table = dataclasses.replace(table, seconds=tuple(table.seconds), source="reused")
  except (ValueError, TypeError, KeyError):
    return None  # a torn or foreign file: measure again
  return table


def _write(key: str, table: CostTable) -> None:
  path = _path(key)
  if path is None or jax.process_index() != 0:
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.parent / f"{key}.json.partial"
  partial.write_text(json.dumps(table.as_dict(), indent=1))
  partial.rename(path)
