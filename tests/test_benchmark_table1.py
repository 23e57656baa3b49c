"""The Table-1 benchmark: its helpers, and the whole pipeline end to end at the toy size."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from xla_env import subprocess_env  # tests/ is on sys.path

from benchmarks import prediction
from benchmarks.table1 import code_corpus, measure, plots, sizes, training
from sbd_jax.data.tokenizer import load_tokenizer
from sbd_jax.decode import sampler
from sbd_jax.evals import heldout_rows, stats

pytestmark = pytest.mark.integration  # a toy Table 1, trained and decoded end to end

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
  "size, config_file", [("cpu", "tiny.py"), ("paper_small", "paper_small.py")]
)
def test_a_cpu_size_trains_its_config_files_recipe(size, config_file):
  from sbd_jax import config as config_lib

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = config_lib.from_file(os.path.join(repo, "configs", config_file))
  got = training.train_config(sizes.SIZES[size], "sbd", "arithmetic")
  fields = ["sbd", "optim.end_lr_ratio", "optim.decay_embeddings", "optim.lr", "train.seq_len"]
  fields += ["train.batch_size", "sample.block_size"]  # steps and attention chunks may differ
  for field in fields:
    section, _, name = field.partition(".")
    want = c[section][name] if name else c[section]
    have = got[section][name] if name else got[section]
    assert have == want, field


def test_a_size_sets_the_sbd_recipe_of_its_models_and_rejects_unknown_fields():
  size = sizes.SIZES["cpu"]
  c = training.train_config(size, "sbd", "arithmetic")
  assert {k: c.sbd[k] for k in size.sbd} == size.sbd
  assert {k: c.optim[k] for k in size.optim} == size.optim
  assert c.sample.block_size == size.block_size == c.sbd.k_max
  assert training.train_config(size, "ntp", "arithmetic").sbd.mode == "ntp"
  typo = dataclasses.replace(size, sbd={"full_block_probability": 0.5})
  with pytest.raises(ValueError, match="full_block_probability"):
    training.train_config(typo, "sbd", "arithmetic")
  typo = dataclasses.replace(size, optim={"end_lr": 0.0})
  with pytest.raises(ValueError, match=r"Size\.optim .*'end_lr'"):
    training.train_config(typo, "sbd", "arithmetic")
  twice = dataclasses.replace(size, optim={"lr": 1e-3})  # Size.lr is the one place for it
  with pytest.raises(ValueError, match=r"Size\.optim .*'lr'"):
    training.train_config(twice, "sbd", "arithmetic")


def test_ensure_trained_reuses_only_a_workdir_of_the_same_config(tmp_path, monkeypatch):
  from sbd_jax.run import workdir as workdir_lib

  trained = []

  def fake_train(c, workdir):  # what trainer.train leaves behind, without the training
    trained.append(workdir)
    workdir_lib.write_config(workdir, c)
    os.makedirs(os.path.join(workdir, "params"), exist_ok=True)

  monkeypatch.setattr(training.trainer, "train", fake_train)
  c = training.train_config(sizes.SIZES["toy"], "sbd", "arithmetic")
  run = str(tmp_path / "run")
  assert not training.ensure_trained(c, run)["reused"]
  assert training.ensure_trained(c, run)["reused"]
  assert len(trained) == 1

  changed = training.train_config(sizes.SIZES["toy"], "sbd", "arithmetic")
  changed.sbd.full_block_prob = 0.25  # same steps, another recipe: trained again
  assert not training.ensure_trained(changed, run)["reused"]
  assert len(trained) == 2
  assert workdir_lib.read_config(run).sbd.full_block_prob == 0.25
  assert workdir_lib.read_config(run + ".stale-0").sbd.full_block_prob == c.sbd.full_block_prob


def test_paper_speedup_formula():
  """With time(n) constant the prediction is the NFE speedup k / l; with time linear in n it
  is k / (2k + (l - 1) k) < 1 (no gain when a forward costs its token count)."""
  flat = {1: 1.0, 4: 1.0, 8: 1.0}
  assert prediction.paper_speedup(flat, 4, 2.0) == pytest.approx(2.0)
  linear = {n: float(n) for n in (1, 4, 8)}
  assert prediction.paper_speedup(linear, 4, 1.0) == pytest.approx(0.5)
  counts = prediction.accounted_speedup(flat, 4, np.array([8]), np.array([2]), np.array([8]))
  assert counts == pytest.approx(4.0)  # 8 NTP forwards vs 2 SBD forwards (one per block)
  assert prediction.forwards_per_block(np.array([3, 4]), np.array([8, 3]), 4) == 2.75


def test_pack_documents_cuts_long_documents_and_caps_rows():
  tok = load_tokenizer("byte")
  rows = heldout_rows.pack_documents([{"text": "a" * 10}, {"text": "b" * 3}], tok, seq_len=8)
  # doc 1 = 12 tokens -> chunks of 8 and 4; doc 2 = 5 tokens; 4 + 5 > 8, so three rows.
  assert rows["tokens"].shape == (3, 8)
  lengths = sorted(int(n) for n in np.count_nonzero(rows["segment_ids"], axis=1))
  assert lengths == [4, 5, 8]
  for r in range(len(rows["tokens"])):
    for seg in set(rows["segment_ids"][r]) - {0}:
      pos = rows["positions"][r][rows["segment_ids"][r] == seg]
      np.testing.assert_array_equal(pos, np.arange(len(pos)))  # restart per chunk
  assert (
    len(heldout_rows.pack_documents([{"text": "a" * 30}], tok, seq_len=8, max_rows=2)["tokens"])
    == 2
  )


def test_heldout_ntp_loss_matches_a_per_document_forward():
  """Packed rows give each document the loss it has alone (segments isolate documents)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from sbd_jax.attention.meta import TokenMeta
  from sbd_jax.decode import sampler
  from sbd_jax.model import architectures
  from sbd_jax.model.transformer import Transformer

  tok = load_tokenizer("byte")
  cfg = architectures.tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16)
  net = Transformer(cfg, rngs=nnx.Rngs(0))
  texts = ["hello there", "sbd", "blocks of tokens"]
  rows = heldout_rows.pack_documents([{"text": t} for t in texts], tok, seq_len=64)
  assert len(rows["tokens"]) == 1  # all three in one row
  got = heldout_rows.heldout_ntp_loss(sampler.SamplingModel.of(net), rows)
  losses = []
  for t in texts:
    ids = [tok.bos_id, *tok.encode(t), tok.eos_id]
    x = jnp.asarray([ids])
    logits, _ = net(x, TokenMeta.causal(jnp.ones_like(x), jnp.arange(len(ids))[None]))
    logp = jax.nn.log_softmax(logits[0])
    losses += [-float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
  assert got["targets"] == len(losses)
  np.testing.assert_allclose(got["loss"], np.mean(losses), rtol=1e-5)


def test_agreement():
  assert measure.agreement([1, 2, 3, 4], [1, 2, 0]) == 0.5
  assert measure.agreement([], [1]) == 1.0


def test_code_corpus_split_is_by_path(tmp_path):
  root = tmp_path / "lib"
  (root / "pkg").mkdir(parents=True)
  (root / "test").mkdir()
  for i in range(40):
    (root / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
  (root / "test" / "t.py").write_text("skipped\n")
  corpus = code_corpus.build(str(tmp_path / "out"), root=str(root))
  assert corpus.num_train + corpus.num_heldout == 40
  held = {f"pkg/m{i}.py" for i in range(40) if code_corpus.is_held_out(f"pkg/m{i}.py")}
  assert corpus.num_heldout == len(held)
  texts = code_corpus.read_texts(corpus.train_path)
  assert "skipped\n" not in texts and len(texts) == corpus.num_train


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
  """Run the CLI at the toy size in a subprocess on one CPU device (conftest's 8 simulated
  devices would shard the toy trainings for nothing)."""
  out = tmp_path_factory.mktemp("table1")
  env = subprocess_env(1, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.table1", f"--out={out}", "--size=toy"],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out / "results.json") as f:
    return out, json.load(f), proc.stdout


def test_toy_report_and_figures_show_the_results(toy_run, tmp_path):
  """table1.md's Table-1 rows carry results.json's accuracies and NFE speedups, each figure
  draws the results' own series, and roofline.md the roofline tables of results.json."""
  out, results, stdout = toy_run
  rows, n = results["arithmetic"]["rows"], results["arithmetic"]["num_problems"]
  table = (out / "table1.md").read_text()
  for model, decoding, key in (
    ("NTP-trained", "NTP", "ntp_model_ntp"),
    ("SBD-trained", "NTP", "sbd_model_ntp"),
    ("SBD-trained", "SBD γ_low=0.1", "sbd_gamma_low"),
    ("SBD-trained", "SBD γ_high=0.35", "sbd_gamma_high"),
  ):
    r = rows[key]
    lo, hi = stats.wilson_interval(round(r["accuracy"] * n), n)
    cell = f"{100 * r['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] ({r['nfe_speedup']:.2f}x)"
    assert f"| {model} | {decoding} | {cell} |" in table, (key, cell)
  assert "| Llama-3.1 8B, SBD-trained | SBD γ_low |" in table
  for rule, sweep in results["arithmetic"]["sweeps"].items():  # a log line per setting
    for x in sweep:
      assert f"[table1] arithmetic sbd model, SBD {rule} γ={x['gamma']:g}" in stdout
  drawn = plots.write_all(results, str(tmp_path))
  for rule, sweep in results["arithmetic"]["sweeps"].items():
    series = drawn["accuracy_vs_speedup.png"][rule]["SBD model, SBD decoding"]
    assert series == ([x["nfe_speedup"] for x in sweep], [x["accuracy"] for x in sweep])
  wall = results["wallclock"]["sbd"]
  (panel,) = drawn["wallclock_vs_predicted.png"].values()
  assert panel["measured wall-clock"] == (
    [x["gamma"] for x in wall],
    [x["measured_speedup"] for x in wall],
  )
  times = results["wallclock"]["forward"]["time_s"]
  ms_panel = next(iter(drawn["time_per_forward.png"].values()))["ms per forward"]
  assert ms_panel == (
    sorted(map(float, map(int, times))),
    [1e3 * times[k] for k in sorted(times, key=int)],
  )
  for name in plots.FIGURES:
    assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
  roof = (out / "roofline.md").read_text()
  assert "Table 3" in roof and "Table 4" in roof and "given device (312" in roof
  (h100_b1_k16,) = [
    r for r in results["roofline"]["h100"]["table3"] if (r["batch"], r["block_size"]) == (1, 16)
  ]
  assert f"{h100_b1_k16['slowdown']:.4f}" in roof


def test_toy_results_structure(toy_run):
  _, r, _ = toy_run
  size = sizes.SIZES["toy"]
  assert r["models"] == ["ntp", "sbd"]
  assert set(r["arithmetic"]["rows"]) == {
    "ntp_model_ntp",
    "sbd_model_ntp",
    "sbd_gamma_low",
    "sbd_gamma_high",
  }
  assert set(r["arithmetic"]["sweeps"]) == set(sizes.RULES)
  for rule, rows in r["arithmetic"]["sweeps"].items():
    assert [x["gamma"] for x in rows] == list(sizes.sweep_values(size, rule))
    assert all(0.0 <= x["accuracy"] <= 1.0 for x in rows)
  assert set(r["code"]["rows"]) == {"sbd_gamma_0", "sbd_gamma_0.1", "sbd_gamma_0.35"}
  for task in ("arithmetic", "code"):
    for mode in ("ntp", "sbd"):
      loss = r["heldout_loss"][task][mode]
      assert math.isfinite(loss["loss"]) and 0 < loss["loss"] < 10 and loss["targets"] > 0
  fwd = r["wallclock"]["forward"]["time_s"]
  assert set(fwd) == {"1", "2", "4", "8"} and all(t > 0 for t in fwd.values())
  assert [x["gamma"] for x in r["wallclock"]["sbd"]] == list(size.gammas)
  check_wallclock(r["wallclock"], size)
  for device in ("h100", "given_device"):
    assert r["roofline"][device]["table3"] and r["roofline"][device]["table4"]
  assert all(not t["reused"] for t in r["training"].values())


def check_wallclock(w, size):
  """The wall-clock rows against their own timings, recomputed here: the measured speedup
  from seconds per token, the prediction from each batch's forward counts, time(n) and the
  prefills (`decode_speed.measure`)."""
  k = size.block_size
  assert set(w["forward"]["time_s"]) == {str(n) for n in {1, k, 2 * k, *size.forward_ns}}
  t = {int(n): x for n, x in w["forward"]["time_s"].items()}
  ntp_decode = w["decodes"][0]
  assert w["repeats"] == len(ntp_decode["samples_s"]) >= size.wall_repeats
  for row, decode in zip(w["sbd"], w["decodes"][1:]):
    assert row["gamma"] == decode["gamma"]
    assert row["measured_speedup"] == pytest.approx(w["ntp"]["s_per_token"] / decode["s_per_token"])
    batches = len(row["batch_forwards"]["ntp"])
    assert batches == -(-w["num_prompts"] // w["batch_size"])
    ntp_s = sum(w["prefill_s"]["ntp"] + (f - 1) * t[1] for f in row["batch_forwards"]["ntp"])
    sbd_s = sum(
      w["prefill_s"]["sbd"] + wide * t[2 * k] + (f - 1 - wide) * t[k]
      for f, wide in zip(row["batch_forwards"]["sbd"], row["sbd_wide_forwards"])
    )
    assert row["predicted_speedup"] == pytest.approx(ntp_s / sbd_s)
    assert row["measured_over_predicted"] == pytest.approx(
      row["measured_speedup"] / row["predicted_speedup"]
    )
    assert row["fastest_measured_speedup"] == pytest.approx(
      min(ntp_decode["samples_s"])
      / min(decode["samples_s"])
      * decode["tokens"]
      / ntp_decode["tokens"]
    )
    assert row["first_call_s"] > 0 and row["predicted_paper"] > 0
    # time(n) at one fill per step of attention's cost over the slots the decodes' keys reach,
    # the prompt bucket to its NTP decodes' mean length past it (`forward_timing.fill_steps`), the
    # steps weighted by their share of that range.
    start = sampler.prompt_bucket(row["prompt_len"])
    end = start + max(int(np.mean(ntp_decode["lengths"])), 1)
    for n, steps in w["forward"]["steps"].items():
      assert sum(weight for _, weight, _ in steps) == pytest.approx(1.0)
      assert all(start < fill + int(n) <= end or fill == 0 for fill, _, _ in steps)
      assert t[int(n)] == pytest.approx(sum(weight * time for _, weight, time in steps))
    assert row["time_cached_tokens"] == w["forward"]["cached_tokens"]


def test_toy_nfe_accounting(toy_run):
  """What must hold whatever the toy model outputs.

  NTP makes exactly one token per forward. SBD reveals at most one token per forward at γ = 0
  (and the reveal order may skip ahead, so NFE >= kept tokens), and at most one block per
  forward. Speedups are relative to NTP decodes that may stop at different lengths, so they
  are >= 1 (and exactly 1 at γ = 0) only where the NTP decode ran to max_new_tokens.
  """
  _, r, _ = toy_run
  size = sizes.SIZES["toy"]
  k, limit = size.block_size, size.max_new_tokens
  ntp, *sbd = r["wallclock"]["decodes"]
  assert ntp["nfe"] == ntp["lengths"]
  for d in sbd:
    nfe, lengths = np.asarray(d["nfe"]), np.asarray(d["lengths"])
    assert np.all(nfe >= np.ceil(lengths / k)) and np.all(nfe <= limit)
    if d["gamma"] == 0:
      assert np.all(nfe >= lengths)
  rows = r["arithmetic"]["rows"]
  assert rows["ntp_model_ntp"]["nfe_speedup"] == rows["sbd_model_ntp"]["nfe_speedup"] == 1.0
  ntp_ran_full = rows["sbd_model_ntp"]["mean_nfe"] == limit
  for rule, sweep in r["arithmetic"]["sweeps"].items():
    for x in sweep:
      assert x["nfe_speedup"] > 0
      if ntp_ran_full:
        assert x["nfe_speedup"] >= 1.0
        if x["gamma"] == 0 and x["mean_nfe"] == limit and rule != "factor":
          assert x["nfe_speedup"] == 1.0
  for x in r["code"]["rows"].values():
    assert x["nfe_speedup"] > 0 and 0.0 <= x["agreement"] <= 1.0
    if x["ntp_mean_nfe"] == size.code_new_tokens:
      assert x["nfe_speedup"] >= 1.0
