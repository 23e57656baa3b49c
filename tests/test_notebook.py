"""notebooks/sbd_sampling.ipynb runs top to bottom in a fresh kernel: it trains a (very short)
tiny model into an empty workdir itself, decodes, and draws both pictures."""

import os

import nbformat
import pytest
from nbclient import NotebookClient
from xla_env import xla_flags  # tests/ is on sys.path

pytestmark = pytest.mark.integration  # the notebook, executed in a fresh kernel

REPO = os.path.dirname(os.path.dirname(__file__))
NOTEBOOK = os.path.join(REPO, "notebooks", "sbd_sampling.ipynb")


def with_parameters(nb, **values):
  """Replace the cell tagged `parameters` by these assignments (what papermill does)."""
  (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  cell.source = "\n".join(f"{k} = {v!r}" for k, v in values.items())
  return nb


def outputs(cell, output_type):
  return [o for o in cell.get("outputs", []) if o.output_type == output_type]


def test_notebook_trains_when_needed_decodes_and_plots(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", xla_flags(1))
  workdir = str(tmp_path / "run")
  nb = with_parameters(
    nbformat.read(NOTEBOOK, as_version=4),
    WORKDIR=workdir,
    TRAIN_STEPS=6,
    NUM_PROBLEMS=4,
    GAMMAS=[0.0, 0.35],
  )
  NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": REPO}}
  ).execute()

  assert os.path.isdir(os.path.join(workdir, "params"))  # it trained the model itself
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert 'find_spec("sbd_jax") is None' in code[0].source and "pip" in code[0].source  # Colab
  text = "".join(o.get("text", "") for c in code for o in outputs(c, "stream"))
  assert "no trained model in" in text and "training configs/paper_small.py for 6 steps" in text
  assert "NFE speedup:" in text and "arithmetic: 4 problems (seed 0)" in text
  for needle in ("sbd eb_entropy γ=0.35", "sbd eb_confidence γ=0"):
    assert needle in text
  pictures = [c for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)]
  assert len(pictures) == 2  # the reveal order and the γ sweep
  assert "forward  1 · block  0 | " in text  # the reveal order, one line per forward
