"""The decode-speed benchmark: exact forward counts for its forced schedules, and its outputs."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import xla_env  # tests/ is on sys.path

from benchmarks import (
  decode_speed,
  decode_timing,
  forward_timing,
  prediction,
  side_by_side,
  xla_cpu,
)
from sbd_jax.decode import sampler
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.model.architectures import tiny

REPO = os.path.dirname(os.path.dirname(__file__))


@pytest.mark.integration
def test_forced_schedules_cost_exactly_their_forwards(tmp_path):
  cfg = tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  rows = decode_speed.fixed_schedule_rows(
    "micro",
    cfg,
    batches=[2],
    prompt_lens=[5],
    per_forward=[1, 3, 16],
    max_new_tokens=20,  # blocks of 16 and 4 tokens
    repeats=1,
    log=lambda _: None,
  )
  assert [r["schedule"] for r in rows] == ["r=1", "r=3", "r=16"]
  # EOS is disabled, so NTP makes 20 forwards and SBD ceil(16 / r) + ceil(4 / r).
  assert [r["nfe_speedup"] for r in rows] == [1.0, pytest.approx(20 / (6 + 2)), 10.0]
  assert [r["tokens_per_forward"] for r in rows] == [1.0, 2.5, 10.0]
  # Identical rows: the batch runs each row's forwards, once.
  assert [r["batch_forwards"] for r in rows] == [
    {"ntp": [20], "sbd": [20]},
    {"ntp": [20], "sbd": [8]},
    {"ntp": [20], "sbd": [2]},
  ]
  for r in rows:
    assert r["ntp_tokens_per_s"] > 0 and r["sbd_tokens_per_s"] > 0
    assert r["measured_speedup"] == pytest.approx(r["sbd_tokens_per_s"] / r["ntp_tokens_per_s"])
    assert r["measured_over_predicted"] == pytest.approx(
      r["measured_speedup"] / r["predicted_speedup"]
    )
    assert r["call_s"]["ntp"] >= 0 and r["call_s"]["sbd"] >= 0
    assert r["fastest_measured_over_predicted"] == pytest.approx(
      r["fastest_measured_speedup"] / r["fastest_predicted_speedup"]
    )
    assert set(r["fastest_time_s"]) == set(r["time_s"]) and min(r["fastest_time_s"].values()) > 0
    ntp_calls, sbd_calls = r["decode_samples_s"]["ntp"], r["decode_samples_s"]["sbd"]
    assert r["fastest_measured_speedup"] == pytest.approx(min(ntp_calls) / min(sbd_calls))
    calls = r["time_loop_calls"]
    one, many, (inner,) = (  # one fill step (below): one loop per n
      calls["one_forward_call_s"]["1"],
      calls["loop_call_s"]["1"],
      calls["inner"]["1"],
    )
    assert len(one) == len(many) >= len(ntp_calls)  # a loop round in every decode round
    slope = (min(many) - min(one)) / inner
    assert r["fastest_time_s"]["1"] == pytest.approx(
      slope if slope > 0 else min(many) / (1 + inner)
    )
    assert r["measured_over_predicted_with_call"] == pytest.approx(
      r["measured_speedup"] / r["predicted_speedup_with_call"]
    )
    # time(n) over the decode's cache of 16 + 32 + 16 slots, one attention chunk (of at most
    # 512), so at one fill: the middle of the slots the keys reach, the 16-slot prompt bucket
    # and up to the 20 generated tokens, less the n new tokens (none left for n = 32).
    assert r["max_new_tokens"] == 20
    assert r["time_fill_steps"] == {
      n: [[max(26 - int(n), 0), 1.0, r["time_s"][n]]] for n in ("1", "16", "32")
    }
  # More tokens per forward is predicted faster (same time(n), fewer forwards).
  assert rows[0]["predicted_speedup"] < rows[1]["predicted_speedup"] < rows[2]["predicted_speedup"]
  # The report: one table line per row, and the plot.
  table = decode_speed.format_markdown(rows).splitlines()
  assert len(table) == 2 + len(rows) and table[2].startswith("| micro (")
  # The plot shows these rows: per batch, measured and predicted speedup by tokens per forward.
  drawn = decode_speed.plot(rows, str(tmp_path / "speed.png"))
  (panel,) = drawn.values()
  xs = [r["tokens_per_forward"] for r in rows]
  assert panel["B=2"] == (xs, [r["measured_speedup"] for r in rows])
  assert panel["B=2 predicted"] == (xs, [r["predicted_speedup"] for r in rows])
  assert (tmp_path / "speed.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.integration
@pytest.mark.parametrize(
  "flag, message",
  [
    ("--models=huge", "error: unknown model 'huge'"),
    ("--max_new_tokens=0", "--max_new_tokens=0: a decode needs at least 1 token"),
  ],
)
def test_bad_flags_are_one_line(flag, message):
  result = subprocess.run(
    [sys.executable, "-m", "benchmarks.decode_speed", "--out=/tmp/x", flag],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=120,
  )
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert message in result.stderr


def test_prediction_charges_each_decodes_first_forward_at_its_prefill_time():
  """20 tokens in blocks of 16: NTP 20 forwards, SBD 4 (2 blocks). time(1) = 1, time(16) = 2,
  time(32) = 3; prefills 10 (prompt) and 12 (prompt + first block)."""
  times, counts = {1: 1.0, 16: 2.0, 32: 3.0}, ([20], [4], [20])
  # Without prefill: 20 x 1 against 2 first passes x 3 + 2 later passes x 2.
  assert prediction.accounted_speedup(times, 16, *counts) == pytest.approx(20 / 10)
  # With it: 10 + 19 x 1 against 12 + 1 first pass x 3 + 2 later passes x 2.
  with_prefill = prediction.accounted_speedup(times, 16, *counts, prefill=(10.0, 12.0))
  assert with_prefill == pytest.approx(29 / 19)
  # A per-call cost is charged once per decode, on each side: 29 + 4 against 19 + 6.
  with_call = prediction.accounted_speedup(
    times, 16, *counts, prefill=(10.0, 12.0), call=(4.0, 6.0)
  )
  assert with_call == pytest.approx(33 / 25)
  # The decode's own count of 2k-token forwards replaces one per block: rows that move through
  # blocks alone start them in more forwards. 3 wide of 4: 12 + 3 x 3 against 29.
  wide = prediction.accounted_speedup(times, 16, *counts, prefill=(10.0, 12.0), sbd_wide=[3])
  assert wide == pytest.approx(29 / 21)
  assert prediction.accounted_speedup(
    times, 16, *counts, prefill=(10.0, 12.0), sbd_wide=[1]
  ) == pytest.approx(with_prefill)
  # Verified SBD's NTP forwards cost time(1): 1 wide and 2 one-token of 4: 12 + 3 + 2 x 1.
  narrow = prediction.accounted_speedup(
    times, 16, *counts, prefill=(10.0, 12.0), sbd_wide=[1], sbd_ntp=[2]
  )
  assert narrow == pytest.approx(29 / 17)
  # Two samples: each pays its call (and its prefill, like every forward of the batch).
  twice = tuple(c * 2 for c in counts)
  assert prediction.accounted_speedup(
    times, 16, *twice, prefill=(10.0, 12.0), call=(4.0, 6.0)
  ) == pytest.approx(66 / 50)


class _FakeTimer:
  """Counts its rounds into a shared log; a decode timer needs `wanted` rounds."""

  def __init__(self, name, log, seconds_per_round=0.0):
    self.name, self.log, self.seconds = name, log, seconds_per_round
    self.rounds = 0

  def round(self):
    self.rounds += 1
    self.log.append(self.name)

  @property
  def least_timed_s(self):
    return self.rounds * self.seconds

  def expected_rounds(self, repeats, min_total_s, max_repeats):
    return max(repeats, min(max_repeats, int(-(-min_total_s // self.seconds))))


def test_interleave_times_the_forward_loops_in_every_round_of_the_decodes():
  log = []
  decodes = _FakeTimer("decode", log, seconds_per_round=0.1)  # 0.5 s: 5 rounds, then 20
  loops = _FakeTimer("loop", log)
  decode_timing.interleave([decodes], [loops], repeats=5, loop_repeats=5, min_total_s=2.0)
  # As many loop rounds as decode rounds (their fastest calls are compared), alternating.
  assert decodes.rounds == 20 and loops.rounds == 20
  assert log == ["decode", "loop"] * 20
  # Loops that need more rounds than the decodes take finish on their own.
  log.clear()
  decodes, loops = _FakeTimer("decode", log, 1.0), _FakeTimer("loop", log)
  decode_timing.interleave([decodes], [loops], repeats=2, loop_repeats=6)
  assert (decodes.rounds, loops.rounds) == (2, 6)
  assert log == ["decode", "loop"] * 2 + ["loop"] * 4


def test_time_n_is_timed_at_one_fill_per_step_of_attentions_cost():
  """The tiny model reads its 272-slot decode cache in chunks of 176: keys reaching (16, 176]
  read one chunk, (176, 272] two. time(n) is timed at the middle of each, less the n new
  tokens, weighted by its share of the range; the dense reference reads every slot."""
  cfg = decode_speed.model_config("tiny")
  assert cfg.attention_chunk == 176
  assert forward_timing.fill_steps(cfg, 272, 16, 16, 272) == [(96 - 16, 0.625), (224 - 16, 0.375)]
  assert forward_timing.fill_steps(cfg, 272, 1, 200, 272) == [(236 - 1, 1.0)]
  assert forward_timing.fill_steps(cfg, 64, 32, 16, 48) == [(0, 1.0)]  # one chunk; no room before
  dense = cfg.replace(attention_impl="dense")
  assert forward_timing.fill_steps(dense, 272, 16, 16, 272) == [(144 - 16, 1.0)]
  with pytest.raises(ValueError, match=r"reach \(16, 300\] is not inside a cache of 272 slots"):
    forward_timing.fill_steps(cfg, 272, 16, 16, 300)


def test_a_prefill_is_timed_over_an_empty_cache_of_the_decodes_length():
  cfg = tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  model = decode_speed.random_model(cfg)
  out = forward_timing.time_forwards(
    model, batch=1, cache_length=40, ns=(8,), repeats=1, inner=1, cached_tokens=0
  )
  assert (out["cache_length"], out["cached_tokens"]) == (40, 0) and out["time_s"]["8"] > 0
  full = forward_timing.time_forwards(model, batch=1, cache_length=40, ns=(8,), repeats=1, inner=1)
  assert full["cached_tokens"] == 32
  with pytest.raises(ValueError, match="cached_tokens=33 leaves no room for 8 new tokens"):
    forward_timing.ForwardLoops(model, batch=1, cache_length=40, ns=(8,), inner=1, cached_tokens=33)


@pytest.mark.integration  # times real decodes
def test_measure_pads_every_batch_to_one_bucket_and_times_the_call_of_one_batch(monkeypatch):
  """Prompts of 5 and 20 tokens (buckets 16 and 32) at batch 1: both decodes run over 32
  prompt slots, so one prefill and one cache length hold for every batch; the tokens are
  those of plain decodes; the one-token call decodes hold one batch, as the prediction
  charges the call once per batch."""
  cfg = tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  model = decode_speed.random_model(cfg)
  base = SamplerSettings(
    eos_id=-1, mask_id=cfg.vocab_size - 1, pad_id=0, block_size=4, max_new_tokens=16, verify=False
  )
  prompts = [list(range(1, 6)), list(range(1, 21))]
  ntp, sbd = base.replace(mode="ntp"), base.replace(rule="fixed", gamma=2.0)
  calls, decode = [], sampler.decode

  def spy(model, prompts, settings, **kwargs):
    calls.append((len(prompts), settings.max_new_tokens, kwargs["min_bucket"]))
    return decode(model, prompts, settings, **kwargs)

  monkeypatch.setattr(sampler, "decode", spy)
  m = side_by_side.measure(
    model, prompts, ntp, [sbd], batch=1, repeats=1, block=4, ns=(2,), min_total_s=0.0,
    forward_repeats=1,
  )  # fmt: skip
  monkeypatch.undo()
  assert {c[2] for c in calls} == {32}  # every batch over the longest prompt's bucket
  assert {c[:2] for c in calls} == {(2, 16), (1, 1)}  # one-token call decodes: one batch
  assert m.forward["cache_length"] == sbd.cache_slots(32, 1)
  # One fill per n (the cache is one attention chunk): the middle of what the keys reach, the
  # 32-slot bucket and up to the 16 generated tokens, less the n new tokens.
  steps = {n: [step[:2] for step in x] for n, x in m.forward["steps"].items()}
  assert steps == {str(n): [[40 - n, 1.0]] for n in (1, 2, 4, 8)}
  assert set(m.times) == {1, 2, 4, 8}
  for settings, decoded in ((ntp, m.ntp), (sbd, m.sbds[0])):
    plain = sampler.decode(model, prompts, settings, batch_size=1)
    assert decoded["batch_forwards"] == plain.batch_forwards.tolist()
    assert decoded["lengths"] == [16, 16]
  r = side_by_side.row("micro", 0, 1, 20, "r=2", m, m.sbds[0], 16, block=4)
  assert r["batch_forwards"] == {"ntp": [16, 16], "sbd": [8, 8]}
  # Two batches, each charged its prefill and forwards: NTP 16 forwards; SBD 4 blocks of 2
  # forwards, the first fused with the prefill, 3 more wide and 4 later.
  t, (p_ntp, p_sbd) = m.times, m.prefill
  ntp_s = 2 * (p_ntp + 15 * t[1])
  sbd_s = 2 * (p_sbd + 3 * t[8] + 4 * t[4])
  assert r["predicted_speedup"] == pytest.approx(ntp_s / sbd_s)
  c_ntp, c_sbd = m.call
  assert r["predicted_speedup_with_call"] == pytest.approx(
    (ntp_s + 2 * c_ntp) / (sbd_s + 2 * c_sbd)
  )


def test_time_n_is_a_slope_between_medians_and_between_fastest_calls():
  cfg = tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  loops = forward_timing.ForwardLoops(
    decode_speed.random_model(cfg), batch=1, cache_length=24, ns=(1, 4), inner=1
  )
  loops.inners = {1: 10, 4: 10}
  # Calls of 1 and of 11 forwards; the slow samples are interference.
  loops.one = {1: [1.0, 3.0, 1.2], 4: [2.0, 2.0, 2.0]}
  loops.many = {1: [6.0, 9.0, 8.2], 4: [2.5, 1.9, 9.0]}
  out = loops.result()
  assert out["time_s"]["1"] == pytest.approx((8.2 - 1.2) / 10)
  assert out["fastest_time_s"]["1"] == pytest.approx((6.0 - 1.0) / 10)
  assert out["by_slope"] == {"1": True, "4": True}
  assert out["time_s"]["4"] == pytest.approx((2.5 - 2.0) / 10)
  # No positive slope between the fastest calls: the fastest loop's mean stands in.
  assert out["fastest_time_s"]["4"] == pytest.approx(1.9 / 11)


def test_the_forward_loop_computes_each_forwards_rope_inside_the_loop():
  """A decode's forwards each have their own positions, so each computes its RoPE angles (and
  attention masks). Were the loop's positions fixed, XLA would compute those once per call,
  outside the loop, and time(n) would leave them out."""
  cfg = tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  loops = forward_timing.ForwardLoops(
    decode_speed.random_model(cfg), batch=1, cache_length=24, ns=(4,), inner=1
  )
  hlo = forward_timing._forwards.lower(*loops.calls[4].args, 1).compile().as_text()
  computations = dict(re.findall(r"^(?:ENTRY )?%([\w.\-]+) .*?\n(.*?)\n}", hlo, re.M | re.S))
  entry = re.search(r"^ENTRY %([\w.\-]+) ", hlo, re.M).group(1)

  def ops(name: str) -> str:  # a computation's text with the fusions it calls, not its loops
    text = computations[name]
    fused = re.findall(r"kind=k\w+, calls=%([\w.\-]+)", text)
    return text + "".join(ops(f) for f in fused)

  assert "while(" in computations[entry]
  assert not re.search(r" (sine|cosine)\(", ops(entry))
  assert re.search(r" (sine|cosine)\(", hlo)  # in the loop's body


@pytest.mark.integration
def test_cpus_restricts_the_process_to_that_many_cores(tmp_path):
  run = lambda *args: subprocess.run(  # noqa: E731
    [sys.executable, "-m", "benchmarks.decode_speed", "--models=", *args],
    capture_output=True, text=True, cwd=REPO, timeout=120,
  )  # fmt: skip
  result = run(f"--out={tmp_path}", "--cpus=1")
  assert result.returncode == 0, result.stderr
  results = json.load(open(tmp_path / "results.json"))
  assert results["cpu_cores"] == 1
  assert set(xla_cpu.XLA_CPU_OPTIONS) <= set(results["xla_flags"].split())  # the default
  too_many = run(f"--out={tmp_path}", f"--cpus={len(os.sched_getaffinity(0)) + 1}")
  assert too_many.returncode != 0 and "Traceback" not in too_many.stderr
  assert "cores" in too_many.stderr.strip().splitlines()[-1]


_DECODES = """
import sys
import numpy as np
from sbd_jax.decode import sampler
from sbd_jax.decode.settings import SamplerSettings
from benchmarks import decode_speed

