"""Evaluating a trained workdir: the params export loaded back, every number of the report
against decodes made independently, scoring on known answers, and the CLIs' error paths."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from run_helpers import untrained_workdir  # tests/ is on sys.path
from tensorboard.backend.event_processing import event_accumulator

from sbd_jax import config as config_lib
from sbd_jax.attention.meta import TokenMeta
from sbd_jax.constrain.spec import Constraint
from sbd_jax.data import arithmetic
from sbd_jax.data.pipeline import make_eval_problems
from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.decode import sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.decode.settings import SamplerSettings, settings_for
from sbd_jax.evals import diagnostics, results, runner, stats, workdir_eval
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.model.architectures import tiny
from sbd_jax.model.transformer import Transformer
from sbd_jax.run import compare, loading
from sbd_jax.run import workdir as workdir_lib
from sbd_jax.training import dashboards


def _config():
  c = config_lib.base_config(
    tiny(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
  )
  c.sample.num_problems = 4
  c.sample.max_new_tokens = 12
  c.sample.block_size = 4
  c.sample.batch_size = 4
  return c


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("run"))
  c = _config()
  return untrained_workdir(path, c)


def test_loader_restores_the_exported_params(workdir):
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  assert model.cfg.attention_impl == "dense" and mask_id == tokenizer.mask_id == 259
  expected = nnx.jit(lambda: Transformer(config_lib.to_model_config(config), rngs=nnx.Rngs(0)))()
  want = jax.tree.leaves(nnx.state(expected, nnx.Param))
  got = jax.tree.leaves(nnx.state(nnx.merge(model.graphdef, model.state), nnx.Param))
  assert len(want) == len(got) == len(jax.tree.leaves(model.state)) - 2  # + 2 RoPE tables
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a, b)


def _independent_decodes(workdir, c, problems, **settings):
  """The texts and NFE of every decoding of `problems`, decoded without the evaluation code."""
  model, _, tokenizer, mask_id = loading.load_sampling_model(workdir)
  base = SamplerSettings(
    eos_id=tokenizer.eos_id,
    pad_id=tokenizer.pad_id,
    mask_id=mask_id,
    block_size=c.sample.block_size,
    max_new_tokens=c.sample.max_new_tokens,
    **settings,
  )
  prompts = [p.prompt for p in problems]
  decode = lambda s: sampler.decode_text(model, tokenizer, prompts, s, batch_size=4)  # noqa: E731
  out = {"ntp": decode(base.replace(mode="ntp"))}
  for g in c.sample.gammas:  # plain, then verified (the run's default: both)
    out[f"sbd eb_entropy γ={g:g}"] = decode(base.replace(gamma=g, verify=False))
  # Verified, drafting every masked position (the default): the rule and γ do not enter.
  out["sbd verified"] = decode(base.replace(verify=True, draft="all"))
  return out


@pytest.mark.integration  # a workdir's whole evaluation or diagnostics
def test_report_after_training_equals_independent_decodes(workdir, capsys):
  """The end of the main job: the returned numbers are those of `sampler.decode_text` run on
  the run's own held-out problems with the run's settings; the printed table and the
  TensorBoard scalars carry the same numbers. The verified decodes' forward costs are fixed:
  two measurements on a loaded machine can differ enough to choose other forwards."""
  c = _config()
  c.sample.wide_cost = 3.0
  summary = workdir_eval.report_after_training(workdir, c)
  problems = make_eval_problems(c.data, c.sample.num_problems, seed=c.train.seed)
  decoded = _independent_decodes(workdir, c, problems, wide_cost=c.sample.wide_cost)
  assert [r["decoding"] for r in summary["decodings"]] == list(decoded)
  assert summary["num_problems"] == 4 and summary["max_new_tokens"] == 12
  ntp_nfe = decoded["ntp"].nfe
  for r in summary["decodings"]:
    out = decoded[r["decoding"]]
    correct = [arithmetic.extract_answer(t) == p.answer for p, t in zip(problems, out.texts)]
    assert r["accuracy"] == np.mean(correct)
    assert r["mean_nfe"] == pytest.approx(np.mean(out.nfe))
    assert r["nfe_speedup"] == pytest.approx(np.mean(ntp_nfe / np.maximum(out.nfe, 1)))
    assert r["rows_busy"] == pytest.approx(np.sum(out.nfe) / np.sum(out.batch_forwards))
  table = capsys.readouterr().out
  for r in summary["decodings"]:
    (line,) = [x for x in table.splitlines() if x[:33].rstrip() == r["decoding"]]
    assert f"{r['mean_nfe']:.1f}" in line and f"{r['nfe_speedup']:.2f}x" in line
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, dashboards.TENSORBOARD_DIR))
  acc.Reload()
  speedup = acc.Scalars("eval/sbd_eb_entropy_gamma0.35_nfe_speedup")
  assert [(e.step, e.value) for e in speedup] == [
    (c.train.steps, pytest.approx(summary["decodings"][2]["nfe_speedup"]))
  ]


def _stub_decode(answers_for, nfe_for):
  """A `sampler.decode` stand-in: prompt i's completion is `answers_for(mode, i)` (as byte
  tokens) and its NFE `nfe_for(mode, i)`, so evaluation is checked on known answers."""
  tok = ByteTokenizer()

  def decode(model, prompts, settings, **kwargs):
    del model
    n, b = len(prompts), kwargs["batch_size"]
    tokens = [tok.encode(answers_for(settings.mode, i)) for i in range(n)]
    nfe = np.array([nfe_for(settings.mode, i) for i in range(n)])
    # Rows that never wait for each other: a batch runs as many forwards as its slowest row.
    batch_forwards = np.concatenate(
      [np.full(len(c), c.max()) for c in np.split(nfe, range(b, n, b))]
    )
    return sampler.DecodeOutput(tokens, [[]] * n, nfe, np.ones(n, bool), None, batch_forwards)

  return decode


def _evaluate_stubbed(problems, gammas):
  tok = ByteTokenizer()
  base = settings_for(tok, 259, block_size=4, max_new_tokens=8, verify=False)
  decodings = runner.standard_decodings(base, ["eb_entropy"], gammas)
  return runner.evaluate(None, tok, arithmetic_task.TASK, problems, decodings, batch_size=8)


def test_evaluation_scores_known_answers(monkeypatch):
  problems = arithmetic_task.problems(config_lib.base_config().data, 40, seed=5)
  gold = [p.record["completion"] for p in problems]

  # NTP answers everything right in 60 forwards; SBD gets the first 30 right (the rest are off
  # by one) in 20 forwards for even problems and 30 for odd ones.
  def answers(mode, i):
    if mode == "ntp" or i < 30:
      return gold[i]
    answer = problems[i].record["answer"]
    return gold[i].replace(f"is {answer}.", f"is {answer + 1}.")

  nfe = lambda mode, i: 60 if mode == "ntp" else (20 if i % 2 == 0 else 30)
  monkeypatch.setattr(sampler, "decode", _stub_decode(answers, nfe))
  ntp, sbd = _evaluate_stubbed(problems, [0.5])["decodings"]
  assert ntp["accuracy"] == 1.0 and ntp["mean_nfe"] == 60
  assert sbd["accuracy"] == 0.75 and sbd["mean_nfe"] == 25
  assert sbd["nfe_speedup"] == pytest.approx((3.0 + 2.0) / 2)  # mean over problems of 60/nfe
  assert sbd["minus_ntp"]["mean"] == pytest.approx(-0.25)
  lo, hi = sbd["minus_ntp"]["ci95"]
  assert lo < -0.25 < hi < 0  # a 10-of-40 loss is significant
  lo, hi = sbd["ci95"]
  assert lo < 0.75 < hi and hi - lo < 0.3
  # Batches of 8 alternate 20- and 30-forward rows: each runs 30 forwards for 8 rows.
  assert ntp["rows_busy"] == 1.0
  assert sbd["rows_busy"] == pytest.approx(25 / 30)


def test_rows_busy_counts_the_forwards_of_rows_already_done():
  nfe = np.asarray([2, 4, 4, 4, 3])
  # batches of 2: [2, 4] -> 8 row-forwards for 6 used, [4, 4] -> 8 for 8, [3] -> 3 for 3
  assert stats.rows_busy(nfe, np.asarray([4, 4, 4, 4, 3])) == pytest.approx(17 / 19)
  # An SBD batch can run more forwards than its slowest row needs (rows wait at each block).
  assert stats.rows_busy(nfe, np.asarray([5, 5, 4, 4, 3])) == pytest.approx(17 / 21)


def test_the_automatic_budget_covers_every_reference_answer(capsys):
  tok = ByteTokenizer()
  problems = arithmetic_task.problems(config_lib.base_config().data, 8, seed=0)
  longest = max(len(tok.encode(p.record["completion"])) + 1 for p in problems)  # with its EOS
  limit = runner.reference_budget(problems, tok, 16)
  assert limit % 16 == 0 and longest <= limit < longest + 16
  workdir_eval.warn_if_answers_are_cut(arithmetic_task.TASK, problems, tok, longest)
  assert capsys.readouterr().err == ""
  workdir_eval.warn_if_answers_are_cut(arithmetic_task.TASK, problems, tok, longest - 1)
  assert "shorter than the longest reference answer" in capsys.readouterr().err


def test_evaluation_of_noise_scores_zero(monkeypatch):
  problems = arithmetic_task.problems(config_lib.base_config().data, 16, seed=6)
  noise = lambda mode, i: " She has many. The answer is none."
  monkeypatch.setattr(sampler, "decode", _stub_decode(noise, lambda m, i: 8))
  ntp, sbd = _evaluate_stubbed(problems, [0.0])["decodings"]
  assert ntp["accuracy"] == sbd["accuracy"] == 0.0
  assert ntp["ci95"][0] == 0.0 and ntp["ci95"][1] > 0.0


def test_gamma_zero_has_no_speedup(workdir):
  """γ = 0 reveals one token per forward: the NFE of SBD equals NTP's when neither stops early."""
  summary = workdir_eval.evaluate_workdir(workdir, gammas=[0.0], num_problems=4, verify=False)
  ntp, sbd = summary["decodings"]
  assert ntp["mean_nfe"] == sbd["mean_nfe"] == 12
  assert sbd["nfe_speedup"] == 1.0


