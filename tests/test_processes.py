"""`benchmarks.processes.starmap`: results in the order of the calls, from other processes when
jobs > 1, with memory preallocation off in them, and a bad job count refused."""

import operator
import os

import pytest

from benchmarks import processes


def test_parallel_calls_run_elsewhere_and_keep_their_order(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  calls = [(a, b) for a, b in zip(range(5), range(10, 15))]
  assert list(processes.starmap(operator.add, calls, jobs=2)) == [10, 12, 14, 16, 18]
  pids = set(processes.starmap(os.getpid, [()] * 4, jobs=2))
  assert os.getpid() not in pids and 1 <= len(pids) <= 2
  env = processes.starmap(os.getenv, [("XLA_PYTHON_CLIENT_PREALLOCATE",)], jobs=2)
  assert list(env) == ["false"]


def test_one_job_runs_here_in_order():
  assert list(processes.starmap(os.getpid, [()] * 2)) == [os.getpid()] * 2
  with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
    list(processes.starmap(os.getpid, [()], jobs=0))