cfg = decode_speed.model_config("tiny").replace(num_layers=1)  # the shape of one tiny layer
model = decode_speed.random_model(cfg)
base = SamplerSettings(
  eos_id=-1, mask_id=cfg.vocab_size - 1, pad_id=0, max_new_tokens=40, verify=False
)
# Prompts past one attention chunk (configs/tiny.py: 176), so the key loop runs.
prompts = np.random.default_rng(0).integers(1, 255, (2, 200)).tolist()
out = {}
for name, s in [
  ("ntp", base.replace(mode="ntp")),
  ("sbd", base.replace(rule="eb_entropy", gamma=0.5, block_size=8)),
  ("sbd_sampled", base.replace(rule="eb_entropy", gamma=0.5, block_size=8, temperature=1.0)),
]:
  o = sampler.decode(model, prompts, s, batch_size=2)
  out[name] = np.array(o.tokens)
  out[name + "_steps"] = np.array(o.reveal_step)
np.savez(sys.argv[1], **out)
"""


@pytest.mark.integration
def test_the_xla_cpu_options_change_no_computed_value(tmp_path):
  """The benchmarks' XLA:CPU options change how programs run, not what they compute: the same
  decodes (greedy and sampled, rows moving alone) under XLA's defaults and under the options
  reveal the same tokens at the same forwards."""
  outs = []
  for name, options in (("defaults", ()), ("options", xla_cpu.XLA_CPU_OPTIONS)):
    xla_flags = " ".join([xla_env.xla_flags(1), *options])
    path = tmp_path / f"{name}.npz"
    result = subprocess.run(
      [sys.executable, "-c", _DECODES, str(path)],
      env=dict(os.environ, XLA_FLAGS=xla_flags), cwd=REPO, capture_output=True, text=True,
      timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    outs.append(dict(np.load(path)))
  defaults, options = outs
  assert sorted(defaults) == sorted(options) and len(defaults) == 6
  for key in defaults:
    np.testing.assert_array_equal(options[key], defaults[key], err_msg=key)


def test_the_xla_cpu_options_are_chosen_before_the_backend_starts(monkeypatch):
  """XLA reads XLA_FLAGS once, when JAX starts its backend: later, the options would silently
  not apply, so asking for them then is an error, and XLA_FLAGS stay as they were."""
  jax.devices()  # the backend is running
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert xla_cpu.use_xla_cpu_options(True) == "--xla_force_host_platform_device_count=8"
  with pytest.raises(ValueError, match="region analysis must take effect before JAX starts"):
    xla_cpu.use_xla_cpu_options(False)
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_a_trained_model_is_timed_plain_and_under_each_verification():
  """Plain SBD at each γ, verified as it decodes by default (measured costs), with every forward
  the block's, at a wide forward's given cost, and checked per block at each γ (with the EB
  rule), each named for the table."""
  base = SamplerSettings(eos_id=1, mask_id=2, pad_id=0, block_size=4)
  got = decode_speed.trained_decodings(base, [0.1, 0.35], wide_costs=[8])
  assert [decode_speed.schedule_name(s, 4) for s in got] == [
    "eb_entropy γ=0.1 k=4",
    "eb_entropy γ=0.35 k=4",
    "verified k=4",
    "verified k=4, widest",
    "verified k=4, wide_cost 8",
    "eb_entropy γ=0.1 k=4 verified checked per block",
    "eb_entropy γ=0.35 k=4 verified checked per block",
  ]
  assert [s.verified for s in got] == [False, False, True, True, True, True, True]
  assert got[2].draft == "all" and got[2].check_every_forward and got[2].adaptive
  assert got[2].wide_cost == 0 and got[4].wide_cost == 8 and got[4].adaptive
  assert not got[5].check_every_forward and got[5].draft == "rule" and got[5].gamma == 0.1


def test_each_timed_setting_decodes_with_a_prior_of_its_own(monkeypatch):
  """A verified decode and the same decode drafting its widest share a drafting key
  (`SamplingModel.prior_for`); timed side by side, neither starts from what the other's calls
  accepted, and each learns from its own."""
  seen = []

  def decode(model, prompts, s, **kw):
    prior = model.prior_for(s)
    seen.append((s.adaptive, prior.tried.sum() - prior.rejected.sum()))
    prior.add([0, 1] if s.adaptive else [0, 11], [0, 1])  # the widest decode's are accepted
    return None

  monkeypatch.setattr(decode_timing.sampler, "decode", decode)
  model = sampler.SamplingModel(graphdef=None, state=None, cfg=None)
  verified = SamplerSettings(eos_id=1, mask_id=2, pad_id=0, block_size=4, verify=True)
  widest = verified.replace(adaptive=False)
  rounds = decode_timing.DecodeRounds(model, [[3]], [verified, widest], batch_size=1, warm=True)
  rounds.round()
  rounds.round()
  assert [a for adaptive, a in seen if adaptive] == [0, 0, 0, 0, 0]
  assert [a for adaptive, a in seen if not adaptive] == [0, 10, 20, 30, 40]
  assert model.priors == {}  # the caller's model learns nothing from the benchmark's calls