@pytest.mark.integration  # a workdir's whole evaluation or diagnostics
def test_diagnostics_measure_the_same_tokens_as_a_plain_ntp_pass(workdir):
  """At mask rate 1 every completion token (and the EOS) is counted once, and the NTP column is
  the loss a plain causal forward of each problem alone gives those tokens."""
  d = diagnostics.diagnose_workdir(workdir, num_problems=3, seed=4, num_reveal_examples=2)
  model, config, tokenizer, _ = loading.load_sampling_model(workdir)
  problems = make_eval_problems(config.data, 3, seed=4)
  net = nnx.merge(model.graphdef, model.state)
  losses, ntp_right = [], []
  for p in problems:
    prompt = [tokenizer.bos_id] + tokenizer.encode(p.prompt)
    tokens = prompt + tokenizer.encode(p.completion) + [tokenizer.eos_id]
    ids = jnp.asarray([tokens])
    meta = TokenMeta.causal(jnp.ones_like(ids), jnp.arange(len(tokens))[None])
    logp = jax.nn.log_softmax(net(ids, meta)[0][0].astype(jnp.float32))
    losses += [-logp[t - 1, tokens[t]] for t in range(len(prompt), len(tokens))]
    ntp_right += [
      int(jnp.argmax(logp[t - 1])) == tokens[t] for t in range(len(prompt), len(tokens))
    ]
  full = d["loss_by_offset"]["rates"]["1"]
  assert sum(full["tokens"]) == len(losses)
  np.testing.assert_allclose(full["ntp_mean"], np.mean(losses), rtol=1e-5)
  misses = d["masked_misses"]
  assert misses["tokens"] == len(ntp_right)
  assert misses["ntp_accuracy"] == pytest.approx(np.mean(ntp_right))
  assert misses["revealed_above_gamma"] <= misses["revealed_first_forward"] <= misses["misses"]
  assert list(d["decoding"]) == [
    "ntp", "sbd eb_entropy γ=0 k=1", "sbd eb_entropy γ=0 k=4", "sbd eb_entropy γ=0.35 k=4"
  ]  # fmt: skip
  assert d["decoding"]["sbd eb_entropy γ=0 k=4"]["mean_nfe"] == d["decoding"]["ntp"]["mean_nfe"]
  assert len(d["reveal_order"]) == 2
  assert "held-out loss" in diagnostics.format_diagnostics(d)
  assert "masked whole" in diagnostics.format_diagnostics(d)


