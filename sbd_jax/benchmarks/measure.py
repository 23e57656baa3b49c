"""What the Table-1 benchmark measures: accuracy and NFE speedup on arithmetic (rows and γ
sweeps), NFE speedup and agreement on code continuations, decode wall-clock next to the NFE
speedup and time(n), and the roofline tables."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from sbd_jax import evaluate, sampler
from sbd_jax.benchmarks import roofline, wallclock
from sbd_jax.benchmarks.sizes import GAMMA_HIGH, GAMMA_LOW, RULES, Size, sweep_values
from sbd_jax.benchmarks.training import log
from sbd_jax.data.pipeline import encode_record


def _evaluate(model, tokenizer, mask_id, problems, size: Size, rule=None, gamma=None):
  rules, gammas = ((rule,), (gamma,)) if rule else ((), ())
  return evaluate.evaluate_problems(
    model,
    tokenizer,
    mask_id,
    problems,
    rules=rules,
    gammas=gammas,
    block_size=size.block_size,
    max_new_tokens=size.max_new_tokens,
    batch_size=size.eval_batch,
  )


def evaluate_arithmetic(models: dict[str, Any], problems, size: Size) -> dict[str, Any]:
  """Table-1 rows and per-rule sweeps: accuracy and NFE speedup on held-out problems."""
  rows, sweeps = {}, {}
  for name in models:
    model, tokenizer, mask_id = models[name]
    ntp = _evaluate(model, tokenizer, mask_id, problems, size)["ntp"]
    rows[f"{name}_model_ntp"] = {
      "accuracy": ntp["accuracy"],
      "mean_nfe": ntp["mean_nfe"],
      "nfe_speedup": 1.0,
    }
    log(
      f"arithmetic {name} model, NTP decoding: accuracy {ntp['accuracy']:.3f}, "
      f"mean NFE {ntp['mean_nfe']:.1f}"
    )
  for name in [n for n in models if n != "ntp"]:
    model, tokenizer, mask_id = models[name]
    rules = RULES if name == "sbd" else ("eb_entropy",)
    for rule in rules:
      values = sweep_values(size, rule) if name == "sbd" else (GAMMA_LOW, GAMMA_HIGH)
      out = []
      for g in values:
        r = _evaluate(model, tokenizer, mask_id, problems, size, rule, g)["sbd"][0]
        out.append({k: r[k] for k in ("rule", "gamma", "accuracy", "mean_nfe", "nfe_speedup")})
        log(
          f"arithmetic {name} model, SBD {rule} γ={g:g} k={size.block_size}: accuracy "
          f"{r['accuracy']:.3f}, mean NFE {r['mean_nfe']:.1f}, NFE speedup "
          f"{r['nfe_speedup']:.2f}x"
        )
      if name == "sbd":
        sweeps[rule] = out
      for key, g in (("gamma_low", GAMMA_LOW), ("gamma_high", GAMMA_HIGH)):
        if rule == "eb_entropy":
          rows[f"{name}_{key}"] = next(r for r in out if r["gamma"] == g)
  return {
    "num_problems": len(problems),
    "block_size": size.block_size,
    "max_new_tokens": size.max_new_tokens,
    "rows": rows,
    "sweeps": sweeps,
  }


def code_prompts(texts: Sequence[str], tokenizer, size: Size) -> list[list[int]]:
  """First N tokens ([bos] + bytes) of held-out files long enough to continue M more."""
  prompts = []
  for text in texts:
    ids = encode_record({"text": text}, tokenizer, True)["tokens"]
    if len(ids) >= size.code_prompt_len + size.code_new_tokens:
      prompts.append([int(t) for t in ids[: size.code_prompt_len]])
    if len(prompts) == size.code_prompts:
      break
  return prompts


def agreement(reference: Sequence[int], other: Sequence[int]) -> float:
  """Fraction of the reference's positions where `other` holds the same token."""
  if not reference:
    return 1.0
  return sum(a == b for a, b in zip(reference, other)) / len(reference)


def evaluate_code(models: dict[str, Any], prompts, size: Size) -> dict[str, Any]:
  """NFE speedup of SBD vs NTP decoding on the SBD model's code continuations, and agreement."""
  out: dict[str, Any] = {
    "num_prompts": len(prompts),
    "prompt_len": size.code_prompt_len,
    "new_tokens": size.code_new_tokens,
    "rows": {},
  }
  for name in [n for n in models if n != "ntp"]:
    model, tokenizer, mask_id = models[name]
    base = sampler.settings_for(
      tokenizer, mask_id, block_size=size.block_size, max_new_tokens=size.code_new_tokens
    )
    ntp = sampler.decode(model, prompts, base.replace(mode="ntp"), batch_size=size.eval_batch)
    for g in (0.0, GAMMA_LOW, GAMMA_HIGH):
      sbd = sampler.decode(
        model, prompts, base.replace(rule="eb_entropy", gamma=g), batch_size=size.eval_batch
      )
      row = {
        "rule": "eb_entropy",
        "gamma": g,
        "nfe_speedup": float(np.mean(ntp.nfe / np.maximum(sbd.nfe, 1))),
        "mean_nfe": float(sbd.nfe.mean()),
        "ntp_mean_nfe": float(ntp.nfe.mean()),
        "agreement": float(np.mean([agreement(a, b) for a, b in zip(ntp.tokens, sbd.tokens)])),
        "exact_match": float(np.mean([a == b for a, b in zip(ntp.tokens, sbd.tokens)])),
      }
      out["rows"][f"{name}_gamma_{g:g}"] = row
      log(
        f"code {name} model, SBD eb_entropy γ={g:g}: NFE speedup {row['nfe_speedup']:.2f}x, "
        f"agreement with NTP {row['agreement']:.3f}"
      )
  return out


