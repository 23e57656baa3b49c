"""Verified SBD against NTP where drafts are accepted by construction: random weights of a
preset's shape, so that what verification costs and gains at a known acceptance is measured
apart from what a model learned (vLLM's synthetic acceptance length, made exact).

    python -m benchmarks.synthetic_acceptance --out=DIR [--models=tiny --dtype=float32
        --batches=1,16 --accepted=0,4,all --prompt_len=16 --max_new_tokens=128 --repeats=3]

Per model and batch: random prompts, and NTP's greedy decode of them (EOS off) gives each row's
tokens. For each k of --accepted, a verified draft at response slot r is NTP's own token unless
r % (k + 2) == k + 1, where it is a token NTP did not choose (`oracle_drafts`): after its
first, a check whose forward drafts the whole block accepts k drafts
(`k_accepted_per_check`; k = all: every draft is NTP's), and every draft has probability 1
by the model's log-probabilities (`oracle_drafts`' `sure`: random weights are sure of nothing). The verified
decode runs as by default (each forward chosen by the costs it measures, `decode.costs`), and
it and NTP's are timed side by side (`decode_timing`, each timed call after an untimed one),
each k's programs compiled apart. The verified text must be NTP's, token for token. Outputs:
DIR/results.json, DIR/synthetic_acceptance.md, DIR/synthetic_acceptance.png.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import decode_speed, decode_timing, report
from sbd_jax import cli
from sbd_jax.decode import reveal, sampler, sampling
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import prompt_keys
from sbd_jax.model.transformer import count_params

ALL = -1  # k: every draft is NTP's token


def oracle_drafts(
  ntp_tokens: Sequence[Sequence[int]], accepted: Callable, seed: int = 0, sure: bool = False
):
  """A replacement for `reveal.pick_rows` (bind it before a program traces): a draft at
  response slot r of the row holding prompt j is NTP's own token `ntp_tokens[j][r]` where
  `accepted(slot_BP, st)` holds (the drafted slots, and the decode state drafting them), and a
  token NTP did not choose elsewhere. A row's prompt is found
  by its key (`state.prompt_keys(seed, j)`), in any batch or queue. With `sure`, each drafted
  token also has probability 1 (its log-probabilities are one-hot): random weights' flat
  logits would otherwise decide which positions an adaptive decode drafts
  (`policy.sure_enough`), where the drafts are not the model's."""
  r = max(len(t) for t in ntp_tokens)
  ntp_JR = jnp.asarray([list(t) + [0] * (r - len(t)) for t in ntp_tokens], jnp.int32)
  keys_J = jax.random.key_data(prompt_keys(seed, jnp.arange(len(ntp_tokens))))

  def drafted(logits_BPV, st, slot_BP, s):
    tokens_BP, logp_BPV = sampling.pick_rows(logits_BPV, st, slot_BP, s)
    same_BJ = jnp.all(jax.random.key_data(st.key_B)[:, None] == keys_J[None], axis=-1)
    ntp_BR = ntp_JR[jnp.argmax(same_BJ, axis=1)]
    right_BP = jnp.take_along_axis(ntp_BR, jnp.clip(slot_BP, 0, r - 1), axis=1)
    wrong_BP = jnp.where(right_BP == 7, 8, 7)
    tokens_BP = jnp.where(accepted(slot_BP, st), right_BP, wrong_BP).astype(tokens_BP.dtype)
    if sure:  # log 1 for the drafted token, a log-probability far below every other's
      vocab_V = jnp.arange(logp_BPV.shape[-1])
      logp_BPV = jnp.where(vocab_V == tokens_BP[..., None], 0.0, -1e4).astype(logp_BPV.dtype)
    return tokens_BP, logp_BPV

  return drafted


def k_accepted_per_check(k: int) -> Callable:
  """`oracle_drafts`' rule for k drafts accepted per check: slot r is drafted right unless
  r % (k + 2) == k + 1 (k = ALL: every slot). A check rejects the draft after k right ones and
  settles NTP's token there; the next forward drafts again (the drafts made beside the check
  followed the rejected token) and settles one token: k + 2 tokens every two forwards."""
  if k == ALL:
    return lambda slot_BP, st: jnp.ones(slot_BP.shape, bool)
  return lambda slot_BP, st: slot_BP % (k + 2) != k + 1