@pytest.mark.integration  # a workdir's whole evaluation or diagnostics
def test_diagnostics_of_jsonl_records_equal_those_of_the_same_problems_drawn(workdir, tmp_path):
  """The built-in problems written as an `exact` task's JSONL give the same losses, misses and
  forwards: the records path packs and decodes the same tokens."""
  drawn = diagnostics.diagnose_workdir(workdir, num_problems=3, seed=4, num_reveal_examples=1)
  config = workdir_lib.read_trained_config(workdir)
  path = tmp_path / "held_out.jsonl"
  rows = [
    {"prompt": p.prompt, "completion": p.completion} for p in make_eval_problems(config.data, 3, 4)
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  given = diagnostics.diagnose_workdir(
    workdir, "exact", data=str(path), num_problems=3, num_reveal_examples=1
  )
  assert given["source"] == str(path) and given["num_problems"] == 3
  assert given["loss_by_offset"] == drawn["loss_by_offset"]
  assert given["masked_misses"] == drawn["masked_misses"]
  assert given["reveal_order"] == drawn["reveal_order"]
  for name, r in drawn["decoding"].items():
    assert given["decoding"][name]["mean_nfe"] == r["mean_nfe"]
  assert "held_out.jsonl" in diagnostics.format_diagnostics(given)


def test_diagnostics_refuse_records_without_reference_completions(workdir, tmp_path):
  path = tmp_path / "gsm8k.jsonl"
  path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
  with pytest.raises(ValueError, match="reference completions"):
    diagnostics.diagnose_workdir(workdir, "gsm8k", data=str(path))
  with pytest.raises(ValueError, match="needs --data"):
    diagnostics.diagnose_workdir(workdir, "exact")
  with pytest.raises(ValueError, match="draws its problems"):
    diagnostics.diagnose_workdir(workdir, data=str(path))


@pytest.mark.integration  # a workdir's whole evaluation or diagnostics
def test_sample_workdir_equals_independent_decodes(workdir):
  """`sample`'s texts and forwards are those of `sampler.decode_text` with the run's settings
  and the given overrides; refilled rows (one or two at a time) change nothing. Every forward
  at one cost (`wide_cost=1`), a verified row's forwards do not depend on its neighbours."""
  prompts = ["Q: Ana has 3 pens.\nA:", "Q: Bo has 41 cups. First, he drops 7 cups.\nA:"]
  got = compare.sample_workdir(workdir, prompts, gamma=0.5, wide_cost=1.0)
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  s = SamplerSettings(
    eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, mask_id=mask_id, block_size=4,
    max_new_tokens=12, gamma=0.5, wide_cost=1.0,
  )  # fmt: skip
  sbd = sampler.decode_text(model, tokenizer, prompts, s)
  ntp = sampler.decode_text(model, tokenizer, prompts, s.replace(mode="ntp"))
  assert [r["sbd"] for r in got] == sbd.texts and [r["ntp"] for r in got] == ntp.texts
  assert [r["sbd_nfe"] for r in got] == list(sbd.nfe) and [r["ntp_nfe"] for r in got] == [12, 12]
  assert [r["nfe_speedup"] for r in got] == pytest.approx(list(ntp.nfe / sbd.nfe))
  assert [r["sbd_decoding"] for r in got] == ["sbd verified"] * 2
  assert "sbd verified (" in compare.format_results(got)
  for rows in (1, 2):
    refilled = compare.sample_workdir(
      workdir, prompts, gamma=0.5, wide_cost=1.0, refill=True, refill_rows=rows, batch_size=2
    )
    assert refilled == got


@pytest.mark.integration
def test_sample_workdir_writes_within_a_constraint(workdir):
  """`sample --regex` (a `constraint` override): SBD's and NTP's texts match it and are
  complete, verified SBD's is NTP's constrained text, and the report says so."""
  prompts = ["Q: Ana has 3 pens.\nA:", "Q: what now?"]
  got = compare.sample_workdir(workdir, prompts, constraint=Constraint.regex(" [0-9]{2,3}"))
  for r in got:
    assert re.fullmatch(" [0-9]{2,3}", r["sbd"]) and r["sbd"] == r["ntp"], r
    assert r["sbd_complete"] and r["ntp_complete"]
  assert "constraint: SBD complete" in compare.format_results(got)


def test_bad_requests(workdir, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    loading.load_sampling_model(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="no params export"):
    loading.load_sampling_model(str(tmp_path))
  with pytest.raises(ValueError, match="unknown reveal rule"):
    workdir_eval.evaluate_workdir(workdir, rules=["nope"])
  with pytest.raises(ValueError, match="gamma must be >= 0"):
    workdir_eval.evaluate_workdir(workdir, gammas=[-1.0])
  with pytest.raises(ValueError, match=r"threshold in \(0, 1\]"):
    workdir_eval.evaluate_workdir(workdir, rules=["confidence_threshold"], gammas=[0.0])
  # A block larger than the run trained on (sbd.k_max) is refused before any decoding.
  k_max = _config().sbd.k_max
  with pytest.raises(ValueError, match=f"block_size {k_max + 1} exceeds the largest block"):
    compare.sample_workdir(workdir, ["Q: hi"], block_size=k_max + 1)
  with pytest.raises(ValueError, match=f"block_size {k_max + 1} exceeds the largest block"):
    workdir_eval.evaluate_workdir(workdir, block_size=k_max + 1)
  with pytest.raises(ValueError, match="needs --data"):
    workdir_eval.evaluate_workdir(workdir, "gsm8k")
  with pytest.raises(ValueError, match="empty"):
    compare.sample_workdir(workdir, [""])
  with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
    compare.sample_workdir(workdir, ["Q: hi"], block_size=0)


@pytest.mark.integration
@pytest.mark.parametrize("module", ["sbd_jax.sample", "sbd_jax.evaluate"])
def test_cli_missing_workdir_is_one_clear_line(module, tmp_path):
  args = [sys.executable, "-m", module, f"--workdir={tmp_path / 'nope'}"]
  if module == "sbd_jax.sample":
    args.append("--prompt=hi")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode != 0
  assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
  "module, flag, message",
  [
    ("sbd_jax.sample", "--block_size=0", "block_size must be >= 1, got 0"),
    ("sbd_jax.evaluate", "--max_new_tokens=-3", "max_new_tokens must be >= 1, got -3"),
    ("sbd_jax.sample", "--wide_cost=0.5", "wide_cost must be 0 (measured) or >= 1, got 0.5"),
    ("sbd_jax.sample", "--regex=(a", "holds an unbalanced"),
    ("sbd_jax.evaluate", "--choices=a,b", ""),  # with --regex below: one of them only
  ],
)
def test_cli_refuses_an_invalid_sampling_override(workdir, module, flag, message):
  """A flag overrides the run's setting and is validated as the setting is, in one line; it is
  never replaced by the run's value. A constraint that does not compile, or two given, too."""
  args = [sys.executable, "-m", module, f"--workdir={workdir}", flag, "--prompt=hi"]
  if module == "sbd_jax.evaluate":
    args = args[:-1] + ["--num_problems=1"]
  if flag.startswith("--choices"):
    args.append("--regex=[0-9]+")
    message = "give one of --regex, --json_schema, --choices, not ['regex', 'choices']"
  proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=dict(os.environ))
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last, proc.stderr


