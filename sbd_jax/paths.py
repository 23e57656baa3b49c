"""Workdir and checkpoint paths, local or remote (gs://...), through etils.epath.

`os.path.abspath("gs://bucket/run")` is a local directory named "gs:"; every host of a pod would
write its own. These helpers keep URLs as they are and make local paths absolute.
"""

from __future__ import annotations

from etils import epath


def is_remote(path: str | epath.Path) -> bool:
  return "://" in str(path)


def resolve(path: str | epath.Path) -> epath.Path:
  """An epath.Path: URLs unchanged, local paths absolute."""
  p = epath.Path(path)
  return p if is_remote(path) else p.absolute()
