"""The synthetic-acceptance benchmark: drafts accepted k at a time by construction, NTP's text
kept, and its table and plot built from what it measured."""

import jax
import numpy as np
import pytest
from decode_helpers import PROMPTS, decode_settings, peaky_model  # tests/ is on sys.path

from benchmarks import synthetic_acceptance as bench
from sbd_jax.decode import reveal, sampler


@pytest.fixture(scope="module")
def model():
  return sampler.SamplingModel.of(peaky_model())


def _decode(model, monkeypatch, s, k, sure=False):
  """NTP's decode of PROMPTS, and `s`'s with drafts accepted k per check."""
  ntp = sampler.decode(model, PROMPTS, s.replace(mode="ntp"))
  jax.clear_caches()
  drafts = bench.oracle_drafts(ntp.tokens, bench.k_accepted_per_check(k), sure=sure)
  monkeypatch.setattr(reveal, "pick_rows", drafts)
  try:
    return ntp, sampler.decode(model, PROMPTS, s)
  finally:
    jax.clear_caches()


@pytest.mark.parametrize("k", [0, 3, bench.ALL])
def test_drafts_accepted_k_at_a_time_keep_ntps_text(model, monkeypatch, k):
  """Every forward the block's (8 positions): after a row's first check, each check accepts
  exactly k drafts (all of them with ALL, none with 0), and the text is NTP's."""
  s = decode_settings(block_size=8, max_new_tokens=40, verify=True, adaptive=False)
  ntp, out = _decode(model, monkeypatch, s.replace(eos_id=-1), k)
  assert out.tokens == ntp.tokens
  accepted, checks = out.accepted_tokens, out.drafts
  if k == bench.ALL:
    assert (out.rollbacks == 0).all() and (accepted > 0).all()
  else:
    # The first check may start mid-way through a run of k; every later one accepts k.
    assert (accepted <= k * checks).all() and (accepted >= k * (checks - 1)).all(), (
      accepted,
      checks,
    )


def test_sure_drafts_are_drafted_whole_by_an_adaptive_decode(model, monkeypatch):
  """An adaptive decode drafts only the positions its model is sure of once checks accept long
  runs (`policy.sure_enough`); with every draft NTP's and sure, each check after the first
  accepts the block's 7 drafts (the widest forward pays most at one cost for all widths)."""
  s = decode_settings(block_size=8, max_new_tokens=40, verify=True).replace(eos_id=-1)
  ntp, out = _decode(model, monkeypatch, s.replace(wide_cost=1.0), bench.ALL, sure=True)
  assert out.tokens == ntp.tokens
  assert (out.accepted_tokens >= 7 * (out.drafts - 1)).all(), (out.accepted_tokens, out.drafts)


@pytest.mark.integration  # compiles and times each k's programs
def test_rows_are_measured_side_by_side_and_drawn():
  rows = bench.model_rows(
    "tiny", "float32", [1], [0, bench.ALL], prompt_len=16, max_new_tokens=32, repeats=1,
    log=lambda _: None,
  )  # fmt: skip
  assert [r["accepted"] for r in rows] == [0, "all"]
  none, every = rows
  assert none["accepted_per_check"] == 0 and every["accepted_per_check"] > 4
  assert every["forwards_per_token"] < 0.5 <= none["forwards_per_token"] <= 1
  for r in rows:
    assert r["speedup"] == pytest.approx(
      np.median(r["seconds"]["ntp"]) / np.median(r["seconds"]["verified"])
    )
    assert r["cost_table"]["kinds"][0] == "ntp"
  table = bench.format_markdown(rows)
  assert table.count("\n") == 3 and f"**{every['speedup']:.2f}x**" in table
  series = bench.plot(rows, "/dev/null")
  ((xs, ys),) = next(iter(series.values())).values()
  assert xs == [0, 15] and ys == [r["speedup"] for r in rows]
