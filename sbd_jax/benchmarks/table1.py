"""The headline benchmark: the paper's Table 1 at small scale, with measured wall-clock.

    python -m sbd_jax.benchmarks.table1 --out=DIR [--size=cpu|gpu|toy] [--ablation]
        [--peak_tflops=312 --bandwidth_gbs=2039]

One run trains (or reuses, from DIR) an NTP baseline and an SBD model with the same data, steps
and seed on the arithmetic task and on a code corpus (the installed Python's stdlib sources,
`code_corpus`); `--ablation` adds a MATP-only model. It then measures exact-match accuracy and NFE
speedup (Table 1 rows, γ sweeps per reveal rule), NFE speedup and agreement on code
continuations, held-out NTP losses, decode wall-clock per token next to NFE speedup, the cached
forward time(n), and prints the roofline Tables 3/4. Outputs in DIR: results.json (every number),
table1.md, roofline.md, accuracy_vs_speedup.png, wallclock_vs_predicted.png, time_per_forward.png.

Budget of `--size=cpu` (2 CPU cores, the 0.8M-parameter `tiny` model). Measured here on a
shared, loaded machine: NTP steps ~3.8k processed tokens/s, SBD steps ~3.4k (they process 2L
tokens a row); unloaded expect ~4.5-5k. Arithmetic rows are seq 128 (one ~110-token problem per
row after first-fit packing), batch 16 = 2048 tokens: an NTP step ~0.45 s (0.55 loaded), an SBD
step 4096 processed tokens ~0.9 s (1.2 loaded).
  arithmetic: 1500 steps x (0.45 + 0.9) s                  ~ 34 min (44 loaded; 24k problems)
  code:       300 steps x batch 8 x seq 256 (same tokens/step) ~ 7 min (9 loaded)
  evaluation: 23 arithmetic settings x 128 problems (batch 64, ~5-9 s compile each), code
              64 prompts x 4 settings (compiled programs reused), losses   ~ 8-12 min
  wall-clock: 9 settings x 16 problems at batch 1 x (1 + 3) decodes, time(n) ~ 3 min
  total                                                     ~ 55-70 min (first run)
A rerun with the same DIR skips training. A 60-step smoke already decodes answers (5% exact
match for NTP); 1500 steps is the affordable part of the "few thousand steps" the task would
like. `--size=toy` is the test's (~2 minutes incl. 4 tiny trainings); `--size=gpu` is a
~20M-parameter model trained ~10x longer, for an accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from sbd_jax import architectures, evaluate, sampler, trainer
from sbd_jax import config as config_lib
from sbd_jax import workdir as workdir_lib
from sbd_jax.attention import TokenMeta
from sbd_jax.benchmarks import code_corpus, plots, roofline, wallclock
from sbd_jax.data.pipeline import encode_record, make_eval_problems
from sbd_jax.objective import ntp_targets

RULES = ("eb_entropy", "eb_confidence", "factor")
GAMMA_LOW, GAMMA_HIGH = 0.1, 0.35  # paper's reasoning settings (brief section 3)

# Paper Table 1, Llama-3.1 8B rows (brief section 5): accuracy and NFE speedup (None = NTP).
PAPER_BENCHMARKS = ("MATH500", "AIME25", "LCB v6", "GSM8K", "HE+", "MBPP")
PAPER_LLAMA = {
  "ntp_model_ntp": (
    "Llama-3.1 8B, NTP-trained",
    "NTP",
    [(80.2, None), (33.3, None), (31.5, None), (85.3, None), (56.7, None), (70.4, None)],
  ),
  "sbd_model_ntp": (
    "Llama-3.1 8B, SBD-trained",
    "NTP",
    [(81.6, None), (30.0, None), (31.3, None), (85.6, None), (57.9, None), (70.9, None)],
  ),
  "sbd_gamma_low": (
    "Llama-3.1 8B, SBD-trained",
    "SBD γ_low",
    [(81.0, 3.55), (30.0, 3.35), (31.7, 3.72), (84.2, 2.20), (57.9, 2.61), (69.5, 2.49)],
  ),
  "sbd_gamma_high": (
    "Llama-3.1 8B, SBD-trained",
    "SBD γ_high",
    [(80.4, 3.23), (23.3, 4.50), (29.9, 4.59), (84.0, 2.34), (54.9, 2.95), (67.2, 2.66)],
  ),
}


@dataclasses.dataclass(frozen=True)
class Size:
  """Everything a benchmark size sets: model, training, evaluation and timing."""

  model: dict[str, Any]  # overrides of architectures.tiny()
  steps: int  # arithmetic optimizer steps (every model, same seed and data)
  batch_size: int
  seq_len: int
  code_steps: int  # code-corpus optimizer steps
  code_batch_size: int
  code_seq_len: int
  lr: float
  warmup_steps: int
  num_problems: int  # held-out arithmetic problems decoded per setting
  eval_batch: int
  max_new_tokens: int
  block_size: int  # SBD decode block k
  gammas: tuple[float, ...]  # eb_entropy sweep (must hold 0, γ_low and γ_high)
  confidence_gammas: tuple[float, ...]  # eb_confidence sweep
  factor_thresholds: tuple[float, ...]  # f of the factor rule
  code_max_files: int  # 0 = the whole stdlib
  code_prompts: int  # held-out files continued
  code_prompt_len: int  # N: prompt = first N tokens (BOS included)
  code_new_tokens: int  # M
  loss_rows: int  # held-out packed rows for the code NTP loss
  loss_problems: int  # held-out problems for the arithmetic NTP loss
  wall_problems: int  # prompts of the wall-clock decode
  wall_batch: int
  wall_repeats: int
  forward_ns: tuple[int, ...]
  forward_repeats: int
  forward_inner: int  # forwards per timed call (amortizes dispatch)
  compute_dtype: str = "float32"
  checkpoints: int = 4  # checkpoints per training run (resume points)


WORD_VOCAB_SIZE = 384  # embedding rows of the arithmetic models (bytes, specials, ~100 words)
FULL_GAMMAS = (0.0, 0.01, 0.1, 0.2, 0.35, 0.6, 1.0, 1.5)
FACTORS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)
FORWARD_NS = (1, 2, 4, 8, 16, 32)

SIZES = {
  "toy": Size(
    model=dict(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128),
    steps=20,
    batch_size=8,
    seq_len=256,
    code_steps=20,
    code_batch_size=8,
    code_seq_len=128,
    lr=3e-3,
    warmup_steps=5,
    num_problems=8,
    eval_batch=8,
    max_new_tokens=16,
    block_size=4,
    gammas=(0.0, GAMMA_LOW, GAMMA_HIGH),
    confidence_gammas=(GAMMA_HIGH,),
    factor_thresholds=(1.0,),
    code_max_files=120,
    code_prompts=8,
    code_prompt_len=128,
    code_new_tokens=16,
    loss_rows=8,
    loss_problems=16,
    wall_problems=8,
    wall_batch=8,
    wall_repeats=2,
    forward_ns=(1, 2, 4, 8),
    forward_repeats=3,
    forward_inner=2,
    checkpoints=1,
  ),
  "cpu": Size(
    model={},
    steps=1500,
    batch_size=8,
    seq_len=256,
    code_steps=300,
    code_batch_size=8,
    code_seq_len=256,
    lr=3e-3,
    warmup_steps=60,
    num_problems=128,
    eval_batch=64,
    max_new_tokens=48,
    block_size=16,
    gammas=FULL_GAMMAS,
    confidence_gammas=FULL_GAMMAS,
    factor_thresholds=FACTORS,
    code_max_files=0,
    code_prompts=64,
    code_prompt_len=128,
    code_new_tokens=48,
    loss_rows=64,
    loss_problems=256,
    wall_problems=16,
    wall_batch=1,
    wall_repeats=3,
    forward_ns=FORWARD_NS,
    forward_repeats=15,
    forward_inner=8,
  ),
  "gpu": Size(
    model=dict(
      num_layers=8,
      embed_dim=512,
      num_heads=8,
      num_kv_heads=4,
      head_dim=64,
      mlp_dim=1536,
      attention_chunk=256,
    ),
    steps=12000,
    batch_size=32,
    seq_len=256,
    code_steps=6000,
    code_batch_size=32,
    code_seq_len=512,
    lr=1e-3,
    warmup_steps=300,
    num_problems=512,
    eval_batch=128,
    max_new_tokens=48,
    block_size=16,
    gammas=FULL_GAMMAS,
    confidence_gammas=FULL_GAMMAS,
    factor_thresholds=FACTORS,
    code_max_files=0,
    code_prompts=128,
    code_prompt_len=128,
    code_new_tokens=48,
    loss_rows=256,
    loss_problems=1024,
    wall_problems=64,
    wall_batch=1,
    wall_repeats=5,
    forward_ns=FORWARD_NS,
    forward_repeats=30,
    forward_inner=16,
  ),
}


def log(message: str) -> None:
  print(f"[table1] {message}", flush=True)


# ------------------------------------------------------------------------------------------
# Training.


def train_config(
  size: Size, mode: str, task: str, train_path: str = ""
) -> ml_collections.ConfigDict:
  """The run config of one model: `mode` in objective.MODES, `task` "arithmetic" or "code"."""
  c = config_lib.base_config(architectures.tiny(**size.model, compute_dtype=size.compute_dtype))
  c.sbd.mode = mode
  arith = task == "arithmetic"
  c.train.steps = size.steps if arith else size.code_steps
  c.train.batch_size = size.batch_size if arith else size.code_batch_size
  c.train.seq_len = size.seq_len if arith else size.code_seq_len
  c.train.seed = 0
  c.train.log_every = max(1, c.train.steps // 20)
  c.optim.lr = size.lr
  c.optim.warmup_steps = min(size.warmup_steps, c.train.steps // 2)
  c.checkpoint.every_steps = max(1, c.train.steps // size.checkpoints)
  if arith:  # the word vocabulary built from the task (see configs/tiny.py)
    c.tokenizer = "words"
    c.model.vocab_size = WORD_VOCAB_SIZE
  else:
    c.data.source = "jsonl"
    c.data.paths = train_path
  c.sample.num_problems = size.num_problems
  c.sample.max_new_tokens = size.max_new_tokens
  c.sample.block_size = size.block_size
  c.sample.batch_size = size.eval_batch
  return c


def ensure_trained(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train in `workdir` unless its params export already has c.train.steps (the trainer resumes
  from a checkpoint otherwise). Returns wall time and the last metrics record."""
  done = os.path.isdir(os.path.join(workdir, "params"))
  if done:
    done = workdir_lib.read_trained_config(workdir).train.steps == c.train.steps
  t0 = time.perf_counter()
  if done:
    log(f"reusing {workdir} ({c.train.steps} steps, mode {c.sbd.mode})")
  else:
    log(
      f"training {workdir}: mode {c.sbd.mode}, {c.train.steps} steps of "
      f"{c.train.batch_size}x{c.train.seq_len}, data {c.data.source}"
    )
    trainer.train(c, workdir)
  return {
    "workdir": workdir,
    "reused": done,
    "seconds": time.perf_counter() - t0,
    "last_metrics": _last_metrics(workdir),
  }