def geometric(q, seed: int = 0) -> Callable:
  """`oracle_drafts`' rule for drafts each right with probability q, drawn afresh for every
  row, slot and forward that drafts it: a check's accepted run is geometric, the run the
  policy's model assumes (`policy.settled_per_forward`). `q` may also be a sequence, the
  probability at each position of the drafting block (drafts deeper in a block are often
  worse)."""
  base = jax.random.key(seed)

  def accepted(slot_BP, st):
    q_P = jnp.asarray(q, jnp.float32)
    q_P = q_P[: slot_BP.shape[1]] if q_P.ndim else q_P  # by the block's columns

    def row(row_key, nfe, slot_P):
      key = jax.random.fold_in(base, nfe)
      key = jax.random.fold_in(key, jax.random.randint(row_key, (), 0, 2**31 - 1))
      draw = lambda slot: jax.random.uniform(jax.random.fold_in(key, slot))  # noqa: E731
      return jax.vmap(draw)(slot_P) < q_P

    return jax.vmap(row)(st.key_B, st.nfe_B, slot_BP)

  return accepted


def measure_row(model, prompts, base: SamplerSettings, ntp_out, k: int, repeats: int) -> dict:
  """NTP's and the verified decode of `prompts` (one batch) timed side by side, the drafts
  accepted k at a time (`k_accepted_per_check`); their numbers for the table."""
  ntp, verified = base.replace(mode="ntp"), base.replace(verify=True)
  jax.clear_caches()  # the drafts are bound at tracing: every k compiles its own programs
  original = reveal.pick_rows
  reveal.pick_rows = oracle_drafts(ntp_out.tokens, k_accepted_per_check(k), sure=True)
  try:
    # Each setting decodes with a prior of its own (`decode_timing`), started afresh for each k.
    rounds = decode_timing.DecodeRounds(
      model, prompts, [ntp, verified], batch_size=len(prompts), warm=True, log=lambda _: None
    )
    decode_timing.interleave([rounds], [], repeats=repeats, min_total_s=0.5)
  finally:
    reveal.pick_rows = original
    jax.clear_caches()
  out = rounds.outs[1]
  if out.tokens != ntp_out.tokens:
    raise AssertionError(f"k={k}: the verified text is not NTP's")
  (t_ntp, t_ver), (f_ntp, f_ver) = rounds.samples, [min(t) for t in rounds.samples]
  tokens = int(sum(len(t) for t in out.tokens))
  med = lambda t: float(np.median(t))  # noqa: E731
  table = out.cost_table
  return {
    "accepted": "all" if k == ALL else k,
    "ntp_tokens_per_s": tokens / med(t_ntp),
    "verified_tokens_per_s": tokens / med(t_ver),
    "speedup": med(t_ntp) / med(t_ver),
    "fastest_speedup": f_ntp / f_ver,
    "forwards_per_token": float(out.nfe.sum()) / tokens,
    "accepted_per_check": float(out.accepted_tokens.sum()) / max(int(out.drafts.sum()), 1),
    "kind_forwards": np.asarray(out.batch_kind_forwards)[0].tolist(),  # one batch: its call's
    "ntp_calls": out.ntp_calls,
    "cost_table": None if table is None else table.as_dict(),
    "seconds": {"ntp": t_ntp, "verified": t_ver},
  }


def model_rows(name, dtype, batches, ks, prompt_len, max_new_tokens, repeats, log) -> list[dict]:
  cfg = decode_speed.model_config(name, dtype)
  model = decode_speed.random_model(cfg)
  base = SamplerSettings(
    eos_id=-1,  # every decode runs to max_new_tokens
    mask_id=cfg.vocab_size - 1,
    pad_id=0,
    block_size=decode_speed.BLOCK,
    max_new_tokens=max_new_tokens,
  )
  rng = np.random.default_rng(0)
  rows = []
  for batch in batches:
    prompts = rng.integers(1, min(cfg.vocab_size - 1, 256), (batch, prompt_len)).tolist()
    ntp_out = sampler.decode(model, prompts, base.replace(mode="ntp"))
    for k in ks:
      began = time.perf_counter()
      got = measure_row(model, prompts, base, ntp_out, k, repeats)
      got.update(model=name, params=count_params(model.state), batch=batch, block=base.block_size)
      rows.append(got)
      log(
        f"{name} batch {batch} k={got['accepted']}: verified {got['speedup']:.2f}x NTP "
        f"(fastest {got['fastest_speedup']:.2f}x), {got['forwards_per_token']:.3f} forwards a "
        f"token, {got['accepted_per_check']:.2f} accepted a check, {got['ntp_calls']} calls as "
        f"NTP's program [{time.perf_counter() - began:.0f} s]"
      )
  return rows