@pytest.mark.integration  # a workdir's whole evaluation
def test_lockstep_and_refill_reach_the_decode(workdir, monkeypatch):
  """`lockstep`, `refill` and `refill_rows` (the CLI's flags) reach every decode's settings;
  refill decodes on the batches' mesh, to the same answers and NFE."""
  seen = []
  decode = sampler.decode

  def recording(model, prompts, settings, **kwargs):
    seen.append((settings, kwargs["mesh"]))
    return decode(model, prompts, settings, **kwargs)

  monkeypatch.setattr(sampler, "decode", recording)
  summaries = {}
  for lockstep, refill in ((False, False), (True, False), (False, True)):
    summaries[lockstep, refill] = workdir_eval.evaluate_workdir(
      workdir,
      gammas=[0.5],
      num_problems=2,
      lockstep=lockstep,
      refill=refill,
      refill_rows=1 + refill,
      verify=False,  # plain SBD only (verified rows move alone: no lockstep)
    )
  with pytest.raises(ValueError, match="verify rolls rows back alone: set lockstep=False"):
    workdir_eval.evaluate_workdir(workdir, num_problems=2, lockstep=True)
  assert [(s.mode, s.lockstep, s.refill) for s, _ in seen] == [
    ("ntp", False, False),
    ("sbd", False, False),
    ("ntp", True, False),
    ("sbd", True, False),
    ("ntp", False, True),
    ("sbd", False, True),
  ]
  assert len({None if mesh is None else tuple(mesh.shape.items()) for _, mesh in seen}) == 1
  assert [s.refill_rows for s, _ in seen] == [1, 1, 1, 1, 2, 2]  # --refill_rows reaches it too
  with pytest.raises(ValueError, match="applies to refill"):
    workdir_eval.evaluate_workdir(workdir, num_problems=2, refill_rows=2)
  plain, refilled = summaries[False, False], summaries[False, True]
  for a, b in zip(plain["decodings"], refilled["decodings"]):
    assert (a["accuracy"], a["mean_nfe"]) == (b["accuracy"], b["mean_nfe"])


