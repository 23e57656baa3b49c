"""Decode a task's problems with each decoding (NTP, SBD per rule and γ), score them and
summarise (`results`): in memory, or into an output directory that a rerun resumes.

Output directory (`out_dir`):
  settings.json   what the records were made with; a rerun with other settings refuses to mix
  records.jsonl   one line per (decoding, problem) (fields in `results`), appended decode call
                  by decode call, so an interrupted run continues where it stopped
  summary.json    the summary (`results.summarize` per decoding, and what was decoded)
  table.md        the summary laid out like the paper's Table 1 (`results.format_markdown`)

In a multi-process run (a model that spans hosts) every process decodes the same batches; the
lead process owns `out_dir`, scores and returns the summary, and the others return None.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from sbd_jax import distributed, paths
from sbd_jax.data import chat
from sbd_jax.decode import sampler
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.evals import results
from sbd_jax.evals.tasks import execution, records
from sbd_jax.evals.tasks.code import cut_at_stops
from sbd_jax.evals.tasks.task import Problem, Task
from sbd_jax.sbd import reveal_rules

CHAT_MODES = ("auto", "yes", "no")
# With refill and an output directory, one decode call queues this many batches of problems
# through `batch_size` rows (records are written after each call, so a resumed run redoes at
# most one call's problems).
REFILL_BATCHES_PER_CALL = 8

Decoding = tuple[str, SamplerSettings]


def check_sweep(rules: Sequence[str], gammas: Sequence[float]) -> None:
  """One-line ValueErrors for an unknown rule or a γ outside a rule's range."""
  for rule in rules:
    for gamma in gammas:
      reveal_rules.check_gamma(rule, gamma)


def standard_decodings(
  base: SamplerSettings, rules: Sequence[str], gammas: Sequence[float]
) -> list[Decoding]:
  """NTP, then plain SBD for every (rule, γ), then, if `base.verify`, verified SBD: an
  evaluation shows what verification keeps next to what it costs. Verified rows that draft
  every masked position or none (`base.draft`) do not read the rule or γ: one decoding; drafted
  by the rule, one per (rule, γ). Every other setting is `base`'s."""
  check_sweep(rules, gammas)
  plain = [
    base.replace(mode="sbd", rule=r, gamma=float(g), verify=False) for r in rules for g in gammas
  ]
  verified = []
  if base.verify and base.draft != "rule":
    verified = [base.replace(mode="sbd")]
  elif base.verify:
    verified = [s.replace(verify=True) for s in plain]
  ntp = base.replace(mode="ntp", verify=False)
  return [(results.NTP, ntp)] + [(s.label, s) for s in plain + verified]


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


def prompt_ids(problem: Problem, tokenizer, template: chat.ChatTemplate | None) -> list[int]:
  """Token ids the model is given: the chat template's rendering of the user turn (its own
  special tokens, none added), or the plain prompt encoded as a document (BOS where the
  tokenizer adds one)."""
  if template is None:
    return list(tokenizer.encode_document(problem.plain_prompt))
  text = template.render([{"role": "user", "content": problem.chat_message}], True)
  return list(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)


