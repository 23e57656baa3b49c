"""The rules benchmark's pieces: model arguments, the decodings it runs, the Pareto front, and
the figure's data against the summary it draws."""

import pytest

from benchmarks import rules
from sbd_jax.decode.settings import SamplerSettings


def test_parse_models():
  got = rules.parse_models(["readme=/tmp/a", "rev=/w/run,exact,/w/held_out.jsonl"])
  assert got == {
    "readme": {"workdir": "/tmp/a", "task": "arithmetic", "data": None},
    "rev": {"workdir": "/w/run", "task": "exact", "data": "/w/held_out.jsonl"},
  }
  for bad in ("nolabel", "=/tmp/a", "x=/a,exact", "x="):
    with pytest.raises(ValueError, match="LABEL=WORKDIR") as info:
      rules.parse_models([bad])
    assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="twice"):
    rules.parse_models(["a=/x", "a=/y"])
  with pytest.raises(ValueError, match="give at least one"):
    rules.parse_models([])


def test_decodings_cover_every_rule_plain_and_verified():
  base = SamplerSettings(eos_id=1, mask_id=2, pad_id=0, block_size=4)
  got = rules.decodings(base, list(rules.GRIDS))
  names = [name for name, _ in got]
  assert len(names) == len(set(names))  # the runner keys records by name
  assert got[0][1].mode == "ntp" and not got[0][1].verify
  sbd = [s for _, s in got[1:]]
  grid = sum(len(g) for g in rules.GRIDS.values())
  by_rule = [s for s in sbd if s.verify and s.draft == "rule" and s.check_every_forward]
  assert len(by_rule) == grid and {s.rule for s in by_rule} == set(rules.GRIDS)
  assert [(name, s.adaptive, s.wide_cost) for name, s in got if s.verify and s.draft == "all"] == [
    (rules.DEFAULT_VERIFIED, True, 0.0),
    (rules.DEFAULT_VERIFIED + rules.AT_ONE_COST, True, 1.0),
    (rules.DEFAULT_VERIFIED + rules.NOT_ADAPTIVE, False, 0.0),
  ]
  just_verified = rules.decodings(base, [])  # NTP and the three verified drafting every position
  assert [name for name, _ in just_verified] == [
    "ntp",
    rules.DEFAULT_VERIFIED,
    rules.DEFAULT_VERIFIED + rules.AT_ONE_COST,
    rules.DEFAULT_VERIFIED + rules.NOT_ADAPTIVE,
  ]
  per_block = [name for name, s in got if s.verify and not s.check_every_forward]
  assert len(per_block) == len(rules.GRIDS) + 1
  assert all(name.endswith(rules.PER_BLOCK) for name in per_block)
  unsettled = [name for name, s in got if not s.settle_eos]
  assert len(unsettled) == len(rules.GRIDS["eb_entropy"])
  assert all(name.endswith(rules.NO_SETTLE) for name in unsettled)
  assert sum(not s.verify for s in sbd) == grid + len(unsettled)


def _row(name, accuracy, speedup):
  return {"decoding": name, "accuracy": accuracy, "nfe_speedup": speedup, "minus_ntp": None}


def test_pareto_keeps_what_nothing_beats_in_both():
  rows = [
    _row("ntp", 1.0, 1.0),
    _row("a", 1.0, 3.0),  # dominates ntp (same accuracy, faster)
    _row("b", 0.9, 2.0),  # dominated by a
    _row("c", 0.8, 5.0),
    _row("d", 0.8, 4.0),  # dominated by c
    _row("e", 0.95, 3.0),  # dominated by a
  ]
  assert [r["decoding"] for r in rules.pareto(rows)] == ["a", "c"]


def _acceptance(by_position):
  return {
    "acceptance_rate": 0.5,
    "mean_acceptance_length": 2.0,
    "acceptance_by_position": by_position,
  }


def test_the_figure_draws_the_summary(tmp_path):
  rows = [
    _row("ntp", 0.9, 1.0),
    _row("sbd eb_entropy γ=0.1", 0.85, 2.0),
    _row("sbd eb_entropy γ=1", 0.7, 3.5),
    _row("sbd eb_entropy γ=0.1 verified", 0.9, 1.8),
    _row("sbd eb_entropy γ=3 verified", 0.9, 2.5),
    _row("sbd threshold γ=0.5", 0.8, 3.0),
    _row("sbd eb_entropy γ=1" + rules.NO_SETTLE, 0.7, 3.0),
    _row("sbd verified", 0.9, 2.6),
    _row("sbd eb_entropy γ=3 verified" + rules.PER_BLOCK, 0.9, 2.2),
  ]
  rows[4]["acceptance"] = _acceptance([0.75, 0.5, 0.0])
  rows[7]["acceptance"] = _acceptance([0.8, 0.6, 0.25])
  summary = {"task": "exact", "num_problems": 10, "block_size": 4, "decodings": rows}
  speed, accepted = rules.plot("m", summary, str(tmp_path / "f.png")).values()
  assert speed["eb_entropy"] == ([2.0, 3.5], [85.0, 70.0])
  assert speed["eb_entropy verified"] == ([1.8, 2.5], [90.0, 90.0])
  assert speed["threshold"] == ([3.0], [80.0])
  assert speed["sbd verified"] == ([2.6], [90.0])
  assert speed["verified, checked per block"] == ([2.2], [90.0])
  assert speed["Pareto front"] == ([2.6, 3.0, 3.5], [90.0, 80.0, 70.0])
  assert accepted["verified"] == ([1.0, 2.0, 3.0], [80.0, 60.0, 25.0])
  assert accepted["eb_entropy γ=3 verified"] == ([1.0, 2.0, 3.0], [75.0, 50.0, 0.0])
  assert (tmp_path / "f.png").stat().st_size > 0
  table = rules.pareto_table("m", summary)
  assert "NTP 90.0 %" in table and "| sbd verified | 90.0 |" in table


def test_the_overview_picks_each_models_points():
  rows = [
    _row("ntp", 0.9, 1.0),
    _row("sbd threshold γ=0.01", 0.89, 2.0),  # within 2 points: the fastest such
    _row("sbd factor γ=1", 0.885, 2.5),  # 1.5 points below: also within, and faster
    _row("sbd eb_entropy γ=0.35", 0.5, 6.0),
    _row("sbd eb_entropy γ=0.35 verified", 0.9, 4.0),
    _row("sbd confidence_threshold γ=0.3 verified", 0.9, 4.5),
    _row("sbd verified", 0.9, 4.4),
    _row("sbd confidence_threshold γ=0.3 verified" + rules.PER_BLOCK, 0.9, 4.2),
    _row("sbd eb_entropy γ=3" + rules.NO_SETTLE, 0.9, 9.0),  # not a rule's point: left out
  ]
  rows[6]["acceptance"] = _acceptance([0.8])
  summary = {"task": "exact", "block_size": 16, "decodings": rows}
  table = rules.overview({"m": {"summary": summary}})
  row = table.splitlines()[2]
  assert row == (
    "| m (exact, k=16) | 90.0 | factor γ=1: 88.5 % at 2.50x | 90.0 % at 4.40x | 50 %, 2.00 "
    "| confidence_threshold γ=0.3 verified: 90.0 % at 4.50x "
    "| confidence_threshold γ=0.3 verified checked per block: 90.0 % at 4.20x |"
  )