def _last_metrics(workdir: str) -> dict[str, Any]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  return json.loads(lines[-1]) if lines else {}


# ------------------------------------------------------------------------------------------
# Held-out NTP loss.


def pack_rows(
  docs: Sequence[dict[str, np.ndarray]], seq_len: int, max_rows: int
) -> dict[str, np.ndarray]:
  """Encoded documents -> up to `max_rows` rows [R, L]: documents cut into chunks of at most
  seq_len (as in training), chunks placed in order, a new row when the next does not fit."""
  rows, row, fill = [], [], 0
  for doc in docs:
    for i in range(0, len(doc["tokens"]), seq_len):
      chunk = {k: v[i : i + seq_len] for k, v in doc.items()}
      if fill + len(chunk["tokens"]) > seq_len:
        rows.append(row)
        row, fill = [], 0
        if len(rows) == max_rows:
          break
      row.append(chunk)
      fill += len(chunk["tokens"])
    if len(rows) == max_rows:
      break
  if row and len(rows) < max_rows:
    rows.append(row)
  out = {
    k: np.zeros((len(rows), seq_len), np.int32)
    for k in ("tokens", "segment_ids", "positions", "loss_mask")
  }
  for r, chunks in enumerate(rows):
    at = 0
    for seg, chunk in enumerate(chunks, start=1):
      n = len(chunk["tokens"])
      out["tokens"][r, at : at + n] = chunk["tokens"]
      out["loss_mask"][r, at : at + n] = chunk["loss_mask"]
      out["segment_ids"][r, at : at + n] = seg
      out["positions"][r, at : at + n] = np.arange(n)
      at += n
  return out


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _ntp_loss_sums(graphdef, state, tokens_BL, segment_ids_BL, positions_BL, loss_mask_BL):
  logits_BLV, _ = nnx.merge(graphdef, state)(
    tokens_BL, TokenMeta.causal(segment_ids_BL, positions_BL)
  )
  targets_BL, weights_BL = ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL)
  ce_BL = optax.softmax_cross_entropy_with_integer_labels(
    logits_BLV.astype(jnp.float32), targets_BL
  )
  return jnp.sum(ce_BL * weights_BL), jnp.sum(weights_BL)


