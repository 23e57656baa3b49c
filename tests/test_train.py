"""End to end through the CLI: training runs, checkpoints, and a killed run resumes exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from xla_env import subprocess_env  # tests/ is on sys.path

pytestmark = pytest.mark.integration  # launches of the training CLI

TINY_OVERRIDES = [
  "--config.train.steps=8",
  "--config.train.batch_size=4",
  "--config.train.seq_len=64",
  "--config.train.log_every=1",
  "--config.checkpoint.every_steps=2",
  "--config.model.num_layers=1",
  "--config.model.embed_dim=32",
  "--config.model.num_heads=2",
  "--config.model.num_kv_heads=1",
  "--config.model.head_dim=16",
  "--config.model.mlp_dim=64",
  "--config.mesh.shape=(1,1,1)",
  "--noevaluate",
]


def train_command(workdir, *extra):
  return [
    sys.executable,
    "-m",
    "sbd_jax.train",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    *TINY_OVERRIDES,
    *extra,
  ]


def environment():
  return subprocess_env(1)


def losses_by_step(workdir):
  losses = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      losses.setdefault(record["step"], []).append(record["loss"])
  return losses


def run(cmd):
  result = subprocess.run(
    cmd,
    capture_output=True,
    text=True,
    env=environment(),
    cwd=os.path.dirname(os.path.dirname(__file__)),
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_killed_run_resumes_with_identical_batches_and_losses(tmp_path):
  reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
  run(train_command(reference_dir))
  reference = losses_by_step(reference_dir)
  assert sorted(reference) == list(range(1, 9))
  assert os.path.isdir(reference_dir / "params")

  process = subprocess.Popen(
    train_command(killed_dir),
    env=environment(),
    cwd=os.path.dirname(os.path.dirname(__file__)),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  deadline = time.time() + 300
  checkpoint = killed_dir / "checkpoints" / "4"
  while not (checkpoint / "_CHECKPOINT_METADATA").exists() and time.time() < deadline:
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  before_resume = losses_by_step(killed_dir)
  assert 8 not in before_resume, "the run finished before it could be killed"

  result = run(train_command(killed_dir))
  assert "resumed from the step-" in result.stdout + result.stderr
  resumed = losses_by_step(killed_dir)
  for step, values in resumed.items():
    for value in values:  # steps logged before the kill and again after resume agree too
      assert value == pytest.approx(reference[step][0], rel=1e-6, abs=1e-7), step
  assert sorted(resumed) == list(range(1, 9))

  from sbd_jax.training import metrics_plot

  records = metrics_plot.read_metrics(killed_dir)  # steps logged twice collapse to one record
  assert [r["step"] for r in records] == list(range(1, 9))
  png = metrics_plot.plot(records, str(tmp_path / "metrics.png"))
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_finished_run_is_not_retrained_and_reexports(tmp_path):
  run(train_command(tmp_path))
  records = sum(1 for _ in open(tmp_path / "metrics.jsonl"))
  result = run(train_command(tmp_path))
  assert sum(1 for _ in open(tmp_path / "metrics.jsonl")) == records
  assert "resumed from the step-8 checkpoint" in result.stdout + result.stderr


def test_a_resume_may_run_longer_but_not_with_another_number_of_data_workers(tmp_path):
  """The saved data-iterator state holds a position per worker process: grain cannot restore it
  into another number of workers, so that change is refused with the one-line config error."""
  from sbd_jax import config as config_lib
  from sbd_jax.run import workdir as workdir_lib

  c = config_lib.from_file(
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "tiny.py")
  )
  c.data.num_workers = 2
  workdir_lib.write_config(str(tmp_path), c)
  longer = config_lib.from_file(
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "tiny.py")
  )
  longer.data.num_workers, longer.train.steps = 2, c.train.steps * 2
  assert workdir_lib.resume_conflicts(str(tmp_path), longer) == []
  longer.data.num_workers = 3
  assert workdir_lib.resume_conflicts(str(tmp_path), longer) == ["data.num_workers: 2 -> 3"]


def run_failing(cmd):
  """Run a command expected to fail with a one-line error (no traceback)."""
  result = subprocess.run(
    cmd,
    capture_output=True,
    text=True,
    env=environment(),
    cwd=os.path.dirname(os.path.dirname(__file__)),
    timeout=300,
  )
  assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
  return result


def test_config_typo_fails_with_one_line_error(tmp_path):
  result = run_failing(
    [
      sys.executable,
      "-m",
      "sbd_jax.train",
      "--config=configs/tiny.py",
      f"--workdir={tmp_path}",
      "--config.sbd.k_mni=3",
    ]
  )
  assert "k_mni" in result.stderr
  assert not os.listdir(tmp_path)  # nothing written


def test_non_finite_loss_stops_one_line_and_never_saves_the_bad_state(tmp_path):
  """An absurd learning rate makes step 2's loss non-finite; checkpoints are every 2 steps, so
  the step-2 checkpoint would hold the bad state: it is not written, and the error names the
  term and the step."""
  result = run_failing(
    train_command(tmp_path, "--config.optim.lr=1e30", "--config.optim.clip_norm=0")
  )
  (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
  assert "non-finite" in line and any(t in line for t in ("ntp_loss", "matp_loss", "grad_norm"))
  bad_step = int(line.split("at step ")[1].split(";")[0])
  saved = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
  assert saved and all(s < bad_step for s in saved), (saved, bad_step)
  assert not os.path.isdir(tmp_path / "params")


def test_bad_data_is_one_line_naming_file_and_line(tmp_path):
  data = tmp_path / "data.jsonl"
  data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": 7}\n')
  result = run_failing(
    train_command(tmp_path / "run", "--config.data.source=jsonl", f"--config.data.paths={data}")
  )
  assert f"error: {data}:2: field 'completion' is int, expected a string" in result.stderr
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_sigterm_saves_stops_cleanly_and_the_next_launch_resumes(tmp_path):
  """What a TPU maintenance event or spot preemption sends: the run checkpoints the step it
  reached, exits 0 with a line saying where, and the same command resumes from there."""
  cmd = train_command(tmp_path, "--config.train.steps=20", "--config.checkpoint.every_steps=100")
  process = subprocess.Popen(
    cmd,
    env=environment(),
    cwd=os.path.dirname(os.path.dirname(__file__)),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  deadline = time.time() + 300
  metrics = tmp_path / "metrics.jsonl"
  while time.time() < deadline and (
    not metrics.exists() or len(metrics.read_text().splitlines()) < 3
  ):
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  output, _ = process.communicate(timeout=300)
  assert process.returncode == 0, output[-2000:]
  (line,) = [x for x in output.splitlines() if "stopped at step" in x]
  stopped = int(line.split("stopped at step ")[1].split()[0])
  assert 3 <= stopped < 20 and "SIGTERM" in line
  assert (tmp_path / "checkpoints" / str(stopped)).is_dir()
  assert not (tmp_path / "params").exists()  # not finished: nothing exported
  result = run(cmd)
  assert f"resumed from the step-{stopped} checkpoint" in result.stdout + result.stderr
  assert (tmp_path / "params").is_dir()
  # The interrupted and resumed run logs the losses of an uninterrupted one, step by step.
  run(train_command(tmp_path / "straight", "--config.train.steps=20"))
  resumed, straight = losses_by_step(tmp_path), losses_by_step(tmp_path / "straight")
  assert sorted(resumed) == sorted(straight) == list(range(1, 21))
  for step, losses in straight.items():
    assert resumed[step] == losses, step


def test_time_budget_stops_after_a_step_and_saves(tmp_path):
  result = run(train_command(tmp_path, "--config.train.max_hours=1e-9"))
  assert "stopped at step 1 (train.max_hours reached)" in result.stdout + result.stderr
  assert (tmp_path / "checkpoints" / "1").is_dir()


def test_a_torn_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
  """Delete the array files of the newest checkpoint (a host died mid-save): the next launch
  warns, naming it, resumes from the one before, and reaches the same losses."""
  import shutil

  run(train_command(tmp_path))
  reference = losses_by_step(tmp_path)
  newest = tmp_path / "checkpoints" / "8" / "state"
  for entry in newest.iterdir():
    if entry.name != "_METADATA" and not entry.name.startswith("_"):
      shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
  result = run(train_command(tmp_path))
  output = result.stdout + result.stderr
  assert "checkpoint 8 could not be restored" in output
  assert "resumed from the step-6 checkpoint" in output
  for step, values in losses_by_step(tmp_path).items():
    assert values[-1] == pytest.approx(reference[step][0], rel=1e-6, abs=1e-7), step


def test_no_restorable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
  import shutil

  run(train_command(tmp_path))
  for step_dir in (tmp_path / "checkpoints").iterdir():
    if step_dir.name.isdigit():
      shutil.rmtree(step_dir / "state")
  result = subprocess.run(
    train_command(tmp_path),
    capture_output=True,
    text=True,
    env=environment(),
    cwd=os.path.dirname(os.path.dirname(__file__)),
    timeout=300,
  )
  assert result.returncode != 0 and "could be restored" in result.stderr
  assert "Traceback" not in result.stderr
