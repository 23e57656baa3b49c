"""What the Table-1 benchmark measures: accuracy and NFE speedup on arithmetic (rows and γ
sweeps), NFE speedup and agreement on code continuations, decode wall-clock next to the NFE
speedup and time(n), and the roofline tables."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from benchmarks import prediction, roofline, roofline_model, side_by_side
from benchmarks.table1.sizes import GAMMA_HIGH, GAMMA_LOW, RULES, Size, sweep_values
from benchmarks.table1.training import log
from sbd_jax.data.pipeline import encode_record
from sbd_jax.decode import sampler
from sbd_jax.decode.settings import decoding_name, settings_for
from sbd_jax.evals import results, runner
from sbd_jax.evals.tasks import arithmetic as arithmetic_task

SWEEP_KEYS = ("accuracy", "mean_nfe", "nfe_speedup")


def _sweeps(model_name: str, size: Size) -> dict[str, tuple[float, ...]]:
  """rule -> γ values decoded: every rule's sweep for the SBD model, γ_low and γ_high of the EB
  entropy rule for the others (the NTP model: none)."""
  if model_name == "ntp":
    return {}
  if model_name == "sbd":
    return {rule: tuple(sweep_values(size, rule)) for rule in RULES}
  return {"eb_entropy": (GAMMA_LOW, GAMMA_HIGH)}


def evaluate_arithmetic(models: dict[str, Any], problems, size: Size) -> dict[str, Any]:
  """Table-1 rows and per-rule sweeps: accuracy and NFE speedup on held-out problems, every
  decoding of a model in one evaluation (`evals.runner`)."""
  rows, sweeps = {}, {}
  for name in models:
    model, tokenizer, mask_id = models[name]
    base = settings_for(
      tokenizer,
      mask_id,
      block_size=size.block_size,
      max_new_tokens=size.max_new_tokens,
      verify=False,  # the paper's SBD
    )
    sweep = _sweeps(name, size)
    decodings = [(results.NTP, base.replace(mode="ntp"))] + [
      (decoding_name(rule, g), base.replace(rule=rule, gamma=float(g)))
      for rule in sweep
      for g in sweep[rule]
    ]
    summary = runner.evaluate(
      model, tokenizer, arithmetic_task.TASK, problems, decodings, batch_size=size.eval_batch
    )
    by_name = {r["decoding"]: r for r in summary["decodings"]}
    ntp = by_name[results.NTP]
    rows[f"{name}_model_ntp"] = {"accuracy": ntp["accuracy"], "mean_nfe": ntp["mean_nfe"]}
    rows[f"{name}_model_ntp"]["nfe_speedup"] = 1.0
    log(
      f"arithmetic {name} model, NTP decoding: accuracy {ntp['accuracy']:.3f}, "
      f"mean NFE {ntp['mean_nfe']:.1f}"
    )
    for rule, values in sweep.items():
      out = []
      for g in values:
        r = by_name[decoding_name(rule, g)]
        out.append({"rule": rule, "gamma": float(g)} | {k: r[k] for k in SWEEP_KEYS})
        log(
          f"arithmetic {name} model, SBD {rule} γ={g:g} k={size.block_size}: accuracy "
          f"{r['accuracy']:.3f}, mean NFE {r['mean_nfe']:.1f}, NFE speedup "
          f"{r['nfe_speedup']:.2f}x"
        )
      if name == "sbd":
        sweeps[rule] = out
      if rule == "eb_entropy":
        for key, g in (("gamma_low", GAMMA_LOW), ("gamma_high", GAMMA_HIGH)):
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
    base = settings_for(
      tokenizer,
      mask_id,
      block_size=size.block_size,
      max_new_tokens=size.code_new_tokens,
      verify=False,  # the paper's SBD
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


def _wallclock_row(
  m: side_by_side.Measured, d: dict[str, Any], *, batch: int, prompt_len: int, limit: int, k: int
) -> dict[str, Any]:
  """One SBD setting timed against NTP (`side_by_side.row`: the measured speedup, the one
  predicted from time(n) with the decodes' own forward counts and prefills, from medians and
  from fastest calls), with the NFE speedup and the paper's formula at the mean l."""
  ntp = m.ntp
  schedule = f"{d['rule']} γ={d['gamma']:g} k={k}"
  row = side_by_side.row("sbd", 0, batch, prompt_len, schedule, m, d, limit, k)
  # The calls are kept once, in the decodes and in `forward`, not in every row.
  del row["model"], row["params"], row["decode_samples_s"], row["time_loop_calls"]
  l = prediction.forwards_per_block(d["nfe"], d["lengths"], k)
  row.update(
    rule=d["rule"],
    gamma=d["gamma"],
    s_per_token=d["s_per_token"],
    first_call_s=d["first_call_s"],
    nfe_speedup=float(np.mean(np.asarray(ntp["nfe"]) / np.maximum(d["nfe"], 1))),
    forwards_per_block=l,
    # The paper's closed form with the same time(n), prompt and call left out.
    predicted_paper=prediction.paper_speedup(m.times, k, min(max(l, 1.0), k)),
  )
  log(
    f"wall-clock SBD {schedule}: {1e3 * d['s_per_token']:.3f} ms/token vs NTP "
    f"{1e3 * ntp['s_per_token']:.3f}: measured {row['measured_speedup']:.2f}x, NFE "
    f"{row['nfe_speedup']:.2f}x, predicted {row['predicted_speedup']:.2f}x "
    f"(measured / predicted {row['measured_over_predicted']:.2f}; from fastest calls "
    f"{row['fastest_measured_over_predicted']:.2f})"
  )
  return row


