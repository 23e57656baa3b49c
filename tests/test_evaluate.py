"""Loading a workdir's params export, the evaluation report, and the two CLIs' error paths."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sbd_jax import config as config_lib
from sbd_jax import evaluate, sample
from sbd_jax.attention.chunked import TokenMeta
from sbd_jax.data import arithmetic
from sbd_jax.data.pipeline import make_eval_problems
from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.decode import sampler
from sbd_jax.evals import diagnostics
from sbd_jax.model.architectures import tiny
from sbd_jax.model.transformer import Transformer
from sbd_jax.training import checkpointing
from sbd_jax.training import workdir as workdir_lib


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
  workdir_lib.write_config(path, c)
  model = nnx.jit(lambda: Transformer(config_lib.to_model_config(c), rngs=nnx.Rngs(0)))()
  checkpointing.export_params(path, nnx.state(model, nnx.Param))
  return path


def test_loader_restores_the_exported_params(workdir):
  model, config, tokenizer, mask_id = workdir_lib.load_sampling_model(workdir)
  assert model.cfg.attention_impl == "dense" and mask_id == tokenizer.mask_id == 259
  expected = nnx.jit(lambda: Transformer(config_lib.to_model_config(config), rngs=nnx.Rngs(0)))()
  want = jax.tree.leaves(nnx.state(expected, nnx.Param))
  got = jax.tree.leaves(nnx.state(nnx.merge(model.graphdef, model.state), nnx.Param))
  assert len(want) == len(got) == len(jax.tree.leaves(model.state)) - 2  # + 2 RoPE tables
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a, b)


def test_report_after_training(workdir, capsys):
  results = evaluate.report_after_training(workdir, _config())
  table = capsys.readouterr().out
  assert "NTP" in table and "SBD eb_entropy γ=0.1" in table and "SBD eb_entropy γ=0.35" in table
  assert results["num_problems"] == 4
  assert [(r["rule"], r["gamma"]) for r in results["sbd"]] == [
    ("eb_entropy", 0.1),
    ("eb_entropy", 0.35),
  ]


def _stub_decode(answers_for, nfe_for):
  """A decode_text stand-in: the completion `answers_for(mode, i)` for prompt i, and NFE
  `nfe_for(mode, i)`, so evaluation is checked on a model whose answers are known."""

  def decode_text(model, tokenizer, prompts, settings, **kwargs):
    del model, tokenizer
    texts = [answers_for(settings.mode, i) for i in range(len(prompts))]
    nfe = np.array([nfe_for(settings.mode, i) for i in range(len(prompts))])
    n, b = len(prompts), kwargs["batch_size"]
    # Rows that never wait for each other: a batch runs as many forwards as its slowest row.
    batch_forwards = np.concatenate(
      [np.full(len(c), c.max()) for c in np.split(nfe, range(b, n, b))]
    )
    return sampler.DecodeOutput([[]] * n, [[]] * n, nfe, np.ones(n, bool), texts, batch_forwards)

  return decode_text


def test_evaluation_scores_known_answers(monkeypatch):
  problems = [arithmetic.generate("eval", i, seed=5) for i in range(40)]
  gold = [p.completion for p in problems]

  # NTP answers everything right in 60 forwards; SBD gets the first 30 right (the rest are off
  # by one) in 20 forwards for even problems and 30 for odd ones.
  def answers(mode, i):
    if mode == "ntp" or i < 30:
      return gold[i]
    return gold[i].replace(f"is {problems[i].answer}.", f"is {problems[i].answer + 1}.")

  nfe = lambda mode, i: 60 if mode == "ntp" else (20 if i % 2 == 0 else 30)
  monkeypatch.setattr(evaluate.sampler, "decode_text", _stub_decode(answers, nfe))
  results = evaluate.evaluate_problems(
    None,
    ByteTokenizer(),
    259,
    problems,
    rules=["eb_entropy"],
    gammas=[0.5],
    block_size=4,
    max_new_tokens=8,
    batch_size=8,
  )
  assert results["ntp"]["accuracy"] == 1.0 and results["ntp"]["mean_nfe"] == 60
  (sbd,) = results["sbd"]
  assert sbd["accuracy"] == 0.75 and sbd["mean_nfe"] == 25
  assert sbd["nfe_speedup"] == pytest.approx((3.0 + 2.0) / 2)  # mean over problems of 60/nfe
  assert sbd["minus_ntp"]["mean"] == pytest.approx(-0.25)
  lo, hi = sbd["minus_ntp"]["ci95"]
  assert lo < -0.25 < hi < 0  # a 10-of-40 loss is significant
  lo, hi = sbd["ci95"]
  assert lo < 0.75 < hi and hi - lo < 0.3
  # Batches of 8 alternate 20- and 30-forward rows: each runs 30 forwards for 8 rows.
  assert results["ntp"]["row_utilisation"] == 1.0
  assert sbd["row_utilisation"] == pytest.approx(25 / 30)


def test_row_utilisation_counts_the_forwards_of_rows_already_done():
  nfe = np.asarray([2, 4, 4, 4, 3])
  # batches of 2: [2, 4] -> 8 row-forwards for 6 used, [4, 4] -> 8 for 8, [3] -> 3 for 3
  assert evaluate.row_utilisation(nfe, np.asarray([4, 4, 4, 4, 3])) == pytest.approx(17 / 19)
  # An SBD batch can run more forwards than its slowest row needs (rows wait at each block).
  assert evaluate.row_utilisation(nfe, np.asarray([5, 5, 4, 4, 3])) == pytest.approx(17 / 21)


def test_token_limit_covers_every_reference_answer(capsys):
  tok = ByteTokenizer()
  problems = [arithmetic.generate("eval", i, 0) for i in range(8)]
  longest = max(len(tok.encode(p.completion)) + 1 for p in problems)  # with its EOS
  limit = evaluate.token_limit(problems, tok, 16, 0)
  assert limit % 16 == 0 and longest <= limit < longest + 16
  assert evaluate.token_limit(problems, tok, 16, longest) == longest
  assert capsys.readouterr().err == ""
  assert evaluate.token_limit(problems, tok, 16, longest - 1) == longest - 1
  assert "shorter than the longest reference answer" in capsys.readouterr().err


def test_evaluation_of_noise_scores_zero(monkeypatch):
  problems = [arithmetic.generate("eval", i, seed=6) for i in range(16)]
  noise = lambda mode, i: " She has many. The answer is none."
  monkeypatch.setattr(evaluate.sampler, "decode_text", _stub_decode(noise, lambda m, i: 8))
  results = evaluate.evaluate_problems(
    None,
    ByteTokenizer(),
    259,
    problems,
    rules=["eb_entropy"],
    gammas=[0.0],
    block_size=4,
    max_new_tokens=8,
    batch_size=8,
  )
  assert results["ntp"]["accuracy"] == results["sbd"][0]["accuracy"] == 0.0
  assert results["ntp"]["ci95"][0] == 0.0 and results["ntp"]["ci95"][1] > 0.0


def test_gamma_zero_has_no_speedup(workdir):
  """γ = 0 reveals one token per forward: the NFE of SBD equals NTP's when neither stops early."""
  results = evaluate.evaluate_workdir(workdir, gammas=[0.0], num_problems=4)
  assert results["ntp"]["mean_nfe"] == results["sbd"][0]["mean_nfe"] == 12
  assert results["sbd"][0]["nfe_speedup"] == 1.0