_DECODE_KEYS = ("rule", "gamma", "median_s", "first_call_s", "tokens", "forwards", "s_per_token")


def _wallclock_row(d: dict[str, Any], ntp: dict[str, Any], times: dict[int, float], k: int):
  """One SBD decode timed against NTP: measured speedup next to the NFE speedup and the
  speedups predicted from time(n)."""
  l = wallclock.forwards_per_block(d["nfe"], d["lengths"], k)
  row = {
    **{key: d[key] for key in _DECODE_KEYS},
    "nfe_speedup": float(np.mean(np.asarray(ntp["nfe"]) / np.maximum(d["nfe"], 1))),
    "tokens_per_forward": d["tokens"] / max(d["forwards"], 1),
    "measured_speedup": ntp["s_per_token"] / d["s_per_token"],
    "forwards_per_block": l,
    "predicted_paper": wallclock.paper_speedup(times, k, min(max(l, 1.0), k)),
    "predicted_accounted": wallclock.accounted_speedup(
      times, k, np.asarray(ntp["nfe"]), np.asarray(d["nfe"]), np.asarray(d["lengths"])
    ),
  }
  log(
    f"wall-clock SBD eb_entropy γ={d['gamma']:g}: {1e3 * d['s_per_token']:.3f} ms/token vs "
    f"NTP {1e3 * ntp['s_per_token']:.3f}: measured {row['measured_speedup']:.2f}x, NFE "
    f"{row['nfe_speedup']:.2f}x, predicted {row['predicted_paper']:.2f}x (l={l:.2f}) / "
    f"{row['predicted_accounted']:.2f}x (per-sample counts)"
  )
  return row


def measure_wallclock(model, tokenizer, mask_id, problems, size: Size) -> dict[str, Any]:
  """Decode time per generated token, NTP vs SBD eb_entropy at each γ, and time(n)."""
  prompts = [tokenizer.encode_document(p.prompt) for p in problems[: size.wall_problems]]
  base = sampler.settings_for(
    tokenizer, mask_id, block_size=size.block_size, max_new_tokens=size.max_new_tokens
  )
  settings = [base.replace(mode="ntp")] + [
    base.replace(rule="eb_entropy", gamma=g) for g in size.gammas
  ]
  log(
    f"wall-clock: {len(prompts)} prompts, batch {size.wall_batch}, {len(settings)} settings, "
    f"{size.wall_repeats} repeats"
  )
  decodes = wallclock.time_decodes(
    model, prompts, settings, batch_size=size.wall_batch, repeats=size.wall_repeats, log=log
  )
  k = size.block_size
  ns = sorted(set(size.forward_ns) | {1, k, 2 * k})
  bucket = sampler.prompt_bucket(max(len(p) for p in prompts))
  cache_length = settings[1].cache_slots(bucket, size.wall_batch)
  forward = wallclock.time_forwards(
    model,
    batch=size.wall_batch,
    cache_length=cache_length,
    ns=ns,
    repeats=size.forward_repeats,
    inner=size.forward_inner,
  )
  times = {int(n): t for n, t in forward["time_s"].items()}
  log("time(n) with a filled cache: " + ", ".join(f"n={n}: {1e3 * times[n]:.3f} ms" for n in ns))
  ntp = decodes[0]
  rows = [_wallclock_row(d, ntp, times, k) for d in decodes[1:]]
  return {
    "num_prompts": len(prompts),
    "batch_size": size.wall_batch,
    "block_size": k,
    "repeats": size.wall_repeats,
    "ntp": {
      key: ntp[key] for key in ("median_s", "first_call_s", "tokens", "forwards", "s_per_token")
    },
    "decodes": decodes,
    "sbd": rows,
    "forward": forward,
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0]),
  }


def roofline_tables(peak_tflops: float, bandwidth_gbs: float) -> tuple[dict[str, Any], str]:
  """Tables 3/4 for the paper's 8B model on the paper's H100 and on a given device."""
  model = roofline.paper_8b()
  custom = roofline.Device.from_peaks(
    f"given device ({peak_tflops:g} TFLOP/s, {bandwidth_gbs:g} GB/s)",
    peak_tflops * 1e12,
    bandwidth_gbs * 1e9,
  )
  data, md = {}, [f"# Roofline (paper section 4): {model.name}\n"]
  for key, device in (("h100", roofline.H100_FP8), ("given_device", custom)):
    t3, t4 = roofline.table3(model, device), roofline.table4(model, device)
    data[key] = {
      "device": dataclasses.asdict(device),
      "table3": [dataclasses.asdict(r) for r in t3],
      "table4": [dataclasses.asdict(r) for r in t4],
    }
    md += [
      f"## {device.name}\n",
      f"### Table 3: time(k) / time(1), kv_len = {roofline.DEFAULT_KV_LEN}\n",
      roofline.format_table3(t3),
      "\n### Table 4: wall-clock speedup, block 16\n",
      roofline.format_table4(t4),
      "",
    ]
  md.append(roofline.explanation(model, roofline.H100_FP8, roofline.DEFAULT_KV_LEN))
  return data, "\n".join(md) + "\n"
