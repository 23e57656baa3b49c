"""SBD next to NTP on a trained workdir's model: both completions of each prompt, with the
forwards each spent. What `python -m sbd_jax.sample` prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sbd_jax.decode import sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.run.loading import load_sampling_model, mesh_for
from sbd_jax.run.workdir import read_trained_config


def sample_workdir(
  workdir: str,
  prompts: Sequence[str],
  *,
  seed: int = 0,
  batch_size: int | None = None,
  **overrides: Any,
) -> list[dict[str, Any]]:
  """SBD and NTP completions of `prompts` by <workdir>/params, with NFE counts per prompt.
  `overrides` are `SamplerSettings` fields (None: the run's `sample` setting); `batch_size`
  prompts per batch (default: all), or with refill the rows the prompts queue for."""
  if not prompts:
    raise ValueError("no prompts given: pass --prompt or --prompts_file")
  config = read_trained_config(workdir)
  settings_lib.check_block_size(config, overrides.get("block_size"))
  mesh = mesh_for(config)
  model, _, tokenizer, mask_id = load_sampling_model(workdir, mesh=mesh)
  sbd_settings = settings_lib.from_config(config.sample, tokenizer, mask_id, **overrides)
  sbd_settings = sbd_settings.replace(mode="sbd")
  kwargs = dict(seed=seed, batch_size=batch_size, mesh=mesh)
  sbd = sampler.decode_text(model, tokenizer, prompts, sbd_settings, **kwargs)
  ntp = sampler.decode_text(model, tokenizer, prompts, sbd_settings.replace(mode="ntp"), **kwargs)
  return [
    {
      "prompt": prompt,
      "sbd_decoding": sbd_settings.label,
      "sbd": sbd.texts[i],
      "ntp": ntp.texts[i],
      "sbd_nfe": int(sbd.nfe[i]),
      "ntp_nfe": int(ntp.nfe[i]),
      "nfe_speedup": float(ntp.nfe[i] / max(1, sbd.nfe[i])),
      "sbd_acceptance": sbd.acceptance([i]),  # verified drafts (vLLM's spec-decode numbers)
      # Structured output: whether each text is complete (its constraint's automaton accepts
      # it; one cut at the token limit is not), and the SBD decode's forced tokens
      **(
        {}
        if sbd.complete is None
        else {
          "sbd_complete": bool(sbd.complete[i]),
          "ntp_complete": bool(ntp.complete[i]),
          "sbd_forced_tokens": int(sbd.forced_tokens[i]),
        }
      ),
    }
    for i, prompt in enumerate(prompts)
  ]


def format_results(results: list[dict[str, Any]]) -> str:
  blocks = []
  for r in results:
    blocks.append(
      f"prompt: {r['prompt']!r}\n"
      f"{r['sbd_decoding']} ({r['sbd_nfe']} forwards): {r['sbd']!r}\n"
      f"NTP ({r['ntp_nfe']} forwards): {r['ntp']!r}\n"
      f"NFE speedup: {r['nfe_speedup']:.2f}x"
      + _acceptance_line(r["sbd_acceptance"])
      + _constraint_line(r)
    )
  return "\n\n".join(blocks)


def _constraint_line(r: dict[str, Any]) -> str:
  if "sbd_complete" not in r:
    return ""
  done = lambda ok: "complete" if ok else "incomplete (cut at the token limit)"  # noqa: E731
  return (
    f"\nconstraint: SBD {done(r['sbd_complete'])}, {r['sbd_forced_tokens']} forced tokens; "
    f"NTP {done(r['ntp_complete'])}"
  )


def _acceptance_line(a: dict[str, Any] | None) -> str:
  if a is None:
    return ""
  return (
    f"\ndrafts: {a['drafts']}, {a['accepted_tokens']} of {a['draft_tokens']} drafted tokens "
    f"accepted ({100 * a['acceptance_rate']:.1f} %), mean acceptance length "
    f"{a['mean_acceptance_length']:.2f}"
  )
