"""What every benchmark writes: a markdown table, results.json, and figures.

`save` writes DIR/results.json, DIR/<stem>.md and, given a figure function, DIR/<stem>.png.
Figures are matplotlib (Agg) panels drawn by `figure`, which returns the series it drew
(`{panel title: {label: (xs, ys)}}`), so a test can check a plot's data against the results
it claims to show.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

Series = dict[str, dict[str, tuple[list[float], list[float]]]]


def table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  """A GitHub-flavoured markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def save(
  out_dir: str,
  stem: str,
  results: dict[str, Any],
  markdown: str,
  plot: Callable[[str], Any] | None = None,
) -> None:
  """`out_dir`/results.json, `out_dir`/<stem>.md and, given `plot` (which draws to a path),
  `out_dir`/<stem>.png."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
    f.write(markdown + "\n")
  if plot is not None:
    plot(os.path.join(out_dir, f"{stem}.png"))


@contextlib.contextmanager
def figure(path: str, panels: int, size: tuple[float, float] = (4.5, 3.8)) -> Iterator[list]:
  """A row of `panels` axes, saved to `path` (110 dpi) and closed on exit."""
  import matplotlib  # pylint: disable=g-import-not-at-top  (optional: the [plot] extra)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, panels, figsize=(size[0] * panels, size[1]), squeeze=False)
  try:
    yield list(axes[0])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
  finally:
    plt.close(fig)


def drawn(axes: Sequence[Any]) -> Series:
  """The labelled lines of `axes`, by panel title: what a figure shows, for tests."""
  out: Series = {}
  for ax in axes:
    lines = {}
    for line in ax.get_lines():
      label = line.get_label()
      if not label.startswith("_"):  # matplotlib's unlabelled lines
        xs, ys = line.get_data()
        lines[label] = ([float(x) for x in xs], [float(y) for y in ys])
    out[ax.get_title()] = lines
  return out


def by_decoding(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
  """An evaluation summary's accuracy and NFE speedup per decoding name."""
  return {
    r["decoding"]: {"accuracy": r["accuracy"], "nfe_speedup": r["nfe_speedup"]}
    for r in summary["decodings"]
  }


def sbd_at(result: dict[str, Any], gamma: float) -> dict[str, float]:
  """The SBD entry of `result` (keyed by decoding name, as `by_decoding`) at γ = `gamma`."""
  return next(v for k, v in result.items() if k.startswith("sbd") and k.endswith(f"γ={gamma:g}"))
