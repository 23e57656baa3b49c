"""The departures ablation (`benchmarks.departures`): each variant reverts exactly its departure
of configs/tiny.py, and the table, the choice of extra seeds and the plot follow the results."""

import os

import pytest

from benchmarks import departures
from sbd_jax import config as config_lib
from sbd_jax.run import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", list(departures.VARIANTS))
def test_a_variant_changes_only_its_fields_and_is_valid(name):
  tiny = config_lib.from_file(os.path.join(REPO, "configs", "tiny.py"))
  c = departures.variant_config(name, seed=0)
  config_lib.validate(c, num_devices=1)
  changed = {line.split(":")[0] for line in workdir_lib.config_differences(tiny, c)}
  reverted = set(departures.VARIANTS[name][1])

  def value(cfg, field):
    section, key = field.split(".")
    return cfg[section][key]

  # Each override reverts a departure (changes tiny.py's value), and nothing else changes
  # but the bar and the γ values (tiny.py's already).
  assert {f for f in reverted if value(tiny, f) == value(c, f)} == set()
  assert changed == reverted | {"train.progress_bar"}
  assert departures.variant_config(name, seed=3).train.seed == 3


def result(name, seed, ntp, low, high):
  def sbd(acc, speed):
    return {"accuracy": acc, "nfe_speedup": speed}

  return {
    "variant": name,
    "seed": seed,
    "ntp": sbd(ntp, 1.0),
    "sbd eb_entropy γ=0.1": sbd(*low),
    "sbd eb_entropy γ=0.35": sbd(*high),
  }


def test_the_costliest_reversions_get_the_extra_seeds_and_the_table_averages_seeds(tmp_path):
  results = [
    result("readme", 0, 1.0, (0.99, 3.9), (0.98, 3.95)),
    result("k_2_16", 0, 1.0, (0.90, 6.0), (0.85, 8.0)),
    result("row_tiling", 0, 1.0, (0.97, 3.8), (0.95, 3.9)),
    result("equal_weights", 0, 1.0, (0.99, 3.9), (0.97, 3.9)),
    result("k_2_16", 1, 0.98, (0.80, 5.0), (0.75, 7.0)),
  ]
  assert departures.costliest(results, 2) == ["k_2_16", "row_tiling"]
  table = departures.format_markdown(results)
  assert "| k ~ U{2..16}, decode blocks of 16 | 0,1 | 99.0 | 85.0 [80.0-90.0] (5.50x) |" in table
  assert "| blocks tiled over the row | 0 | 100.0 | 97.0 (3.80x) | 95.0 (3.90x) |" in table
  assert "no NTP phase" not in table  # not measured
  drawn = departures.plot(results, str(tmp_path / "d.png"))[""]
  # Rows in the variants' order (readme, k_2_16, row_tiling, equal_weights), every seed shown.
  assert drawn["γ = 0.1"] == ([99.0, 90.0, 80.0, 97.0, 99.0], [0, 1, 1, 2, 3])
  assert drawn["γ = 0.35"] == ([98.0, 85.0, 75.0, 95.0, 97.0], [0, 1, 1, 2, 3])
  assert (tmp_path / "d.png").stat().st_size > 0
