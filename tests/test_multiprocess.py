"""Two processes x 4 CPU devices form one 8-device mesh through jax.distributed."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from xla_env import subprocess_env  # tests/ is on sys.path

pytestmark = pytest.mark.integration  # two processes joined by jax.distributed

REPO = os.path.dirname(os.path.dirname(__file__))


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(command, port=None, merge_stderr=True):
  """The two processes of one job (4 CPU devices each), output merged per process."""
  port = port or free_port()
  processes = []
  for i in range(2):
    env = subprocess_env(
      4,
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES="2",
      JAX_PROCESS_ID=str(i),
      SBD_CPU_COLLECTIVES="gloo",
    )
    processes.append(
      subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
      )
    )
  return processes


def outputs_of(processes, first_lines=("", "")):
  """The merged outputs of `launch`ed processes once they exit (`first_lines`: what the test read
  of each before), each also printed whole under its exit status: pytest shows a failed test's
  prints, so a failure names its cause (a collective's timeout, a coordinator's error) whichever
  process met it."""
  outputs = [lines + p.communicate(timeout=600)[0] for p, lines in zip(processes, first_lines)]
  for i, (p, out) in enumerate(zip(processes, outputs)):
    print(f"===== process {i} exited {p.returncode} =====\n{out}")
  return outputs


def run_two_processes(command):
  """Run `command` as a two-process job; the stdouts of processes 0 and 1."""
  processes = launch(command, merge_stderr=False)
  outputs = [p.communicate(timeout=600) for p in processes]
  for p, (_, err) in zip(processes, outputs):
    assert p.returncode == 0, err[-3000:]
  return [out for out, _ in outputs]


def printed_json(stdout):
  """The JSON document a CLI printed (`--json`, indented) amid gloo's connection notes, which
  go to the same stdout, unsynchronised."""
  lines = stdout.splitlines()
  first = next(i for i, line in enumerate(lines) if line in ("[", "{"))
  return json.loads("\n".join(lines[first:]))


def run_one_process(command, devices=8):
  """Run `command` in one process with `devices` CPU devices; its stdout."""
  env = subprocess_env(devices)
  done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def train_command(workdir, *extra, mesh="(2,2,2)"):
  """The tiny config on a mesh (by default (2, 2, 2)) over both processes' 8 devices."""
  return [
    sys.executable,
    "-m",
    "sbd_jax.train",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    f"--config.mesh.shape={mesh}",
    "--config.train.batch_size=8",
    "--config.train.seq_len=64",
    "--config.train.log_every=1",
    "--config.model.num_layers=1",
    "--noevaluate",
    *extra,
  ]


def test_two_process_training_shares_one_mesh_and_checkpoint(tmp_path):
  port = free_port()
  command = train_command(tmp_path, "--config.train.steps=3", "--config.checkpoint.every_steps=2")
  processes = launch(command, port)
  outputs = outputs_of(processes)
  assert [p.returncode for p in processes] == [0, 0]
  assert "'data': 2, 'fsdp': 2, 'tensor': 2" in outputs[0]
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records] == [1, 2, 3]  # host 0 writes metrics once per step
  # Each process checkpoints its own data-iterator position inside the shared step.
  data_iter_files = os.listdir(tmp_path / "checkpoints" / "2" / "data_iter")
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data_iter_files)
  assert os.path.isdir(tmp_path / "params")

  # The model now spans both processes' devices: sampling (a queue through refilled rows) and
  # evaluation (batches) decode on both, in step, and the lead prints the same as one process
  # holding all 8 devices on the same mesh.
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("Q: Tom has 12 apples.\nQ: A jar holds 31 coins and 4 more.\n")
  for command in (
    [sys.executable, "-m", "sbd_jax.sample", f"--workdir={tmp_path}", f"--prompts_file={prompts}",
     "--max_new_tokens=12", "--refill", "--json"],
    [sys.executable, "-m", "sbd_jax.evaluate", f"--workdir={tmp_path}", "--num_problems=3",
     "--gammas=0.35", "--max_new_tokens=8", "--json"],
  ):  # fmt: skip
    lead, other = run_two_processes(command)
    assert printed_json(lead) == json.loads(run_one_process(command))
    assert not any(line in ("[", "{") for line in other.splitlines())  # only the lead prints

  # Resumed by one process holding all 8 devices (the same mesh): each process saved the data
  # positions of its own row slices, which one process cannot take over; refused in one line,
  # the checkpoints untouched.
  before = {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()}
  done = subprocess.run(
    train_command(tmp_path, "--config.train.steps=5"), env=subprocess_env(8), cwd=REPO,
    capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1] == (
    f"error: {tmp_path}'s checkpoints hold data positions for 2 process(es) x 4 row shards "
    "(data x fsdp); this run has 1 process(es) x 4 row shards: resume with the same process "
    "count and data x fsdp, or train in a new workdir"
  )
  after = {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()}
  assert after == before