def heldout_ntp_loss(
  model: sampler.SamplingModel, rows: dict[str, np.ndarray], batch_size: int = 16
) -> dict[str, float]:
  """Mean NTP cross-entropy (nats per target token) over packed rows with causal metadata."""
  total, count = 0.0, 0.0
  n = len(rows["tokens"])
  for first in range(0, n, batch_size):
    batch = {k: v[first : first + batch_size] for k, v in rows.items()}
    short = batch_size - len(batch["tokens"])
    if short:  # pad to a fixed shape with empty rows (segment 0: no targets)
      batch = {k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}
    s, c = _ntp_loss_sums(
      model.graphdef,
      model.state,
      batch["tokens"],
      batch["segment_ids"],
      batch["positions"],
      batch["loss_mask"],
    )
    total, count = total + float(s), count + float(c)
  return {"loss": total / max(count, 1.0), "targets": count, "rows": n}


# ------------------------------------------------------------------------------------------
# Evaluation.


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


def sweep_values(size: Size, rule: str) -> tuple[float, ...]:
  return {
    "eb_entropy": size.gammas,
    "eb_confidence": size.confidence_gammas,
    "factor": size.factor_thresholds,
  }[rule]


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


def measure_wallclock(model, tokenizer, mask_id, problems, size: Size) -> dict[str, Any]:
  """Decode time per generated token, NTP vs SBD eb_entropy at each γ, and time(n)."""
  prompts = [
    [tokenizer.bos_id] + list(tokenizer.encode(p.prompt)) for p in problems[: size.wall_problems]
  ]
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
  cache_length = sampler.prompt_bucket(max(len(p) for p in prompts)) + settings[1].response_slots
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
  rows = []
  for d in decodes[1:]:
    l = wallclock.forwards_per_block(d["nfe"], d["lengths"], k)
    row = {
      **{
        key: d[key]
        for key in (
          "rule",
          "gamma",
          "median_s",
          "first_call_s",
          "tokens",
          "forwards",
          "s_per_token",
        )
      },
      "nfe_speedup": float(np.mean(np.asarray(ntp["nfe"]) / np.maximum(d["nfe"], 1))),
      "tokens_per_forward": d["tokens"] / max(d["forwards"], 1),
      "measured_speedup": ntp["s_per_token"] / d["s_per_token"],
      "forwards_per_block": l,
      "predicted_paper": wallclock.paper_speedup(times, k, min(max(l, 1.0), k)),
      "predicted_accounted": wallclock.accounted_speedup(
        times, k, np.asarray(ntp["nfe"]), np.asarray(d["nfe"]), np.asarray(d["lengths"])
      ),
    }
    rows.append(row)
    log(
      f"wall-clock SBD eb_entropy γ={d['gamma']:g}: {1e3 * d['s_per_token']:.3f} ms/token vs "
      f"NTP {1e3 * ntp['s_per_token']:.3f}: measured {row['measured_speedup']:.2f}x, NFE "
      f"{row['nfe_speedup']:.2f}x, predicted {row['predicted_paper']:.2f}x (l={l:.2f}) / "
      f"{row['predicted_accounted']:.2f}x (per-sample counts)"
    )
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