@pytest.mark.integration
@pytest.mark.parametrize("draft", ["all", "rule"])
def test_verified_evaluation_scores_ntps_answers(workdir, draft):
  """`--verify` (the default): SBD also runs verified, after the plain decodings: once when
  rows draft every masked position (the rule and γ do not enter), per (rule, γ) when the rule
  picks the drafts. The verified answers are NTP's; the rows and the printed table name them
  verified, give tokens per forward and report acceptance as serving stacks do. (Every kind of
  forward at one cost, `wide_cost=1`: with costs measured on a CPU a verified decode may run
  NTP's forwards throughout, draft nothing and have no acceptance to report.)"""
  summary = workdir_eval.evaluate_workdir(
    workdir, rules=["eb_entropy", "threshold"], gammas=[0.1, 1.0], num_problems=4, verify=True,
    draft=draft, with_records=True, wide_cost=1.0,
  )  # fmt: skip
  names = [r["decoding"] for r in summary["decodings"]]
  plain = [f"sbd {r} γ={g:g}" for r in ("eb_entropy", "threshold") for g in (0.1, 1.0)]
  verified = ["sbd verified"] if draft == "all" else [n + " verified" for n in plain]
  assert names == ["ntp"] + plain + verified
  completions = {}
  for r in summary["records"]:
    completions.setdefault(r["decoding"], []).append(r["completion"])
    assert len(r["accepted_by_position"]) == summary["block_size"] - 1
    assert r["accepted_tokens"] == sum(r["accepted_by_position"]) <= r["draft_tokens"]
  assert all(completions[n] == completions["ntp"] for n in verified)
  for r in summary["decodings"]:
    is_verified = r["decoding"].endswith("verified")
    assert not is_verified or r["minus_ntp"]["mean"] == 0
    assert r["tokens_per_forward"] > 0
    assert (r["acceptance"] is not None) == is_verified  # plain SBD drafts nothing to check
  a = summary["decodings"][-1]["acceptance"]
  mine = [r for r in summary["records"] if r["decoding"] == verified[-1]]
  assert a["drafts"] == sum(r["drafts"] for r in mine) > 0
  assert a["mean_acceptance_length"] == 1 + a["accepted_tokens"] / a["drafts"]
  table = results.format_table(summary)
  assert verified[-1] in table and "tokens/fwd" in table and "accept len" in table
  assert f"{a['mean_acceptance_length']:.2f}" in table.splitlines()[-1]


def test_the_run_config_holds_the_sampler_defaults():
  """One source of each default: a run's `sample` group is SamplerSettings' defaults (the
  budget 0: automatic), and the run's settings with nothing overridden are those defaults."""
  c = config_lib.base_config()
  defaults = SamplerSettings(eos_id=1, mask_id=0, pad_id=2)
  for name in settings_lib.CONFIG_FIELDS:
    if name == "max_new_tokens":
      continue
    assert c.sample[name] == getattr(defaults, name), name
  assert c.sample.max_new_tokens == 0
  tok = ByteTokenizer()
  assert settings_lib.from_config(c.sample, tok, 0) == settings_for(tok, 0)
  assert settings_lib.from_config(c.sample, tok, 0, budget=40).max_new_tokens == 40
  with pytest.raises(ValueError, match="unknown sampling settings \\['blok_size'\\]"):
    settings_lib.from_config(c.sample, tok, 0, blok_size=4)
