"""CLI: decode prompts with SBD and with NTP from the same trained model; report NFE speedup.

python -m sbd_jax.sample --workdir=DIR --prompt="Q: ..." [--rule=eb_entropy --gamma=0.35
--block_size=<the run's sample.block_size> --max_new_tokens=256 --temperature=0 --json] or --prompts_file (one per line).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

import jax
from absl import flags

from sbd_jax import cli, distributed, sharding
from sbd_jax.decode import sampler
from sbd_jax.training import workdir as workdir_lib


def sample_workdir(
  workdir: str,
  prompts: Sequence[str],
  *,
  rule: str = "eb_entropy",
  gamma: float = 0.35,
  block_size: int | None = None,
  max_new_tokens: int = 256,
  temperature: float = 0.0,
  seed: int = 0,
  batch_size: int | None = None,
  refill: bool = False,
  refill_rows: int = 1,
) -> list[dict[str, Any]]:
  """SBD and NTP completions of `prompts` by <workdir>/params, with NFE counts per prompt.
  `block_size` defaults to the run's `sample.block_size` (the block its training matched).
  `refill`: `batch_size` rows, a finished row taking the next prompt (`refill_rows` of them
  prefilled together)."""
  if not prompts:
    raise ValueError("no prompts given: pass --prompt or --prompts_file")
  config = workdir_lib.read_trained_config(workdir)
  sharded = jax.device_count() > 1
  mesh = sharding.mesh_from_config(config.mesh) if sharded else None
  model, _, tokenizer, mask_id = workdir_lib.load_sampling_model(workdir, mesh=mesh)
  sbd_settings = sampler.settings_for(
    tokenizer,
    mask_id,
    rule=rule,
    gamma=gamma,
    block_size=block_size or config.sample.block_size,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    refill=refill,
    refill_rows=refill_rows,
  )
  kwargs = dict(seed=seed, batch_size=batch_size, mesh=mesh)
  sbd = sampler.decode_text(model, tokenizer, prompts, sbd_settings, **kwargs)
  ntp = sampler.decode_text(model, tokenizer, prompts, sbd_settings.replace(mode="ntp"), **kwargs)
  return [
    {
      "prompt": prompt,
      "sbd": sbd.texts[i],
      "ntp": ntp.texts[i],
      "sbd_nfe": int(sbd.nfe[i]),
      "ntp_nfe": int(ntp.nfe[i]),
      "nfe_speedup": float(ntp.nfe[i] / max(1, sbd.nfe[i])),
    }
    for i, prompt in enumerate(prompts)
  ]


def format_results(results: list[dict[str, Any]]) -> str:
  blocks = []
  for r in results:
    blocks.append(
      f"prompt: {r['prompt']!r}\n"
      f"SBD ({r['sbd_nfe']} forwards): {r['sbd']!r}\n"
      f"NTP ({r['ntp_nfe']} forwards): {r['ntp']!r}\n"
      f"NFE speedup: {r['nfe_speedup']:.2f}x"
    )
  return "\n\n".join(blocks)


def _define_flags():
  flags.DEFINE_string("workdir", None, "Training workdir with config.json and params/.")
  flags.DEFINE_string("prompt", None, "One prompt (a literal \\n becomes a newline).")
  flags.DEFINE_string(
    "prompts_file", None, "A text file with one prompt per line (literal \\n becomes a newline)."
  )
  flags.DEFINE_string("rule", "eb_entropy", "Reveal rule: eb_entropy, eb_confidence, factor.")
  flags.DEFINE_float(
    "gamma", 0.35, "γ of the EB rules (f of the factor rule); 0 = one token per forward."
  )
  flags.DEFINE_integer("block_size", None, "SBD block size (default: the run's config).")
  flags.DEFINE_integer("max_new_tokens", 256, "Maximum generated tokens per prompt.")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples.")
  flags.DEFINE_integer("seed", 0, "PRNG seed for temperature > 0.")
  flags.DEFINE_integer("batch_size", None, "Prompts per decode batch (default: all).")
  flags.DEFINE_bool(
    "refill",
    False,
    "Decode the prompts through --batch_size rows, a finished row taking the next prompt at once.",
  )
  flags.DEFINE_integer(
    "refill_rows",
    1,
    "With --refill: rows refilled together (on a mesh, data x fsdp splits evenly).",
  )
  flags.DEFINE_bool("json", False, "Print JSON instead of text.")
  flags.mark_flags_as_required(["workdir"])


def main(argv):
  """Thin CLI over `sample_workdir`."""
  del argv
  distributed.maybe_initialize()  # a model that spans hosts decodes on all of them
  f = flags.FLAGS
  unescape = lambda text: text.replace("\\n", "\n")  # noqa: E731  (a literal \n -> newline)
  prompts = [unescape(f.prompt)] if f.prompt is not None else []
  try:
    if f.prompts_file:
      with open(f.prompts_file) as fh:
        prompts += [unescape(line.rstrip("\n")) for line in fh if line.strip()]
    results = sample_workdir(
      f.workdir,
      prompts,
      rule=f.rule,
      gamma=f.gamma,
      block_size=f.block_size,
      max_new_tokens=f.max_new_tokens,
      temperature=f.temperature,
      seed=f.seed,
      batch_size=f.batch_size,
      refill=f.refill,
      refill_rows=f.refill_rows,
    )
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")  # one line, exit status 1
  if distributed.is_lead_process():
    print(json.dumps(results, indent=2) if f.json else format_results(results))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
