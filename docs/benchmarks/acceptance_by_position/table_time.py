"""A verified decode's forwards by kind, and its time by the fixed cost table of `--wide_cost`
(no clock: the same measure as tests/test_policy.py's `_table_time`), on a trained run's held-out
problems, against NTP's; two passes, the second with the model's prior learned from the first.

  python docs/benchmarks/acceptance_by_position/table_time.py WORKDIR WIDE_COST BATCH N [TASK DATA]

Prints one JSON line (the files beside this script)."""

import json
import sys

from sbd_jax.decode import costs, sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.evals import runner
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.evals.tasks import registry
from sbd_jax.run import loading

workdir, wide, batch, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
task = sys.argv[5] if len(sys.argv) > 5 else "arithmetic"
data = sys.argv[6] if len(sys.argv) > 6 else None
model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
block = config.sample.block_size
the_task = registry.get(task)
problems = (
  arithmetic_task.problems(config.data, n, seed=0)
  if the_task is arithmetic_task.TASK
  else the_task.load(data, n)
)
budget = runner.reference_budget(problems, tokenizer, block)
base = settings_lib.from_config(config.sample, tokenizer, mask_id, budget=budget)
prompts = [runner.prompt_ids(p, tokenizer, None) for p in problems]
ntp = sampler.decode(model, prompts, base.replace(mode="ntp"), batch_size=batch)
s = base.replace(verify=True, wide_cost=wide)
cost_K = costs.fixed(s, batch).cost_K
calls = n // batch
ntp_time = ntp.nfe.reshape(calls, batch).max(1).sum()
sm = model
res = {
  "wide_cost": wide,
  "batch": batch,
  "kinds": costs.kind_names(s),
  "cost_K": [round(float(c), 3) for c in cost_K],
}
for pass_ in range(2):
  out = sampler.decode(sm, prompts, s, batch_size=batch)
  assert out.tokens == ntp.tokens
  kinds = out.batch_kind_forwards.reshape(calls, batch, -1)[:, 0].sum(0)
  t = calls + kinds @ cost_K  # a prefill each call, counted as one forward
  pr = sm.prior_for(s)
  res[f"pass{pass_}"] = {
    "kinds": kinds.tolist(),
    "table_time_vs_ntp": round(float(ntp_time / t), 3),
    "forwards_vs_ntp": round(float(ntp.nfe.sum() / out.nfe.sum()), 3),
    "tokens_per_forward": round(sum(map(len, out.tokens)) / float(out.nfe.sum()), 2),
    "prior_by_position": [
      round(float(x), 3) for x in getattr(pr, "by_position", lambda p: [pr.value])(block)
    ],
  }
print(json.dumps(res))
