"""Diagnostics that tell a weak model from a bug, on a workdir (`evaluate --diagnostics`):

* held-out NTP loss and MATP loss by block offset and masking level (`evals.heldout_rows`,
  `evals.block_losses`);
* what a wholly masked block's first forward gets wrong (`evals.first_forward`);
* `reveal_groups`: which tokens of a decoded answer came out of the same forward.

`diagnose_workdir` runs them all; `format_diagnostics` prints the result.
"""

from __future__ import annotations

from typing import Any, Sequence

from sbd_jax.decode import sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.evals import results, runner
from sbd_jax.evals.block_losses import loss_by_offset
from sbd_jax.evals.first_forward import masked_misses
from sbd_jax.evals.heldout_rows import pack_documents
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.evals.tasks import registry
from sbd_jax.run import loading
from sbd_jax.sbd import reveal_rules


def reveal_groups(tokens: Sequence[int], steps: Sequence[int], tokenizer) -> list[str]:
  """One line per forward that revealed tokens: '3: " Mia| starts| with"' (| between
  tokens), in forward order."""
  by_step: dict[int, list[str]] = {}
  for token, step in zip(tokens, steps):
    by_step.setdefault(int(step), []).append(repr(tokenizer.decode([token]))[1:-1] or "<eos>")
  return [f"{step:3d}: {'|'.join(pieces)}" for step, pieces in sorted(by_step.items())]


def diagnose_workdir(
  workdir: str,
  task_name: str = "arithmetic",
  *,
  data: str | None = None,
  num_problems: int = 128,
  seed: int | None = None,
  gamma: float = 0.35,
  num_reveal_examples: int = 3,
) -> dict[str, Any]:
  """What separates a weak model from a bug (module docstring), on held-out problems: the
  built-in task's `num_problems` drawn for `seed`, or the first `num_problems` records of a
  task's JSONL file `data` that has reference completions (the `exact` task's). Prompts are
  plain (no chat template), as the training rows hold them.

  * `decoding`: NTP next to SBD with block size 1 (one masked token, NTP's context), and with
    the run's block size at γ = 0 (one token per forward) and at `gamma` (`results` rows);
  * `loss_by_offset`: MATP loss per block offset and masking rate next to NTP on the same tokens;
  * `masked_misses`: tokens a wholly masked block gets wrong where NTP is right, and how many of
    them the EB rule at `gamma` commits in the block's first forward;
  * `reveal_order`: which tokens of a few SBD answers came out of the same forward.
  """
  task = registry.get(task_name)
  if num_problems < 1:
    raise ValueError(f"num_problems must be >= 1, got {num_problems}")
  if task is arithmetic_task.TASK and data:
    raise ValueError("the arithmetic task draws its problems: give --num_problems and --seed")
  if task is not arithmetic_task.TASK and not data:
    raise ValueError(f"--task={task_name} needs --data=<its JSONL file>")
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  if task is arithmetic_task.TASK:
    seed = config.train.seed if seed is None else seed
    drawn = arithmetic_task.problems(config.data, num_problems, seed)
  else:
    seed = None
    drawn = task.load(data, num_problems)
    if any("completion" not in p.record for p in drawn):
      raise ValueError(f"diagnostics need reference completions: {data} has no 'completion'")
  records = [{"prompt": p.plain_prompt, "completion": p.record["completion"]} for p in drawn]
  s, k = config.sample, config.sample.block_size
  budget = runner.reference_budget(drawn, tokenizer, k)
  # What SBD itself predicts (plain, not verified).
  base = settings_lib.from_config(s, tokenizer, mask_id, budget=budget, mode="sbd", verify=False)
  one = reveal_rules.one_per_forward(base.rule)  # γ of one token per forward
  decodings = [
    (results.NTP, base.replace(mode="ntp")),
    (settings_lib.decoding_name(s.rule, one, 1), base.replace(block_size=1, gamma=one)),
    (settings_lib.decoding_name(s.rule, one, k), base.replace(gamma=one)),
    (settings_lib.decoding_name(s.rule, gamma, k), base.replace(gamma=gamma)),
  ]
  summary = runner.evaluate(model, tokenizer, task, drawn, decodings, batch_size=s.batch_size)
  decoding = {r["decoding"]: r for r in summary["decodings"]}
  settings = decodings[-1][1]
  shown = [r["prompt"] for r in records[:num_reveal_examples]]
  out = sampler.decode_text(model, tokenizer, shown, settings)
  # + BOS and EOS; rows this long never cut a problem
  longest = max(len(tokenizer.encode(r["prompt"] + r["completion"])) + 2 for r in records)
  rows = pack_documents(records, tokenizer, seq_len=max(config.train.seq_len, longest))
  return {
    "source": f"seed {seed}" if data is None else data,
    "num_problems": len(drawn),
    "decoding": decoding,
    "loss_by_offset": loss_by_offset(
      model, rows, mask_id, block_size=s.block_size, batch_size=s.batch_size
    ),
    "masked_misses": masked_misses(
      model,
      rows,
      mask_id,
      tokenizer,
      block_size=s.block_size,
      gamma=gamma,
      batch_size=s.batch_size,
    ),  # fmt: skip
    "reveal_order": [reveal_groups(t, r, tokenizer) for t, r in zip(out.tokens, out.reveal_step)],
  }


def format_diagnostics(d: dict[str, Any]) -> str:
  lines = [f"{d['num_problems']} held-out problems ({d['source']})", ""]
  lines.append(f"{'decoding':<32} {'accuracy %':>10} {'mean forwards':>14}")
  for name, r in d["decoding"].items():
    lines.append(f"{name:<32} {100 * r['accuracy']:>10.1f} {r['mean_nfe']:>14.1f}")
  loss = d["loss_by_offset"]
  lines += ["", f"held-out loss (nats) by offset in a block of {loss['block_size']}: MATP / NTP"]
  lines.append("mask rate " + " ".join(f"{i:>11d}" for i in range(loss["block_size"])))
  for rate, r in loss["rates"].items():
    cells = (f"{m:5.2f}/{n:<5.2f}" for m, n in zip(r["matp"], r["ntp_same_tokens"]))
    lines.append(f"{rate:>9} " + " ".join(cells))
  m = d.get("masked_misses")
  if m:
    lines += [
      "",
      f"greedy accuracy per token, block of {m['block_size']} masked whole / NTP: "
      f"{100 * m['masked_accuracy']:.2f} % / {100 * m['ntp_accuracy']:.2f} % of {m['tokens']}",
      f"tokens NTP gets right and the masked block misses: {m['misses']}; the EB rule at "
      f"γ={m['gamma']:g} commits {m['revealed_first_forward']} of them in the block's first "
      f"forward ({m['revealed_above_gamma']} with entropy above γ, mean "
      f"{m['mean_entropy_revealed']:.2f} nats)",
    ]
    lines += [
      f"  {x['token']!r} x{x['count']} (mostly as {x['predicted']!r}, mean entropy "
      f"{x['mean_entropy']:.2f})"
      for x in m["most_missed"]
    ]
  lines += ["", "reveal order of SBD answers (forward: tokens revealed together)"]
  for groups in d["reveal_order"]:
    lines += groups + [""]
  return "\n".join(lines)