def test_diagnostics_measure_the_same_tokens_as_a_plain_ntp_pass(workdir):
  """At mask rate 1 every completion token (and the EOS) is counted once, and the NTP column is
  the loss a plain causal forward of each problem alone gives those tokens."""
  d = diagnostics.diagnose_workdir(workdir, num_problems=3, seed=4, num_reveal_examples=2)
  model, config, tokenizer, _ = workdir_lib.load_sampling_model(workdir)
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
  assert set(d["decoding"]) == {
    "NTP", "SBD block size 1", "SBD block size 4, γ=0", "SBD block size 4, γ=0.35"
  }  # fmt: skip
  assert d["decoding"]["SBD block size 4, γ=0"]["mean_nfe"] == d["decoding"]["NTP"]["mean_nfe"]
  assert len(d["reveal_order"]) == 2
  assert "held-out loss" in diagnostics.format_diagnostics(d)
  assert "masked whole" in diagnostics.format_diagnostics(d)


def test_sample_workdir(workdir):
  (result,) = sample.sample_workdir(
    workdir, ["Q: Ana has 3 pens.\nA:"], block_size=4, max_new_tokens=12
  )
  assert set(result) >= {"sbd", "ntp", "sbd_nfe", "ntp_nfe", "nfe_speedup"}
  assert result["ntp_nfe"] == 12 and 1 <= result["sbd_nfe"] <= 12
  assert "SBD" in sample.format_results([result])
  for rows in (1, 2):  # two rows refilled together: the queue's one prompt alone
    refilled = sample.sample_workdir(
      workdir, ["Q: Ana has 3 pens.\nA:"], block_size=4, max_new_tokens=12, refill=True,
      refill_rows=rows,
    )  # fmt: skip
    assert refilled == [result]


def test_bad_requests(workdir, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    workdir_lib.load_sampling_model(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="no params export"):
    workdir_lib.load_sampling_model(str(tmp_path))
  with pytest.raises(ValueError, match="unknown reveal rule"):
    evaluate.evaluate_workdir(workdir, rules=["nope"])
  with pytest.raises(ValueError, match="gammas must be >= 0"):
    evaluate.evaluate_workdir(workdir, gammas=[-1.0])
  with pytest.raises(ValueError, match="empty"):
    sample.sample_workdir(workdir, [""])


@pytest.mark.parametrize("module", ["sbd_jax.sample", "sbd_jax.evaluate"])
def test_cli_missing_workdir_is_one_clear_line(module, tmp_path):
  args = [sys.executable, "-m", module, f"--workdir={tmp_path / 'nope'}"]
  if module == "sbd_jax.sample":
    args.append("--prompt=hi")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode != 0
  assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_lockstep_and_refill_reach_the_decode(workdir, monkeypatch):
  """`lockstep`, `refill` and `refill_rows` (the CLI's flags) reach every decode's settings
  (NTP ignores lockstep); refill decodes on the batches' mesh, to the same answers and NFE."""
  seen = []
  decode_text = sampler.decode_text

  def recording(model, tokenizer, prompts, settings, **kwargs):
    seen.append((settings, kwargs["mesh"]))
    return decode_text(model, tokenizer, prompts, settings, **kwargs)

  monkeypatch.setattr(sampler, "decode_text", recording)
  results = {}
  for lockstep, refill in ((False, False), (True, False), (False, True)):
    results[lockstep, refill] = evaluate.evaluate_workdir(
      workdir,
      gammas=[0.5],
      num_problems=2,
      lockstep=lockstep,
      refill=refill,
      refill_rows=1 + refill,
    )
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
    evaluate.evaluate_workdir(workdir, num_problems=2, refill_rows=2)
  plain, refilled = results[False, False], results[False, True]
  for key in ("accuracy", "mean_nfe"):
    assert refilled["ntp"][key] == plain["ntp"][key]
    assert refilled["sbd"][0][key] == plain["sbd"][0][key]