def reference_budget(problems: Sequence[Problem], tokenizer, block_size: int) -> int:
  """The longest reference completion with its EOS, rounded up to whole blocks."""
  longest = max(len(tokenizer.encode(p.record["completion"])) + 1 for p in problems)
  return -(-longest // block_size) * block_size


def _check_or_write_settings(out_dir: str, settings: dict[str, Any]) -> None:
  settings = json.loads(json.dumps(settings))  # tuples -> lists, as they read back
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


def evaluate(
  model: sampler.SamplingModel,
  tokenizer,
  task: Task,
  problems: Sequence[Problem],
  decodings: Sequence[Decoding],
  *,
  batch_size: int,
  mesh=None,
  seed: int | None = None,
  template: chat.ChatTemplate | None = None,
  limits: execution.Limits = execution.DEFAULT_LIMITS,
  out_dir: str | None = None,
  source: str | None = None,
  progress: bool = False,
  with_records: bool = False,
) -> dict[str, Any] | None:
  """Decode every problem with every decoding, score, summarise (`with_records`: the records
  too). `seed` is the draw of generated problems, `source` the file of read ones; both only
  describe the problems. Decodings must start with NTP (`standard_decodings`)."""
  if not problems:
    raise ValueError("no problems to evaluate")
  if out_dir and paths.is_remote(out_dir):  # records are appended to, which a bucket cannot do
    raise ValueError(f"out_dir {out_dir}: evaluation records are local files; give a local --out")
  if decodings[0][0] != results.NTP:
    raise ValueError("the first decoding must be NTP: SBD's speedups are counted against it")
  base = decodings[0][1]
  described = {
    "task": task.name,
    "data": os.path.abspath(source) if source else None,
    "seed": seed,
    "block_size": base.block_size,
    "max_new_tokens": base.max_new_tokens,
    "temperature": base.temperature,
    "chat_template": template.source if template else None,
  }
  lead = distributed.is_lead_process()
  record_path = os.path.join(out_dir, "records.jsonl") if out_dir else None

  def finished_before() -> np.ndarray:  # [decodings, problems] bool, on the lead process
    if out_dir is None:
      return np.zeros((len(decodings), len(problems)), bool)
    _check_or_write_settings(out_dir, described)
    done = {(r["decoding"], r["task_id"]) for r in records.read_finished(record_path, True)}
    return np.asarray([[(d, p.task_id) in done for p in problems] for d, _ in decodings])

  # The others decode the same batches in step with the lead, so they take its resume decision.
  done_DP = distributed.decided_by_lead(finished_before, (len(decodings), len(problems)))
  if mesh is not None:  # place the weights once; decode's own placement is then a no-op
    model = model.sharded(mesh)
  ids = {p.task_id: prompt_ids(p, tokenizer, template) for p in problems}
  bar = tqdm(
    total=done_DP.size,
    initial=int(done_DP.sum()),
    desc=task.name,
    unit="answer",
    disable=not (progress and lead),
    file=sys.stderr,
  )
  new_records = []
  for (name, settings), done_P in zip(decodings, done_DP):
    todo = [p for p, done in zip(problems, done_P) if not done]
    per_call = len(todo) if out_dir is None else batch_size
    if out_dir is not None and settings.refill:
      per_call *= REFILL_BATCHES_PER_CALL
    for first in range(0, len(todo), max(per_call, 1)):
      chunk = todo[first : first + per_call]
      out = sampler.decode(
        model, [ids[p.task_id] for p in chunk], settings, batch_size=batch_size, mesh=mesh,
        tokenizer=tokenizer,
      )  # fmt: skip
      bar.update(len(chunk))
      if lead:
        made = _records(task, chunk, out, name, tokenizer, template, limits)
        if record_path is not None:
          records.append_jsonl(record_path, made)
        new_records += made
  bar.close()
  if not lead:
    return None
  names, task_ids = [d for d, _ in decodings], [p.task_id for p in problems]
  rows = new_records
  if record_path is not None:
    wanted = {(d, t) for d in names for t in task_ids}
    rows = [
      r for r in records.read_finished(record_path) if (r["decoding"], r["task_id"]) in wanted
    ]
  summary = {
    **described,
    "num_problems": len(problems),
    "out_dir": out_dir,
    "decodings": results.summarize(rows, task_ids, names),
  }
  if out_dir is not None:
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as f:
      f.write(results.format_markdown([summary]) + "\n")
  return {**summary, "records": rows} if with_records else summary


def _records(task: Task, problems, out: sampler.DecodeOutput, name, tokenizer, template, limits):
  """One record per problem of a decode call (`results` names the fields)."""
  eos = tokenizer.eos_id
  texts = [tokenizer.decode([t for t in toks if t != eos]) for toks in out.tokens]
  if template is None:
    texts = [cut_at_stops(t, task.stops) for t in texts]
  scores = task.score(problems, texts, limits)
  return [
    {
      "task_id": p.task_id,
      "decoding": name,
      "completion": text,
      "tokens": len(out.tokens[i]),
      "nfe": int(out.nfe[i]),
      "row_forwards": int(out.batch_forwards[i]),
      **out.draft_counts(i),
      "finished": bool(out.finished[i]),
      **({} if out.complete is None else {"complete": bool(out.complete[i])}),
      **score,
    }
    for i, (p, text, score) in enumerate(zip(problems, texts, scores))
  ]
