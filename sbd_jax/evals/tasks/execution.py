"""Runs model-written Python programs (HumanEval / MBPP tests) in a separate, limited process.

Each program runs in a fresh `python -I` child, never in the evaluating process:

* its own session and an empty temporary working directory, deleted afterwards;
* an environment holding only PATH (no secrets inherited from ours);
* resource limits (set by the child before the program is read): CPU seconds, address space,
  file size, open files;
* a wall-clock limit, after which the child's whole process group is killed;
* a guard installed before the program runs: file opens outside the working directory, process
  creation, signals and file deletion raise `PermissionError` (the standard harnesses disable
  the same functions). The program runs from source text with `exec`, so it cannot undo the
  guard by re-importing a patched module from disk.

This stops accidents (a test that deletes files, forks or hangs), not a determined attacker: for
untrusted models at scale, run the evaluation inside a container or VM as well.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

PASSED, FAILED, TIMEOUT = "passed", "failed", "timeout"

# Runs in the child before the program: confine opens to the working directory and disable
# process creation, signals and deletion. `__program__` is the program's source text.
_GUARD = r"""
import builtins, io, os, resource, shutil, subprocess, sys
for _kind, _value in zip(
    (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE,
     resource.RLIMIT_CORE), map(int, sys.argv[1:6])):
  resource.setrlimit(_kind, (_value, _value))
_source = sys.stdin.read()
_root = os.path.realpath(os.getcwd())
_open = builtins.open
_os_open = os.open

def _inside(path):
  if isinstance(path, int):
    return True  # an already open descriptor
  full = os.path.realpath(os.fspath(path))
  return full == _root or full.startswith(_root + os.sep)

def _guarded_open(file, *args, **kwargs):
  if not _inside(file):
    raise PermissionError(f"sandbox: no access to {file!r}")
  return _open(file, *args, **kwargs)

def _guarded_os_open(path, *args, **kwargs):
  if not _inside(path):
    raise PermissionError(f"sandbox: no access to {path!r}")
  return _os_open(path, *args, **kwargs)

def _refuse(name):
  def refused(*args, **kwargs):
    raise PermissionError(f"sandbox: {name} is disabled")
  return refused

builtins.open = io.open = _guarded_open
os.open = _guarded_os_open
for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "remove", "unlink",
              "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod",
              "chown", "putenv", "execv", "execve", "execvp", "execvpe", "spawnv", "spawnve",
              "setuid", "setgid", "chdir", "fchdir", "symlink", "link"):
  if hasattr(os, _name):
    setattr(os, _name, _refuse("os." + _name))
shutil.rmtree = shutil.move = _refuse("shutil")
subprocess.Popen = subprocess.run = subprocess.call = _refuse("subprocess")
os.environ.clear()
del _name, _kind, _value
exec(compile(_source, "<program>", "exec"), {"__name__": "__main__"})
"""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one program may use. Memory is address space, so it counts shared libraries too."""

  timeout_s: float = 10.0  # wall clock
  cpu_s: int = 10
  memory_mb: int = 1024
  file_size_mb: int = 16
  open_files: int = 64


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class Result:
  status: str  # PASSED, FAILED or TIMEOUT
  detail: str = ""  # the last line of the child's stderr when it failed

  @property
  def passed(self) -> bool:
    return self.status == PASSED


def _limit_args(limits: Limits) -> list[str]:
  """The guard's argv: CPU s, address space, file size, open files, core size (bytes)."""
  mb = 1024 * 1024
  values = (limits.cpu_s, limits.memory_mb * mb, limits.file_size_mb * mb, limits.open_files, 0)
  return [str(int(v)) for v in values]


def run_program(program: str, limits: Limits = DEFAULT_LIMITS) -> Result:
  """Runs `program` (Python source) in a limited child; PASSED iff it exits with status 0."""
  with tempfile.TemporaryDirectory(prefix="sbd_exec_") as workdir:
    child = subprocess.Popen(
      [sys.executable, "-I", "-B", "-c", _GUARD, *_limit_args(limits)],
      stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      cwd=workdir,
      env={"PATH": os.defpath},
      start_new_session=True,  # its own process group, killed as a whole
    )
    try:
      _, stderr = child.communicate(program.encode("utf-8"), timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
      _kill_group(child)
      return Result(TIMEOUT, f"killed after {limits.timeout_s:g} s")
    finally:
      _kill_group(child)  # anything the program left running in its session
    if child.returncode == 0:
      return Result(PASSED)
    lines = stderr.decode("utf-8", errors="replace").strip().splitlines()
    return Result(FAILED, lines[-1] if lines else f"exit status {child.returncode}")


def _kill_group(child: subprocess.Popen) -> None:
  try:
    os.killpg(child.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  child.wait()


def run_programs(
  programs: Sequence[str], limits: Limits = DEFAULT_LIMITS, workers: int | None = None
) -> list[Result]:
  """`run_program` over many programs, `workers` children at a time (default: CPU count)."""
  workers = workers or os.cpu_count() or 1
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda p: run_program(p, limits), programs))
