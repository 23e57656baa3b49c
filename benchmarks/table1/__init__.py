"""The paper's Table 1 at small scale: `python -m benchmarks.table1` (`run`)."""
