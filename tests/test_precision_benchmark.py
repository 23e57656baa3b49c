"""The precision benchmark's pieces: the decodings it compares and how it counts differences."""

from benchmarks import precision


def test_differing_names_the_problems_whose_texts_differ():
  records = [
    {"decoding": "ntp", "task_id": "a", "completion": "1"},
    {"decoding": "ntp", "task_id": "b", "completion": "2"},
    {"decoding": "verified", "task_id": "a", "completion": "1"},
    {"decoding": "verified", "task_id": "b", "completion": "3"},
  ]
  assert precision.differing(records, "verified", "ntp") == ["b"]
  assert precision.differing(records, "ntp", "ntp") == []


def test_every_pair_compares_decodings_that_are_made():
  made = set(precision.DECODINGS)
  assert all(a in made and b in made for a, b, _ in precision.PAIRS)
  shapes = precision.DECODINGS["ntp at verified shapes"][0]
  assert shapes["draft"] == "none" and not shapes["adaptive"]
  assert not precision.DECODINGS["verified, no pauses"][0]["adaptive"]
  assert precision.DECODINGS["ntp alone"][1] and not precision.DECODINGS["ntp"][1]


def test_the_table_counts_differences_and_states_the_interval():
  row = {
    "dtype": "bfloat16",
    "num_problems": 8,
    "differing": {f"{a} | {b}": ["x"] * i for i, (a, b, _) in enumerate(precision.PAIRS)},
    "accuracy": {"ntp": 0.5, "verified": 0.625},
    "verified_minus_ntp": {"mean": 0.125, "ci95": [-0.1, 0.35]},
  }
  line = precision.markdown({"m": [row]}).splitlines()[2]
  assert (
    line == "| m | bfloat16 | 0 / 8 | 1 / 8 | 2 / 8 | 3 / 8 | 50.0 | 62.5 | +12.5 [-10.0, +35.0] |"
  )