@pytest.mark.parametrize("mesh", ["(1,1,8)", "(1,8,1)"], ids=["tensor", "fsdp"])
def test_each_process_feeds_the_rows_of_the_slices_its_devices_hold(tmp_path, mesh):
  """Two processes x 4 devices train the same per-step losses as one process with all 8
  devices on the same mesh and batch: with the tensor axis across the processes (both hold the
  whole batch, and must feed identical rows) and with fsdp across them (each holds half). The
  held-out evaluation, on every process, gives the same losses too."""
  losses, heldout = {}, {}
  for name, run in (("two", run_two_processes), ("one", run_one_process)):
    workdir = tmp_path / name
    run(train_command(workdir, "--config.train.steps=3", "--config.train.eval_every=3", mesh=mesh))
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    losses[name] = [(r["step"], r["ntp_loss"], r["matp_loss"]) for r in records if "loss" in r]
    heldout[name] = [
      (r["step"], r["heldout/ntp_loss"], r["heldout/matp_loss_mask1"])
      for r in records
      if "heldout/ntp_loss" in r
    ]
  assert [s for s, *_ in losses["two"]] == [1, 2, 3]
  np.testing.assert_allclose(np.asarray(losses["two"]), np.asarray(losses["one"]), rtol=1e-5)
  assert [s for s, *_ in heldout["two"]] == [3]
  np.testing.assert_allclose(np.asarray(heldout["two"]), np.asarray(heldout["one"]), rtol=1e-5)


def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes(tmp_path):
  """JAX's preemption service sees SIGTERM on process 1, both agree on a step, save it and exit
  0; the same command resumes both from it (and compiles the SBD step, which the first run, in
  its NTP phase, never ran)."""
  command = train_command(tmp_path, "--config.checkpoint.every_steps=1000")
  first, second = launch([*command, "--config.train.steps=1000"], free_port())
  read = ""
  for line in first.stdout:  # host 0 logs every step; preempt process 1 once training runs
    read += line
    if line.startswith("step      3 "):
      second.send_signal(signal.SIGTERM)
      break
  outputs = outputs_of([first, second], (read, ""))
  assert [first.returncode, second.returncode] == [0, 0]
  (stopped,) = re.findall(r"stopped at step (\d+) \(preemption", outputs[0])
  saved = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
  assert saved == [int(stopped)] and 3 <= int(stopped) < 1000

  resumed = launch([*command, f"--config.train.steps={int(stopped) + 2}"], free_port())
  outputs = outputs_of(resumed)
  assert [p.returncode for p in resumed] == [0, 0]
  assert f"resumed from the step-{stopped} checkpoint" in outputs[0]
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records][-2:] == [int(stopped) + 1, int(stopped) + 2]


# Process 1 takes this much longer than process 0 to compile the program below: more than the
# 30 s gloo waits for every process to connect at a program's first collective.
LATE_S = 45

COMPILED_LATE_ON_PROCESS_1 = f"""
import time
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from sbd_jax import distributed

distributed.maybe_initialize()
mesh = jax.make_mesh((8,), ("x",))

def total(x):
  if jax.process_index() == 1:  # while tracing, within the compile
    time.sleep({LATE_S})
  return x.sum()  # an all-reduce over both processes' devices

x = np.arange(4.0) + 4 * jax.process_index()  # this process's half of 0..7
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), x, (8,))
program = jax.jit(total, out_shardings=NamedSharding(mesh, P()))
print("total", float(distributed.compiled_on_every_process(program, "total", x)(x)))
"""


def test_a_program_one_process_compiles_long_after_the_other_runs_on_both():
  """Each process compiles a program for itself; one finishing LATE_S after the other (a loaded
  machine, or the persistent cache serving process 0 only) must not leave the other waiting for
  it in the program's first collective, where gloo gives up after 30 s."""
  processes = launch([sys.executable, "-c", COMPILED_LATE_ON_PROCESS_1])
  outputs = outputs_of(processes)
  assert [p.returncode for p in processes] == [0, 0]
  assert ["total 28.0" in out for out in outputs] == [True, True]  # 0 + 1 + ... + 7


def test_how_a_process_joins_the_job(monkeypatch):
  """Explicit coordinator env > a cluster JAX discovers (Cloud TPU VM chips, multislice,
  SLURM) > a single process; a TPU VM needs no TPU_WORKER_HOSTNAMES to count as a cluster."""
  from sbd_jax import distributed

  for name in ("JAX_COORDINATOR_ADDRESS", *distributed._CLUSTER_ENV):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(distributed, "_TPU_DEVICE_FILES", ("/nonexistent/accel*",))
  assert distributed.initialize_mode() == "single"
  monkeypatch.setattr(distributed, "_TPU_DEVICE_FILES", (os.path.join(REPO, "setup.p[y]"),))
  assert distributed.initialize_mode() == "auto"  # stands in for /dev/accel0
  monkeypatch.setattr(distributed, "_TPU_DEVICE_FILES", ("/nonexistent/accel*",))
  monkeypatch.setenv("MEGASCALE_COORDINATOR_ADDRESS", "10.0.0.2:8080")
  assert distributed.initialize_mode() == "auto"
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
  assert distributed.initialize_mode() == "explicit"
