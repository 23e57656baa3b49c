"""The held-out decode of an evaluation while training (`eval.decode_problems`): the built-in
task's first N eval-split problems decoded with NTP, SBD and (with `sample.verify`) SBD
verified, at the run's first `sample.gammas` value, with the training state's own params.
`python -m sbd_jax.train` hands `decoder` to the trainer.
"""

from __future__ import annotations

import jax
import ml_collections
from flax import nnx

from sbd_jax.decode import settings as settings_lib
from sbd_jax.evals import results, runner
from sbd_jax.evals.tasks import arithmetic
from sbd_jax.evals.workdir_eval import task_budget
from sbd_jax.run.loading import mesh_for, sampling_model_from_params


def decoder(c: ml_collections.ConfigDict, tokenizer, mask_id: int):
  """(params) -> {accuracy and forwards-speedup scalars} (`results.dashboard_scalars`)."""
  s = c.sample
  problems = arithmetic.problems(c.data, c.eval.decode_problems, c.train.seed)
  base = settings_lib.from_config(
    s,
    tokenizer,
    mask_id,
    budget=task_budget(arithmetic.TASK, problems, tokenizer, s.block_size),
  )
  decodings = runner.standard_decodings(base, (s.rule,), tuple(s.gammas)[:1])
  mesh = mesh_for(c)
  template = runner.resolve_template(tokenizer, "auto")

  def evaluate(params: nnx.State) -> dict[str, float]:
    def placed(abstract):
      return jax.tree.map(
        lambda p, a: p if getattr(a, "sharding", None) is None else jax.device_put(p, a.sharding),
        params,
        abstract,
      )

    model = sampling_model_from_params(c, placed, mesh=mesh)
    summary = runner.evaluate(
      model,
      tokenizer,
      arithmetic.TASK,
      problems,
      decodings,
      batch_size=min(s.batch_size, len(problems)),
      mesh=mesh,
      seed=c.train.seed,
      template=template,
    )
    return {} if summary is None else results.dashboard_scalars(summary)

  return evaluate
