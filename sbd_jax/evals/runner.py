"""Evaluate a workdir on a benchmark file: NTP and SBD decodings, per-problem records, a
Table-1-style summary. Resumable, and a scorer for completions made elsewhere.

Output directory (default <workdir>/eval/<task>):
  settings.json   what the records were made with; a rerun with other settings refuses to mix
  records.jsonl   one line per (decoding, problem): task_id, decoding, completion, tokens, nfe,
                  finished, correct, extracted; appended decode call by decode call, so an
                  interrupted run continues where it stopped
  summary.json    per decoding: accuracy with its 95 % interval, mean forwards, NFE speedup
  table.md        the summary laid out like the paper's Table 1: accuracy (NFE speedup)

NFE speedup = mean over problems of NTP forwards / SBD forwards, as in `sbd_jax.evaluate`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from sbd_jax import distributed
from sbd_jax import evaluate as evaluate_lib
from sbd_jax.data import chat
from sbd_jax.decode import sampler
from sbd_jax.evals import tasks
from sbd_jax.evals.tasks import execution, records
from sbd_jax.evals.tasks.code import cut_at_stops
from sbd_jax.sbd import reveal_rules
from sbd_jax.training import workdir as workdir_lib

CHAT_MODES = ("auto", "yes", "no")
NTP = "ntp"
# With refill, one decode call queues this many batches of problems through `batch_size` rows
# (records are written after each call, so a resumed run redoes at most one call's problems).
REFILL_BATCHES_PER_CALL = 8


def decoding_name(rule: str, gamma: float) -> str:
  return f"sbd {rule} γ={gamma:g}"


def resolve_template(tokenizer, mode: str) -> chat.ChatTemplate | None:
  """The tokenizer's chat template for mode "yes" (required) or "auto" (if any); None for "no"."""
  if mode not in CHAT_MODES:
    raise ValueError(f"chat must be one of {CHAT_MODES}, got {mode!r}")
  path = getattr(tokenizer, "path", "")
  template = chat.ChatTemplate.from_tokenizer_dir(os.path.dirname(path)) if path else None
  if mode == "yes" and template is None:
    where = os.path.dirname(path) if path else f"the {type(tokenizer).__name__}"
    raise ValueError(
      f"--chat=yes but {where} has no chat template (tokenizer_config.json 'chat_template' or "
      f"{chat.TEMPLATE_FILE})"
    )
  return None if mode == "no" else template


def prompt_ids(problem: tasks.Problem, tokenizer, template: chat.ChatTemplate | None) -> list[int]:
  """Token ids the model is given: the chat template's rendering of the user turn (its own
  special tokens, none added), or the plain prompt encoded as a document (BOS where the
  tokenizer adds one)."""
  if template is None:
    return list(tokenizer.encode_document(problem.plain_prompt))
  text = template.render([{"role": "user", "content": problem.chat_message}], True)
  return list(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)


def _settings_record(**settings: Any) -> dict[str, Any]:
  return json.loads(json.dumps(settings))  # tuples -> lists, as they read back