# ------------------------------------------------------------------------------------------
# Report.


def _acc(row: dict[str, Any] | None) -> str:
  if row is None:
    return "-"
  return f"{100 * row['accuracy']:.1f} ({row['nfe_speedup']:.2f}x)"


def _paper(cell: tuple[float, float | None]) -> str:
  acc, speed = cell
  return f"{acc:.1f}" if speed is None else f"{acc:.1f} ({speed:.2f}x)"


def format_table1(results: dict[str, Any]) -> str:
  """Markdown laid out like the paper's Table 1, with the paper's Llama-3.1 8B rows beside it."""
  a, c, losses = results["arithmetic"]["rows"], results["code"]["rows"], results["heldout_loss"]
  size = results["config"]
  names = {"ntp": "NTP-trained", "sbd": "SBD-trained", "matp_only": "MATP-only (ablation)"}
  header = [
    "model",
    "decoding",
    "arithmetic acc % (NFE speedup)",
    "code NFE speedup (agreement w/ NTP)",
    "held-out NTP loss, arithmetic",
    "held-out NTP loss, code",
    "paper Llama-3.1 8B GSM8K",
    "paper Llama-3.1 8B HE+",
  ]
  body = []
  for model in results["models"]:
    decodings = (
      [("ntp", "NTP")]
      if model == "ntp"
      else [
        ("ntp", "NTP"),
        ("gamma_low", f"SBD γ_low={GAMMA_LOW:g}"),
        ("gamma_high", f"SBD γ_high={GAMMA_HIGH:g}"),
      ]
    )
    for key, label in decodings:
      row_key = f"{model}_model_ntp" if key == "ntp" else f"{model}_{key}"
      g = {"gamma_low": GAMMA_LOW, "gamma_high": GAMMA_HIGH}.get(key)
      code_row = c.get(f"{model}_gamma_{g:g}") if g is not None else None
      code = (
        "1.00x"
        if key == "ntp"
        else f"{code_row['nfe_speedup']:.2f}x ({code_row['agreement']:.2f})"
        if code_row
        else "-"
      )
      paper = PAPER_LLAMA.get(row_key if model != "matp_only" else "", None)
      body.append(
        [
          names[model],
          label,
          _acc(a.get(row_key)),
          code,
          f"{losses['arithmetic'][model]['loss']:.4f}",
          f"{losses['code'][model]['loss']:.4f}",
          _paper(paper[2][3]) if paper else "-",
          _paper(paper[2][4]) if paper else "-",
        ]
      )
  lines = [
    f"# Table 1 at small scale (size `{results['size']}`)",
    "",
    f"Model: {results['num_params'] / 1e6:.2f}M parameters ({size['model']}); arithmetic: "
    f"{size['steps']} steps of {size['batch_size']}x{size['seq_len']}; code (Python stdlib): "
    f"{size['code_steps']} steps of {size['code_batch_size']}x{size['code_seq_len']}; same data "
    f"and seed for every model. {results['arithmetic']['num_problems']} held-out problems, "
    f"block k={size['block_size']}, max {size['max_new_tokens']} new tokens, greedy; EB "
    f"entropy rule. NFE speedup = NTP forwards / SBD forwards per sample, to EOS, averaged. "
    f"Code: {results['code']['num_prompts']} held-out files, first {size['code_prompt_len']} "
    f"tokens continued by {size['code_new_tokens']}; agreement = fraction of the NTP "
    "continuation's tokens matched at the same position. Losses in nats per target token.",
    "",
    _md(header, body),
    "",
    "## Paper, Table 1 (Llama-3.1 8B rows, accuracy % and NFE speedup)",
    "",
    _md(
      ["model", "decoding", *PAPER_BENCHMARKS],
      [[m, d, *(_paper(x) for x in cells)] for m, d, cells in PAPER_LLAMA.values()],
    ),
    "",
  ]
  lines += ["## γ sweeps (SBD model, arithmetic)", ""]
  sweep_rows = [
    [
      rule,
      f"{r['gamma']:g}",
      f"{100 * r['accuracy']:.1f}",
      f"{r['mean_nfe']:.1f}",
      f"{r['nfe_speedup']:.2f}x",
    ]
    for rule, rows in results["arithmetic"]["sweeps"].items()
    for r in rows
  ]
  lines += [_md(["rule", "γ / f", "accuracy %", "mean NFE", "NFE speedup"], sweep_rows), ""]
  w = results["wallclock"]
  lines += [
    f"## Wall-clock (same process, model and cache; decode batch {w['batch_size']}, "
    f"{w['num_prompts']} problems, median of {w['repeats']}, {w['device']})",
    "",
    f"NTP: {1e3 * w['ntp']['s_per_token']:.3f} ms per generated token "
    f"(first call incl. compile {w['ntp']['first_call_s']:.1f} s).",
    "",
  ]
  wall_rows = [
    [
      f"{r['gamma']:g}",
      f"{1e3 * r['s_per_token']:.3f}",
      f"{r['nfe_speedup']:.2f}x",
      f"{r['measured_speedup']:.2f}x",
      f"{r['forwards_per_block']:.2f}",
      f"{r['predicted_paper']:.2f}x",
      f"{r['predicted_accounted']:.2f}x",
      f"{r['first_call_s']:.1f}",
    ]
    for r in w["sbd"]
  ]
  lines += [
    _md(
      [
        "γ (eb_entropy)",
        "ms / token",
        "NFE speedup",
        "wall-clock speedup",
        "forwards per block l",
        "predicted k·t(1)/(t(2k)+(l-1)t(k))",
        "predicted from per-sample counts",
        "first call s",
      ],
      wall_rows,
    ),
    "",
  ]
  f = w["forward"]
  ns = sorted(int(n) for n in f["time_s"])
  lines += [
    f"### time(n): one cached forward over n new tokens (batch {f['batch']}, "
    f"{f['cached_tokens']} cached tokens, median of {f['repeats']} x {f['inner']})",
    "",
    _md(
      ["n", *map(str, ns)],
      [
        ["ms", *(f"{1e3 * f['time_s'][str(n)]:.3f}" for n in ns)],
        ["time(n)/time(1)", *(f"{f['ratio_to_time1'][str(n)]:.2f}" for n in ns)],
      ],
    ),
    "",
    "Roofline Tables 3/4 (H100 and the given device): see roofline.md.",
    "",
  ]
  return "\n".join(lines)


