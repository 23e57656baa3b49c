"""A code corpus present on every machine: the installed Python's standard-library sources.

Files are split into train / held-out by a hash of their path relative to the stdlib root (so the
split is the same on every machine with the same Python), and written as JSONL `text` records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig

HELD_OUT_FRACTION = 0.1  # share of files (by path hash) kept out of training
_SALT = b"sbd-code-v1"
_SKIP_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Where the JSONL files are and how many files / bytes went into each split."""

  root: str  # the stdlib directory the files were read from
  train_path: str
  heldout_path: str
  num_train: int
  num_heldout: int
  train_bytes: int
  heldout_bytes: int


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def is_held_out(relpath: str) -> bool:
  digest = hashlib.blake2b(_SALT + relpath.encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2**64 < HELD_OUT_FRACTION


def list_files(root: str) -> list[str]:
  """Relative paths of the stdlib's *.py files (no tests, no installed packages), sorted."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    for name in sorted(filenames):
      if name.endswith(".py"):
        out.append(os.path.relpath(os.path.join(dirpath, name), root))
  return out


def _read(path: str) -> str | None:
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError):
    return None
  return text if text.strip() else None


def build(out_dir: str, max_files: int = 0, root: str | None = None) -> Corpus:
  """Write <out_dir>/train.jsonl and heldout.jsonl ({"text", "path"} records); reuse if present.

  `max_files` > 0 keeps that many files, chosen by path hash (a fixed, machine-independent
  subset), before splitting.
  """
  root = root or stdlib_root()
  os.makedirs(out_dir, exist_ok=True)
  train_path = os.path.join(out_dir, "train.jsonl")
  heldout_path = os.path.join(out_dir, "heldout.jsonl")
  meta_path = os.path.join(out_dir, "corpus.json")
  if all(os.path.exists(p) for p in (train_path, heldout_path, meta_path)):
    with open(meta_path) as f:
      meta = json.load(f)
    if meta.get("root") == root and meta.get("max_files") == max_files:
      return Corpus(**{k: v for k, v in meta.items() if k != "max_files"})
  files = list_files(root)
  if max_files > 0:
    files = sorted(files, key=lambda p: hashlib.blake2b(p.encode(), digest_size=8).digest())
    files = sorted(files[:max_files])
  counts = {"train": [0, 0], "heldout": [0, 0]}
  with open(train_path + ".tmp", "w") as train_f, open(heldout_path + ".tmp", "w") as held_f:
    for rel in files:
      text = _read(os.path.join(root, rel))
      if text is None:
        continue
      split = "heldout" if is_held_out(rel) else "train"
      (held_f if split == "heldout" else train_f).write(
        json.dumps({"text": text, "path": rel}) + "\n"
      )
      counts[split][0] += 1
      counts[split][1] += len(text.encode())
  os.replace(train_path + ".tmp", train_path)
  os.replace(heldout_path + ".tmp", heldout_path)
  corpus = Corpus(
    root=root,
    train_path=train_path,
    heldout_path=heldout_path,
    num_train=counts["train"][0],
    num_heldout=counts["heldout"][0],
    train_bytes=counts["train"][1],
    heldout_bytes=counts["heldout"][1],
  )
  with open(meta_path, "w") as f:
    json.dump({**dataclasses.asdict(corpus), "max_files": max_files}, f, indent=1)
  return corpus


def read_texts(path: str) -> list[str]:
  """The `text` fields of a JSONL file, in file order."""
  with open(path) as f:
    return [json.loads(line)["text"] for line in f if line.strip()]
