"""The paper's Table 1 at small scale: `python -m sbd_jax.benchmarks.table1` (`run`)."""
