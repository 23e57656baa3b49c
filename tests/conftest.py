import os
import pathlib
import shutil

from xla_env import xla_flags  # tests/ is on sys.path

# Multi-device tests run on 8 simulated CPU devices, compiled at -O0 (xla_env.py); must be set
# before JAX starts.
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
# The suite runs on the CPU. With libtpu installed (the [test] extra: tests/test_aot.py
# compiles for TPU slices, which works with this set), JAX would otherwise look for a TPU in
# every process and print libtpu's start-up warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for every pytest run on this checkout, shared with the
# CLI subprocesses the tests start: the many short runs of the same tiny configs compile each
# program once, and the integration tier (a second run) loads what the unit tier compiled
# from the same fixtures. XLA keys an entry by the program, its options and the JAX version, so
# a stale entry is never loaded; the decode cost tables kept beside it are keyed by this
# package's code as well (`decode.costs.program_key`). Both tiers write a few hundred MB.
# JAX's own size limit would scan the directory at every entry written (thousands a run),
# so a run's first process empties it once it passes CACHE_LIMIT_BYTES instead;
# `pytest --cache-clear` empties it too.
CACHE_LIMIT_BYTES = 2 << 30
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(repo, ".pytest_cache", "jax_cache")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  if "PYTEST_XDIST_WORKER" not in os.environ:  # pytest's own process, before its workers
    cache = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) > CACHE_LIMIT_BYTES:
      shutil.rmtree(cache, ignore_errors=True)

import pytest  # noqa: E402


@pytest.fixture
def tiny_train_config():
  """A factory of configs for in-process training runs of a few seconds (byte vocabulary,
  one layer of width 32, a row per device of the 8-device test mesh, no evaluation)."""
  from sbd_jax import config

  def make(steps: int = 6):
    c = config.base_config()
    c.model.update(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16)
    c.model.update(mlp_dim=64, vocab_size=264)
    c.train.update(steps=steps, batch_size=8, seq_len=64, log_every=1, progress_bar=False)
    c.checkpoint.update(every_steps=1000, keep=10, async_save=False)  # the final save only
    c.optim.warmup_steps = 1
    return c

  return make


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's in-memory compilation caches after each test file. Every program a jitted
  function compiles stays loaded while its cache holds it, and XLA:CPU maps a few memory regions
  for each: one worker that runs hundreds of test files' programs reaches the kernel's limit on
  a process's mappings (vm.max_map_count, 65,530 by default) and dies in a compile (SIGSEGV).
  The persistent cache keeps serving the programs later files compile again."""
  yield
  import jax

  jax.clear_caches()