def measure_wallclock(model, tokenizer, mask_id, problems, size: Size) -> dict[str, Any]:
  """Decode time per generated token, NTP vs SBD eb_entropy at each γ, next to the speedup
  that time(n) predicts, timed as `side_by_side.measure` times it: decodes and forward loops
  in the same rounds, time(n) at the cache fills the decodes' forwards see
  (`forward_timing.fill_steps`), the prompt's forward and the cost of a decode call apart."""
  prompts = [tokenizer.encode_document(p.plain_prompt) for p in problems[: size.wall_problems]]
  base = settings_for(
    tokenizer,
    mask_id,
    block_size=size.block_size,
    max_new_tokens=size.max_new_tokens,
    verify=False,  # the paper's SBD
  )
  sbd_settings = [base.replace(rule="eb_entropy", gamma=g) for g in size.gammas]
  log(
    f"wall-clock: {len(prompts)} prompts, batch {size.wall_batch}, {1 + len(sbd_settings)} "
    f"settings, {size.wall_repeats} repeats and {size.wall_min_s:g} s of calls per setting"
  )
  k = size.block_size
  m = side_by_side.measure(
    model,
    prompts,
    base.replace(mode="ntp"),
    sbd_settings,
    batch=size.wall_batch,
    repeats=size.wall_repeats,
    block=k,
    ns=size.forward_ns,
    min_total_s=size.wall_min_s,
    forward_repeats=size.forward_repeats,
  )
  log(
    f"time(n) over {m.cached_tokens} cached tokens on average: "
    + ", ".join(f"n={n}: {1e3 * t:.3f} ms" for n, t in sorted(m.times.items()))
  )
  longest = max(len(p) for p in prompts)
  rows = [
    _wallclock_row(m, d, batch=size.wall_batch, prompt_len=longest, limit=size.max_new_tokens, k=k)
    for d in m.sbds
  ]
  ntp_keys = ("median_s", "min_s", "first_call_s", "tokens", "forwards", "s_per_token")
  return {
    "num_prompts": len(prompts),
    "batch_size": size.wall_batch,
    "block_size": k,
    "repeats": len(m.ntp["samples_s"]),  # rounds the NTP decodes got
    "ntp": {key: m.ntp[key] for key in ntp_keys},
    "decodes": [m.ntp, *m.sbds],
    "sbd": rows,
    "forward": m.forward,
    "prefill_s": {"ntp": m.prefill[0], "sbd": m.prefill[1]},
    "call_s": {"ntp": m.call[0], "sbd": m.call[1]},
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0]),
  }


def roofline_tables(peak_tflops: float, bandwidth_gbs: float) -> tuple[dict[str, Any], str]:
  """Tables 3/4 for the paper's 8B model on the paper's H100 and on a given device."""
  model = roofline_model.paper_8b()
  custom = roofline_model.Device.from_peaks(
    f"given device ({peak_tflops:g} TFLOP/s, {bandwidth_gbs:g} GB/s)",
    peak_tflops * 1e12,
    bandwidth_gbs * 1e9,
  )
  data, md = {}, [f"# Roofline (paper section 4): {model.name}\n"]
  for key, device in (("h100", roofline_model.H100_FP8), ("given_device", custom)):
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
  md.append(roofline.explanation(model, roofline_model.H100_FP8, roofline.DEFAULT_KV_LEN))
  return data, "\n".join(md) + "\n"