HEADER = [
  "model", "batch", "accepted a check (k)", "NTP tok/s", "verified tok/s", "verified / NTP",
  "fastest calls", "forwards / token", "accepted a check", "forwards by kind", "NTP's program",
  "time(2D) / time(1)",
]  # fmt: skip


def _costs(table: dict | None) -> str:
  if table is None:
    return ""
  one = table["seconds"][0]
  return ", ".join(f"{k} {t / one:.2f}" for k, t in zip(table["kinds"][1:], table["seconds"][1:]))


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
  body = [
    [
      f"{r['model']} ({r['params'] / 1e6:.1f}M)",
      str(r["batch"]),
      str(r["accepted"]),
      f"{r['ntp_tokens_per_s']:.0f}",
      f"{r['verified_tokens_per_s']:.0f}",
      f"**{r['speedup']:.2f}x**",
      f"{r['fastest_speedup']:.2f}x",
      f"{r['forwards_per_token']:.3f}",
      f"{r['accepted_per_check']:.2f}",
      ", ".join(str(n) for n in r["kind_forwards"]),
      str(r["ntp_calls"]),
      _costs(r["cost_table"]),
    ]
    for r in rows
  ]
  return report.table(HEADER, body)


def constructed(row: dict[str, Any]) -> int:
  """The drafts a check accepts by construction: k, or all of a block's (its size less one)."""
  return row["block"] - 1 if row["accepted"] == "all" else row["accepted"]


def plot(rows: Sequence[dict[str, Any]], path: str) -> report.Series:
  with report.figure(path, 1) as (ax,):
    for model in dict.fromkeys(r["model"] for r in rows):
      for batch in dict.fromkeys(r["batch"] for r in rows):
        series = [r for r in rows if r["model"] == model and r["batch"] == batch]
        ax.plot(
          [constructed(r) for r in series],
          [r["speedup"] for r in series],
          "-o",
          label=f"{model}, batch {batch}",
        )
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.set_xlabel("draft tokens a check would accept (k; all: the block's)")
    ax.set_ylabel("verified / NTP tokens per second")
    ax.legend(fontsize=7)
    return report.drawn([ax])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    batches = [int(b) for b in f.batches]
    ks = [ALL if k == "all" else int(k) for k in f.accepted]
  except ValueError:
    cli.fail(ValueError("--batches must be integers and --accepted integers or 'all'"))
  if any(b < 1 for b in batches) or any(k < 0 and k != ALL for k in ks):
    cli.fail(ValueError("--batches must be >= 1 and --accepted >= 0 (or 'all')"))
  rows = []
  for name in f.models:
    rows += model_rows(name, f.dtype, batches, ks, f.prompt_len, f.max_new_tokens, f.repeats, print)
  table = format_markdown(rows)
  print(table)
  settings = {k: getattr(f, k) for k in ("models", "dtype", "batches", "accepted", "prompt_len")}
  settings.update(max_new_tokens=f.max_new_tokens, repeats=f.repeats, devices=str(jax.devices()))
  report.save(
    f.out, "synthetic_acceptance", {"settings": settings, "rows": rows}, table,
    lambda path: plot(rows, path),
  )  # fmt: skip


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_list("models", ["tiny"], f"Random-weight models: {', '.join(decode_speed.MODELS)}.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and compute dtype.")
  flags.DEFINE_list("batches", ["1", "16"], "Batch sizes.")
  flags.DEFINE_list("accepted", ["0", "4", "all"], "Draft tokens accepted per check (k), or all.")
  flags.DEFINE_integer("prompt_len", 16, "Prompt length (random token ids).")
  flags.DEFINE_integer("max_new_tokens", 128, "Generated tokens per row (EOS off).")
  flags.DEFINE_integer("repeats", 3, "Timed calls per decode, at least (median reported).")
  cli.run(main)