def _check_or_write_settings(out_dir: str, settings: dict[str, Any]) -> None:
  path = os.path.join(out_dir, "settings.json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if changed:
      raise ValueError(
        f"{out_dir} holds records made with other settings ({', '.join(changed)}); "
        "pass another --out or delete it"
      )
    return
  os.makedirs(out_dir, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(settings, f, indent=2)


def evaluate_task(
  workdir: str,
  task_name: str,
  data: str,
  *,
  out_dir: str | None = None,
  limit: int | None = None,
  rules: Sequence[str] = ("eb_entropy",),
  gammas: Sequence[float] = (0.1, 0.35),
  block_size: int | None = None,
  max_new_tokens: int | None = None,
  batch_size: int | None = None,
  chat_mode: str = "auto",
  limits: execution.Limits = execution.DEFAULT_LIMITS,
  progress: bool = True,
  with_records: bool = False,
  refill: bool = False,
  refill_rows: int = 1,
) -> dict[str, Any] | None:
  """Decode every problem of `data` with NTP and with SBD per (rule, γ), score, summarise
  (`with_records`: the per-problem records too, under "records"). In a multi-process run the
  lead process returns the summary and the others None. With `refill`, each decode call queues
  REFILL_BATCHES_PER_CALL batches through `batch_size` rows, a finished row taking the next
  problem (`refill_rows` at a time); greedy records are the same either way, so a run may
  resume with or without it."""
  task = tasks.get(task_name)
  for rule in rules:
    reveal_rules.get_rule(rule)
  if any(g < 0 for g in gammas):
    raise ValueError(f"gammas must be >= 0, got {list(gammas)}")
  problems = task.load(data, limit)
  config = workdir_lib.read_trained_config(workdir)
  mesh = evaluate_lib.mesh_or_none(config)
  model, config, tokenizer, mask_id = workdir_lib.load_sampling_model(workdir, mesh=mesh)
  template = resolve_template(tokenizer, chat_mode)
  block_size = block_size or config.sample.block_size
  max_new_tokens = max_new_tokens or task.max_new_tokens
  batch_size = batch_size or config.sample.batch_size
  out_dir = out_dir or os.path.join(workdir, "eval", task_name)
  record_path = os.path.join(out_dir, "records.jsonl")
  base = sampler.settings_for(
    tokenizer,
    mask_id,
    block_size=block_size,
    max_new_tokens=max_new_tokens,
    refill=refill,
    refill_rows=refill_rows,
  )
  decodings = [(NTP, base.replace(mode="ntp"))] + [
    (decoding_name(r, g), base.replace(rule=r, gamma=float(g))) for r in rules for g in gammas
  ]

  def finished_before() -> np.ndarray:  # [decodings, problems] bool, on the lead process
    _check_or_write_settings(
      out_dir,
      _settings_record(
        task=task_name,
        data=os.path.abspath(data),
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        chat_template=template.source if template else None,
      ),
    )
    done = {(r["decoding"], r["task_id"]) for r in records.read_finished(record_path, True)}
    return np.asarray([[(d, p.task_id) in done for p in problems] for d, _ in decodings])

  # One process (the lead) owns out_dir: it checks the settings, reads and writes the records
  # and scores. When the model spans hosts the others decode the same batches in step with it,
  # so they take its resume decision.
  lead = distributed.is_lead_process()
  done_DP = distributed.decided_by_lead(finished_before, (len(decodings), len(problems)))
  if mesh is not None:
    model = model.sharded(mesh)
  ids = {p.task_id: prompt_ids(p, tokenizer, template) for p in problems}
  bar = tqdm(
    total=done_DP.size,
    initial=int(done_DP.sum()),
    desc=task_name,
    unit="answer",
    disable=not (progress and lead),
    file=sys.stderr,
  )
  per_call = batch_size * (REFILL_BATCHES_PER_CALL if refill else 1)
  for (name, settings), done_P in zip(decodings, done_DP):
    todo = [p for p, done in zip(problems, done_P) if not done]
    for first in range(0, len(todo), per_call):
      chunk = todo[first : first + per_call]
      out = sampler.decode(
        model, [ids[p.task_id] for p in chunk], settings, batch_size=batch_size, mesh=mesh
      )
      bar.update(len(chunk))
      if not lead:
        continue
      texts = [tokenizer.decode([t for t in toks if t != base.eos_id]) for toks in out.tokens]
      if template is None:
        texts = [cut_at_stops(t, task.stops) for t in texts]
      scores = task.score(chunk, texts, limits)
      records.append_jsonl(
        record_path,
        [
          {
            "task_id": p.task_id,
            "decoding": name,
            "completion": text,
            "tokens": len(toks),
            "nfe": int(nfe),
            "finished": bool(finished),
            **score,
          }
          for p, text, toks, nfe, finished, score in zip(
            chunk, texts, out.tokens, out.nfe, out.finished, scores
          )
        ],
      )
  bar.close()
  if not lead:
    return None
  names, task_ids = [d for d, _ in decodings], [p.task_id for p in problems]
  wanted = {(d, t) for d in names for t in task_ids}
  rows = [r for r in records.read_finished(record_path) if (r["decoding"], r["task_id"]) in wanted]
  summary = summarize(rows, task_ids, names)
  summary.update(
    task=task_name,
    block_size=block_size,
    max_new_tokens=max_new_tokens,
    chat_template=template.source if template else None,
    out_dir=out_dir,
  )
  with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2, ensure_ascii=False)
  with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as f:
    f.write(format_table([summary]) + "\n")
  return {**summary, "records": rows} if with_records else summary


def summarize(
  rows: Sequence[dict[str, Any]], task_ids: Sequence[str], decodings: Sequence[str]
) -> dict[str, Any]:
  """Accuracy, 95 % interval, mean forwards and NFE speedup per decoding, over `task_ids`."""
  by_key = {(r["decoding"], r["task_id"]): r for r in rows}
  ntp_nfe = np.asarray([by_key[(NTP, t)]["nfe"] for t in task_ids], float)
  results = []
  for name in decodings:
    picked = [by_key[(name, t)] for t in task_ids]
    correct = np.asarray([r["correct"] for r in picked], bool)
    nfe = np.asarray([r["nfe"] for r in picked], float)
    results.append(
      {
        "decoding": name,
        "accuracy": float(correct.mean()),
        "ci95": list(evaluate_lib.wilson_interval(int(correct.sum()), len(correct))),
        "mean_nfe": float(nfe.mean()),
        "nfe_speedup": float(np.mean(ntp_nfe / np.maximum(nfe, 1))),
      }
    )
  return {"num_problems": len(task_ids), "decodings": results}


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
  """Markdown, one row per decoding and one column per task: accuracy % (NFE speedup)."""
  names = list(dict.fromkeys(r["decoding"] for s in summaries for r in s["decodings"]))
  header = "| decoding | " + " | ".join(f"{s['task']} ({s['num_problems']})" for s in summaries)
  lines = [header + " |", "|---" * (len(summaries) + 1) + "|"]
  for name in names:
    cells = []
    for s in summaries:
      r = next((r for r in s["decodings"] if r["decoding"] == name), None)
      if r is None:
        cells.append("")
      elif name == NTP:
        cells.append(f"{100 * r['accuracy']:.1f}")
      else:
        cells.append(f"{100 * r['accuracy']:.1f} ({r['nfe_speedup']:.2f}x)")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def score_completions(
  task_name: str,
  data: str,
  completions_path: str,
  limits: execution.Limits = execution.DEFAULT_LIMITS,
) -> dict[str, Any]:
  """Score completions produced elsewhere (`task_id`, `completion` per line; several lines per
  task_id average into its pass@1), with no model. Unknown task_ids are an error."""
  task = tasks.get(task_name)
  problems = {p.task_id: p for p in task.load(data)}
  rows = records.read_jsonl(completions_path, ("task_id", "completion"))
  for line_no, row in enumerate(rows, start=1):
    if str(row["task_id"]) not in problems:
      raise records.TaskDataError(
        f"{completions_path}: record {line_no} has task_id {row['task_id']!r}, not in {data}"
      )
  picked = [problems[str(r["task_id"])] for r in rows]
  scores = task.score(picked, [str(r["completion"]) for r in rows], limits)
  per_problem: dict[str, list[bool]] = {}
  for row, score in zip(rows, scores):
    per_problem.setdefault(str(row["task_id"]), []).append(bool(score["correct"]))
  pass_at_1 = [float(np.mean(v)) for v in per_problem.values()]
  return {
    "task": task_name,
    "num_problems": len(per_problem),
    "num_completions": len(rows),
    "accuracy": float(np.mean(pass_at_1)),
    "records": [{"task_id": str(r["task_id"]), **s} for r, s in zip(rows, scores)],
  }
