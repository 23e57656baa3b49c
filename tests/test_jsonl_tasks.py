"""Your own JSONL task: the `exact` task's reading and scoring, and the benchmark's task data
and config (benchmarks/jsonl_tasks.py)."""

import json
import os

import pytest

from benchmarks import jsonl_tasks
from sbd_jax import config as config_lib
from sbd_jax.data.tokenizer import load_tokenizer
from sbd_jax.evals.tasks import registry
from sbd_jax.evals.tasks.records import TaskDataError


def test_exact_matches_the_reference_up_to_outer_whitespace(tmp_path):
  path = tmp_path / "held_out.jsonl"
  rows = [
    {"prompt": "copy ab =", "completion": " ab"},
    {"prompt": "copy cd =", "completion": " cd"},
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  task = registry.get("exact")
  problems = task.load(str(path))
  assert [p.plain_prompt for p in problems] == ["copy ab =", "copy cd ="]
  assert [p.task_id for p in problems] == ["exact/0", "exact/1"]
  scores = task.score(problems, ["ab \n", " c d"])
  assert [s["correct"] for s in scores] == [True, False]


def test_exact_names_a_record_without_its_fields(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "x"}\n')
  with pytest.raises(TaskDataError, match="completion"):
    registry.get("exact").load(str(path))


@pytest.mark.parametrize("task", sorted(jsonl_tasks.TASKS))
def test_task_records_are_determined_by_their_prompt(task):
  train = jsonl_tasks.records(task, 200, seed=0)
  held_out = jsonl_tasks.records(task, 200, seed=1)
  assert train == jsonl_tasks.records(task, 200, seed=0)  # reproducible
  assert len({r["prompt"] for r in train} & {r["prompt"] for r in held_out}) < 5
  for r in train + held_out:
    name, word, equals = r["prompt"].split(" ")
    assert name == task and equals == "=" and 4 <= len(word) <= 24 and word.isalpha()
    expected = {
      "copy": word,
      "reverse": "".join(reversed(word)),
      "shift": "".join(chr((ord(c) - ord("a") + 1) % 26 + ord("a")) for c in word),
    }[task]
    assert r["completion"] == " " + expected


def test_the_task_config_keeps_the_paper_recipe_and_validates(tmp_path):
  c = jsonl_tasks.task_config(str(tmp_path / "train.jsonl"), steps=800)
  paper = config_lib.from_file(
    os.path.join(os.path.dirname(__file__), "..", "configs", "paper_small.py")
  )
  for field in ("k_min", "k_max", "eta_beta", "full_block_prob", "matp_weight", "block_anchor"):
    assert c.sbd[field] == paper.sbd[field]
  assert c.sample.block_size == 16 and c.sbd.train_past_eos and c.sbd.ntp_fraction == 0.3
  assert (c.data.source, c.tokenizer, c.sample.num_problems) == ("jsonl", "byte", 0)
  config_lib.validate(c, num_devices=1, tokenizer=load_tokenizer("byte"))
