"""A server in a child process on a free loopback port: for tests and the load benchmark."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerProcess:
  """`python -m sbd_jax.serve --workdir=... <flags>`, started and waited for (/health)."""

  def __init__(self, workdir: str, *flags: str, env: dict | None = None, start_s: float = 300):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    command = [sys.executable, "-m", "sbd_jax.serve", f"--workdir={workdir}", f"--port={self.port}"]
    self.proc = subprocess.Popen(
      [*command, *flags],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f"server exited: {self.proc.stdout.read()[-3000:]}")
      try:
        self.health()
        return
      except OSError:
        time.sleep(0.5)
    self.proc.kill()
    raise RuntimeError(f"server did not start within {start_s:.0f} s")

  def health(self) -> dict:
    with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
      return json.loads(r.read())

  def post(self, path: str, body: bytes, timeout: float = 300) -> tuple[int, dict]:
    """(status, JSON reply) of a raw POST."""
    request = urllib.request.Request(
      self.url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
      with urllib.request.urlopen(request, timeout=timeout) as r:
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())

  def stop(self, timeout: float = 120) -> int:
    """SIGTERM, then the exit status (killed if it does not exit within `timeout`)."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
