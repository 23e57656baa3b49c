"""A run whose workdir, training data and init_from live in a bucket (gs://), against a GCS
emulator on a loopback port (`gcs_emulator`): nothing may land in a local "gs:" directory."""

import json
import os
import signal
import tempfile
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from gcs_emulator import download, listing, serve  # tests/ is on sys.path
from tensorboard.backend.event_processing import event_accumulator

from sbd_jax import compile_cache
from sbd_jax.data import to_array_record
from sbd_jax.evals import workdir_eval
from sbd_jax.hf import exporter
from sbd_jax.run import compare
from sbd_jax.training import dashboards, stopping, trainer

pytestmark = pytest.mark.integration  # a whole run against a GCS emulator


@pytest.fixture
def bucket(monkeypatch):
  cache = jax.config.jax_compilation_cache_dir  # the suite's (conftest.py); the run moves it
  with serve(monkeypatch) as root:
    yield root
  compile_cache.enable(cache)


class SigtermAfter(stopping.StopRequest):
  """The real SIGTERM handler, sent the signal once step `STEP` is done."""

  STEP = 3

  def should_stop(self, step: int) -> bool:
    if step == self.STEP:
      signal.raise_signal(signal.SIGTERM)
    return super().should_stop(step)


def losses_by_step(workdir):
  losses = {}
  for line in epath.Path(workdir, "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    losses.setdefault(record["step"], []).append(record["loss"])
  return losses


def params_leaves(path):
  with ocp.StandardCheckpointer() as checkpointer:
    return [np.asarray(x) for x in jax.tree.leaves(checkpointer.restore(path))]


def write_shards(tmp_path, root):
  """Prompt/completion records as two ArrayRecord shards, uploaded to <root>/data/."""
  jsonl = tmp_path / "data.jsonl"
  lines = [json.dumps({"prompt": f"copy {i}:", "completion": f" {i} apples."}) for i in range(48)]
  jsonl.write_text("\n".join(lines) + "\n")
  shards = to_array_record.convert([str(jsonl)], str(tmp_path / "shards" / "train"), 2)
  for shard in shards:
    epath.Path(root, "data", os.path.basename(shard)).write_bytes(open(shard, "rb").read())
  return f"{root}/data/train-*-of-00002.array_record"


def test_a_run_in_a_bucket(bucket, tiny_train_config, tmp_path, monkeypatch, capsys, caplog):
  """Train from ArrayRecord shards in the bucket; SIGTERM, resume; a torn newest checkpoint
  falls back; evaluate, sample, export to HF; init_from the run's params; TensorBoard events
  and every file in the bucket, none in a local "gs:" directory."""
  assert threading.current_thread() is threading.main_thread()  # the SIGTERM handler's thread
  repo = os.getcwd()
  monkeypatch.chdir(tmp_path)  # a gs:// path taken for a local one would become ./gs:/...
  run = f"{bucket}/runs/a"
  c = tiny_train_config(steps=6)
  c.tokenizer = "words"  # built from the bucket's records, saved in <run>/tokenizer
  c.data.update(source="array_record", paths=write_shards(tmp_path, bucket))
  c.checkpoint.every_steps = 2
  c.sample.update(num_problems=2, max_new_tokens=8, block_size=4, batch_size=2, gammas=(0.1,))
  c.compile_cache = "workdir"  # JAX's persistent compilation cache in <run>/compile_cache

  # SIGTERM after step 3: checkpoint 3 saved, nothing exported; the same call resumes.
  monkeypatch.setattr(trainer, "StopRequest", SigtermAfter)
  assert trainer.train(c, run)["stopped_at"] == 3
  monkeypatch.setattr(trainer, "StopRequest", stopping.StopRequest)
  assert {"2", "3"} <= {p.split("/")[0] for p in listing(f"{run}/checkpoints")}
  assert not epath.Path(run, "params").exists()
  trainer.train(c, run)
  assert "resumed from the step-3 checkpoint" in capsys.readouterr().out
  first = losses_by_step(run)
  assert sorted(first) == list(range(1, 7)) and epath.Path(run, "params").is_dir()
  words = json.loads(epath.Path(run, "tokenizer", "tokenizer.json").read_text())["model"]["vocab"]
  assert " apples" in words  # learnt from the records read from the bucket

  # Tear every checkpoint after step 2 (array files gone, a host died mid-save): the next
  # launch warns about each, resumes from step 2 and redoes steps 3..6 in one go, with the
  # losses of the run stopped by SIGTERM and resumed.
  for step in (6, 4, 3):
    state = f"{run}/checkpoints/{step}/state"
    for name in listing(state):
      if not name.split("/")[0].startswith("_"):
        epath.Path(state, name).unlink()
  trainer.train(c, run)
  assert "resumed from the step-2 checkpoint" in capsys.readouterr().out
  assert all(f"checkpoint {s} could not be restored" in caplog.text for s in (6, 4, 3))
  redone = losses_by_step(run)
  for step in range(3, 7):
    assert redone[step][-1] == pytest.approx(first[step][0], rel=1e-6, abs=1e-7), step

  # Evaluate and sample the run where it lies (records of an evaluation are appended to, which
  # a bucket cannot do: one line refuses them there); export it to a local HF directory (a
  # bucket as the destination is refused in one line too).
  gsm8k = tmp_path / "gsm8k.jsonl"
  gsm8k.write_text(
    "".join(json.dumps({"question": f"copy {i}?", "answer": f"#### {i}"}) + "\n" for i in (1, 2))
  )
  summary = workdir_eval.evaluate_workdir(run, "gsm8k", data=str(gsm8k), max_new_tokens=8)
  assert summary["num_problems"] == 2 and len(summary["decodings"]) == 3  # NTP, SBD γ=0.1, verified
  with pytest.raises(ValueError, match="evaluation records are local files"):
    workdir_eval.evaluate_workdir(
      run, "gsm8k", data=str(gsm8k), max_new_tokens=8, out_dir=f"{run}/eval/gsm8k"
    )
  sampled = compare.sample_workdir(run, ["Question: copy 7?\nAnswer:"] * 2, max_new_tokens=8)
  assert [r["ntp_nfe"] for r in sampled] == [8, 8]  # the shapes the evaluation compiled
  hf = exporter.export_hf(run, str(tmp_path / "hf"))
  assert json.loads(open(os.path.join(hf, "config.json")).read())["sbd_mask_token_id"] == 259
  assert os.path.isfile(os.path.join(hf, "model.safetensors"))
  assert os.path.isfile(os.path.join(hf, "tokenizer.json"))
  with pytest.raises(ValueError, match="written to a local directory"):
    exporter.export_hf(run, f"{bucket}/hf")

  # init_from the run's params in the bucket, with its tokenizer read from the bucket too: the
  # one step trains at lr 0 (warm-up), so the export holds exactly the params it started from.
  b = tiny_train_config(steps=1)
  b.tokenizer = f"{run}/tokenizer"
  b.train.init_from = f"{run}/params"
  b.data.update(source="array_record", paths=c.data.paths)
  trainer.train(b, f"{bucket}/runs/b")
  assert f"params initialised from {run}/params" in capsys.readouterr().out
  start, end = params_leaves(f"{run}/params"), params_leaves(f"{bucket}/runs/b/params")
  assert len(start) == len(end) > 0
  for x, y in zip(start, end):
    np.testing.assert_array_equal(x, y)

  # TensorBoard: every line of metrics.jsonl is an event in the bucket (a bucket cannot append:
  # each flush rewrites the file whole), read from a copy fetched by a filesystem made now (not
  # through this process's cached gcsfs listings).
  events_dir = download(f"{run}/{dashboards.TENSORBOARD_DIR}", tmp_path / "events")
  acc = event_accumulator.EventAccumulator(events_dir)
  acc.Reload()
  events = sorted((e.step, e.value) for e in acc.Scalars("train/loss"))
  logged = sorted((s, v) for s, values in redone.items() for v in values)
  assert [s for s, _ in events] == [s for s, _ in logged]
  np.testing.assert_allclose([v for _, v in events], [v for _, v in logged], rtol=1e-6)

  files = listing(bucket)
  for name in ("config.json", "metrics.jsonl", "tokenizer/tokenizer.json", "params/_METADATA"):
    assert f"runs/a/{name}" in files, name
  assert sum(f.startswith("runs/a/tensorboard/events.out.tfevents.") for f in files) == 3
  assert any(f.startswith("runs/a/compile_cache/") for f in files)
  assert "runs/b/params/_METADATA" in files and "data/train-00000-of-00002.array_record" in files
  for where in {str(tmp_path), repo, tempfile.gettempdir()}:
    assert not os.path.exists(os.path.join(where, "gs:")), where
  assert not list(tmp_path.rglob(f"*{bucket.removeprefix('gs://')}*"))