def _md(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


# ------------------------------------------------------------------------------------------
# The whole run.


def run(
  out_dir: str,
  size: str | Size = "cpu",
  *,
  ablation: bool = False,
  peak_tflops: float = 312.0,
  bandwidth_gbs: float = 2039.0,
) -> dict[str, Any]:
  """Train (or reuse) every model under out_dir, evaluate, time, and write all outputs."""
  size_name = size if isinstance(size, str) else "custom"
  if isinstance(size, str):
    if size not in SIZES:
      raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    size = SIZES[size]
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.perf_counter()
  modes = ("ntp", "sbd") + (("matp_only",) if ablation else ())
  corpus = code_corpus.build(os.path.join(out_dir, "code_corpus"), size.code_max_files)
  log(
    f"code corpus from {corpus.root}: {corpus.num_train} train files "
    f"({corpus.train_bytes / 1e6:.1f} MB), {corpus.num_heldout} held-out "
    f"({corpus.heldout_bytes / 1e6:.1f} MB)"
  )

  training = {}
  for task in ("arithmetic", "code"):
    for mode in modes:
      c = train_config(size, mode, task, corpus.train_path)
      training[f"{task}/{mode}"] = ensure_trained(c, os.path.join(out_dir, "runs", task, mode))

  def load(task):
    out = {}
    for mode in modes:
      model, _, tokenizer, mask_id = workdir_lib.load_sampling_model(
        os.path.join(out_dir, "runs", task, mode)
      )
      out[mode] = (model, tokenizer, mask_id)
    return out

  arith_models, code_models = load("arithmetic"), load("code")
  tokenizer = arith_models["sbd"][1]
  arith_cfg = train_config(size, "sbd", "arithmetic")
  problems = make_eval_problems(arith_cfg.data, size.num_problems, seed=arith_cfg.train.seed)

  t_eval = time.perf_counter()
  loss_problems = make_eval_problems(arith_cfg.data, size.loss_problems, seed=0)
  arith_rows = pack_rows(
    [
      encode_record({"prompt": p.prompt, "completion": p.completion}, tokenizer, False)
      for p in loss_problems
    ],
    size.seq_len,
    size.loss_problems,
  )
  heldout_texts = code_corpus.read_texts(corpus.heldout_path)
  code_rows = pack_rows(
    [encode_record({"text": t}, code_models["sbd"][1], True) for t in heldout_texts],
    size.code_seq_len,
    size.loss_rows,
  )
  losses = {"arithmetic": {}, "code": {}}
  for mode in modes:
    losses["arithmetic"][mode] = heldout_ntp_loss(arith_models[mode][0], arith_rows)
    losses["code"][mode] = heldout_ntp_loss(code_models[mode][0], code_rows)
    log(
      f"held-out NTP loss, {mode} models: arithmetic "
      f"{losses['arithmetic'][mode]['loss']:.4f}, code {losses['code'][mode]['loss']:.4f}"
    )

  arithmetic = evaluate_arithmetic(arith_models, problems, size)
  code = evaluate_code(code_models, code_prompts(heldout_texts, tokenizer, size), size)
  t_wall = time.perf_counter()
  wall = measure_wallclock(*arith_models["sbd"], problems, size)
  roof, roof_md = roofline_tables(peak_tflops, bandwidth_gbs)
  num_params = sum(
    x.size
    for x in jax.tree.leaves(
      nnx.state(nnx.merge(arith_models["sbd"][0].graphdef, arith_models["sbd"][0].state), nnx.Param)
    )
  )
  results = {
    "size": size_name,
    "config": dataclasses.asdict(size),
    "models": list(modes),
    "num_params": int(num_params),
    "corpus": dataclasses.asdict(corpus),
    "training": training,
    "heldout_loss": losses,
    "arithmetic": arithmetic,
    "code": code,
    "wallclock": wall,
    "roofline": roof,
    "gamma_low": GAMMA_LOW,
    "gamma_high": GAMMA_HIGH,
    "paper_llama_3_1_8b": {
      k: {"model": m, "decoding": d, "cells": dict(zip(PAPER_BENCHMARKS, cells))}
      for k, (m, d, cells) in PAPER_LLAMA.items()
    },
    "seconds": {
      "training": sum(t["seconds"] for t in training.values()),
      "evaluation": t_wall - t_eval,
      "wallclock": time.perf_counter() - t_wall,
      "total": time.perf_counter() - t_start,
    },
    "jax_version": jax.__version__,
    "backend": jax.default_backend(),
  }
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out_dir, "table1.md"), "w") as f:
    f.write(format_table1(results))
  with open(os.path.join(out_dir, "roofline.md"), "w") as f:
    f.write(roof_md)
  plots.write_all(results, out_dir)
  log(
    f"done in {results['seconds']['total']:.0f} s; wrote results.json, table1.md, roofline.md "
    f"and 3 plots to {out_dir}"
  )
  return results


def main(argv: Sequence[str] | None = None) -> None:
  from absl import app, flags, logging

  flags.DEFINE_string("out", None, "Output directory (trained workdirs under it are reused).")
  flags.DEFINE_enum("size", "cpu", sorted(SIZES), "Benchmark size.")
  flags.DEFINE_bool("ablation", False, "Also train and evaluate a MATP-only model.")
  flags.DEFINE_float("peak_tflops", 312.0, "Roofline: peak TFLOP/s of the given device.")
  flags.DEFINE_float("bandwidth_gbs", 2039.0, "Roofline: memory bandwidth (GB/s) of the device.")
  flags.mark_flags_as_required(["out"])

  def _main(args):
    del args
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    f = flags.FLAGS
    results = run(
      f.out, f.size, ablation=f.ablation, peak_tflops=f.peak_tflops, bandwidth_gbs=f.bandwidth_gbs
    )
    with open(os.path.join(f.out, "table1.md")) as fh:
      print(fh.read())
    del results

  app.run(_main, argv=argv or sys.argv)


if __name__ == "__main__":
  main()
