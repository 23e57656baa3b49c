"""Two processes x 4 CPU devices form one 8-device mesh through jax.distributed."""

import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(__file__))


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_process_training_shares_one_mesh_and_checkpoint(tmp_path):
  port = free_port()
  command = [
    sys.executable,
    "-m",
    "sbd_jax.train",
    "--config=configs/tiny.py",
    f"--workdir={tmp_path}",
    "--config.mesh.shape=(2,2,2)",
    "--config.train.steps=3",
    "--config.train.batch_size=8",
    "--config.train.seq_len=64",
    "--config.train.log_every=1",
    "--config.checkpoint.every_steps=2",
    "--config.model.num_layers=1",
    "--noevaluate",
  ]
  processes = []
  for i in range(2):
    env = dict(
      os.environ,
      XLA_FLAGS="--xla_force_host_platform_device_count=4",
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES="2",
      JAX_PROCESS_ID=str(i),
      SBD_CPU_COLLECTIVES="gloo",
    )
    processes.append(
      subprocess.Popen(
        command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
      )
    )
  outputs = [p.communicate(timeout=600)[0] for p in processes]
  for p, out in zip(processes, outputs):
    assert p.returncode == 0, out[-3000:]
  assert "'data': 2, 'fsdp': 2, 'tensor': 2" in outputs[0]
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records] == [1, 2, 3]  # host 0 writes metrics once per step
  # Each process checkpoints its own data-iterator position inside the shared step.
  data_iter_files = os.listdir(tmp_path / "checkpoints" / "2" / "data_iter")
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data_iter_files)
  assert os.path.isdir(tmp_path / "params")
