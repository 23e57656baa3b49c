"""Grain input pipeline: source -> tokenize -> pack rows with segment ids -> batch.

Batches are dicts of numpy arrays, each [B, L]: `tokens`, `segment_ids` (1, 2, ... per document
in a row, 0 = padding), `positions` (restart at 0 per segment) and `loss_mask` (1 = target).
The returned iterator is a `grain.DatasetIterator`: checkpoint it with `get_state()/set_state()`
or with `grain.checkpoint.CheckpointSave/CheckpointRestore` inside an Orbax CheckpointManager.
"""

import functools
import os
from collections.abc import Sequence
from typing import Any

import grain
import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_dict

from sbd_jax.data import arithmetic, chat, heldout, mixture, sources
from sbd_jax.data.tokenizer import Tokenizer

PACKINGS = ("first_fit", "concat")


def default_data_config() -> ml_collections.ConfigDict:
  """Every field the data pipeline reads, with its default."""
  cfg = ml_collections.ConfigDict()
  # "arithmetic" (built-in synthetic task), "jsonl", "text", "array_record", "parquet" or
  # "tfds".
  cfg.source = "arithmetic"
  # jsonl/text/array_record/parquet: comma-separated globs, local or gs://. jsonl: one JSON
  # object per line, {text_field}, {"prompt", "completion"} or {"messages": [{"role",
  # "content"}, ...]} (rendered with the tokenizer's chat template; loss on assistant turns
  # only), under the names `fields` gives; text: every matching file is one document;
  # array_record: records are JSON bytes; parquet: one record per row (Hub shards as they are).
  cfg.paths = ""
  # Data seed (shuffle order, packing, arithmetic problems); None = the run seed given to
  # make_train_dataset.
  cfg.seed = config_dict.placeholder(int)
  # Field holding a plain-text document (jsonl, array_record, tfds). Records without it must
  # have "prompt" and "completion" fields (SFT).
  cfg.text_field = "text"
  # The other fields a record may have (`data.fields.FieldMap`): e.g. Hub datasets'
  # problem / generated_solution (prompt, completion), or ShareGPT's conversations with from /
  # value (messages, role, content); `roles` renames role values to the chat template's.
  cfg.fields = ml_collections.ConfigDict()
  cfg.fields.prompt = "prompt"
  cfg.fields.completion = "completion"
  cfg.fields.messages = "messages"
  cfg.fields.role = "role"
  cfg.fields.content = "content"
  cfg.fields.roles = "human:user,gpt:assistant"
  # A weighted mixture instead of one source: a tuple of dicts, each a weight (> 0) and the
  # fields above that differ for that source (source, paths, text_field, fields, tfds_*), e.g.
  # (dict(weight=0.7, source="parquet", paths=..., fields=dict(prompt="problem", ...)),
  #  dict(weight=0.3, paths=...)). Every host interleaves its shard of each source in those
  # proportions, deterministically (grain's MapDataset.mix): batches resume exactly. Each source
  # repeats on its own (num_epochs does not apply), so a small one is seen again while a large
  # one is still in its first pass, and the shares stay the weights.
  cfg.mixture = ()
  # The last N documents of each source (of each mixture source, which may set its own) are
  # kept out of training: the held-out data of `train.eval_every` unless `eval.paths` is set.
  cfg.holdout = 0
  # SFT records: if True prompt tokens are training targets too; if False only the completion
  # (and eos) is.
  cfg.prompt_loss = False
  # tfds: dataset name (e.g. "my_corpus:1.0.0"), split and the local data_dir where it was
  # prepared in ArrayRecord format; nothing is ever downloaded.
  cfg.tfds_name = ""
  cfg.tfds_split = "train"
  cfg.tfds_data_dir = ""
  # Reshuffle documents every epoch (global index shuffle seeded by the data seed).
  cfg.shuffle = True
  # Passes over the source; None = repeat forever (training).
  cfg.num_epochs = config_dict.placeholder(int)
  # "first_fit": whole documents first-fit into rows, only documents longer than seq_len are
  # split; "concat": concatenate-then-split, no padding, documents may straddle rows.
  cfg.packing = "first_fit"
  # first_fit: rows packed at once (more = less padding); 0 = the batch size.
  cfg.packing_bins = 0
  # Threads reading and tokenizing records in process.
  cfg.read_threads = 2
  # Worker processes for the whole pipeline (grain mp_prefetch); 0 = in-process.
  cfg.num_workers = 0
  # Malformed records (invalid JSON, missing or non-string fields, non-UTF-8 bytes): False
  # stops with a one-line error naming file and line; True skips them, counted in the metrics
  # (`skipped_records`).
  cfg.skip_bad_records = False
  cfg.arithmetic = ml_collections.ConfigDict()
  # Size of the train index range (problems are drawn per index; < 2**32).
  cfg.arithmetic.num_train = 1_000_000
  # Difficulty (see arithmetic.Difficulty): operations per problem drawn from
  # [min_ops, max_ops]; each event's amount in [min_operand, max_operand]; the start and every
  # running total in [min_total, max_total].
  cfg.arithmetic.min_ops = 2
  cfg.arithmetic.max_ops = 3
  cfg.arithmetic.min_operand = 2
  cfg.arithmetic.max_operand = 29
  cfg.arithmetic.min_total = 10
  cfg.arithmetic.max_total = 99
  # "columns": each operation worked digit by digit with its carry or borrow ("52-25: 12-5=7,
  # 5-2-1=2, so 52-25=27."); "sentences": restated in words and done in one equation.
  cfg.arithmetic.solution = "columns"
  # Share of training documents that are bare equation drills ("47 + 46 = 93. ..."), which
  # practise the operations more densely than word problems; evaluation is on problems only.
  cfg.arithmetic.drill_fraction = 0.0
  return cfg


def encode_record(
  record: dict[str, Any],
  tokenizer: Tokenizer,
  prompt_loss: bool,
  eos_tail: int = 0,
  chat_template: chat.ChatTemplate | None = None,
) -> dict[str, np.ndarray]:
  """Record -> `encode_document(text) + [eos]` (BOS only where the tokenizer adds one, never a
  target; EOS always one) with its loss mask, then `eos_tail` more EOS tokens, marked in the
  `eos_tail` field (see `sbd_jax.sbd.noising`).

  A `messages` record is rendered with `chat_template` and keeps the special tokens the
  template writes (no BOS is added; an EOS only if the conversation does not end in one); its
  loss covers the assistant turns only (`chat.tokenize_conversation`)."""
  if "messages" in record:
    if chat_template is None:
      raise sources.DataError(
        f"a 'messages' record needs a chat template, and tokenizer {tokenizer!r} has none"
      )
    try:
      body, body_mask = chat.tokenize_conversation(
        chat_template, tokenizer.tokenizer, record["messages"]
      )
    except chat.ChatTemplateError as e:
      raise sources.DataError(str(e)) from None
    head, head_mask = [], []
    ends_in_eos = bool(body) and body[-1] == tokenizer.eos_id
    tail, tail_mask = ([], []) if ends_in_eos else ([tokenizer.eos_id], [1])
  else:
    if "text" in record:
      body = tokenizer.encode_document(record["text"])
      body_mask = [1] * len(body)
    else:
      prompt = tokenizer.encode_document(record["prompt"])
      completion = tokenizer.encode(record["completion"])
      body = prompt + completion
      body_mask = [int(prompt_loss)] * len(prompt) + [1] * len(completion)
    if body and body[0] == tokenizer.bos_id:
      body_mask[0] = 0  # the tokenizer's BOS: context, never a target or masked
    head, head_mask, tail, tail_mask = [], [], [tokenizer.eos_id], [1]
  tokens = np.asarray([*head, *body, *tail, *[tokenizer.eos_id] * eos_tail], np.int32)
  loss_mask = np.asarray([*head_mask, *body_mask, *tail_mask, *[0] * eos_tail], np.int32)
  eos_tail_L = np.zeros(len(tokens), np.int32)
  eos_tail_L[len(tokens) - eos_tail :] = 1
  return {"tokens": tokens, "loss_mask": loss_mask, "eos_tail": eos_tail_L}


class SplitLongDocuments(grain.experimental.FlatMapTransform):
  """Cuts a tokenized document into chunks of at most `seq_len` tokens (one segment each)."""

  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    self.max_fan_out = 1 << 20  # not enforced on IterDatasets; documents may be long

  def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    n = len(element["tokens"])
    return [
      {k: v[i : i + self.seq_len] for k, v in element.items()} for i in range(0, n, self.seq_len)
    ]


def _finalize_row(row: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
  """Grain's packed feature names -> ours; padding gets pad_id and loss_mask 0."""
  segment_ids_L = row["tokens_segment_ids"].astype(np.int32)
  real_L = segment_ids_L > 0
  return {
    "tokens": np.where(real_L, row["tokens"], pad_id).astype(np.int32),
    "segment_ids": segment_ids_L,
    "positions": np.where(real_L, row["tokens_positions"], 0).astype(np.int32),
    "loss_mask": np.where(real_L, row["loss_mask"], 0).astype(np.int32),
    # Which tokens are appended EOS (sbd.train_past_eos): the objective masks those in their
    # document's EOS block, as decoding meets them. Dropping the field here would leave them
    # clean in x̂, where the block attends to them and decoding never shows them.
    "eos_tail": np.where(real_L, row["eos_tail"], 0).astype(np.int32),
  }


def pack_rows(
  docs: grain.IterDataset, *, seq_len: int, packing: str, num_bins: int, seed: int, pad_id: int
) -> grain.IterDataset:
  """Tokenized documents -> rows of `seq_len` tokens with segment ids and positions."""
  lengths = {"tokens": seq_len, "loss_mask": seq_len, "eos_tail": seq_len}
  if packing == "first_fit":
    chunks = grain.experimental.FlatMapIterDataset(docs, SplitLongDocuments(seq_len))
    rows = grain.experimental.FirstFitPackIterDataset(
      chunks, length_struct=lengths, num_packing_bins=num_bins, seed=seed, shuffle_bins=True
    )
  elif packing == "concat":
    rows = grain.experimental.ConcatThenSplitIterDataset(docs, length_struct=lengths)
  else:
    raise sources.DataError(f"unknown data.packing {packing!r}; expected one of {PACKINGS}")
  return rows.map(functools.partial(_finalize_row, pad_id=pad_id))


def make_train_dataset(
  data_cfg: ml_collections.ConfigDict,
  tokenizer: Tokenizer,
  *,
  batch_size: int,
  seq_len: int,
  seed: int,
  shard_index: int = 0,
  shard_count: int = 1,
  eos_tail: int = 0,
  bad_records: sources.BadRecords | None = None,
) -> grain.IterDataset:
  """Batches `{tokens, segment_ids, positions, loss_mask, eos_tail}`, each [batch_size, seq_len]
  int32, of shard `shard_index` of `shard_count`: a disjoint slice of the documents;
  deterministic given (data_cfg, seed, shard). Every document gets `eos_tail` extra EOS tokens
  (`encode_record`). With `data_cfg.skip_bad_records`, unusable records are skipped and counted
  in `bad_records` (within this process, as they are read)."""
  source = _source(data_cfg, seed, bad_records)
  batches = _shard_batches(
    source, data_cfg, tokenizer, batch_size, seq_len, seed, shard_index, shard_count, eos_tail,
    bins=data_cfg.packing_bins or batch_size,
  )  # fmt: skip
  return _with_workers(batches, data_cfg)


def make_slices_dataset(
  data_cfg: ml_collections.ConfigDict,
  tokenizer: Tokenizer,
  *,
  slice_rows: int,
  slices: Sequence[int],
  slice_count: int,
  seq_len: int,
  seed: int,
  eos_tail: int = 0,
  bad_records: sources.BadRecords | None = None,
  mixture_counts: mixture.MixtureCounts | None = None,
  part: str = "train",
) -> grain.IterDataset:
  """The rows of the global batch's row slices `slices` (of `slice_count`, `slice_rows` rows
  each), concatenated in order: slice s always comes from shard s of the documents, so a
  process feeds the same rows for a slice whatever the other processes hold, and the global
  batch does not depend on how many processes there are (`sharding.batch_row_slices`). Of a
  mixture, the documents read per source are counted in `mixture_counts` (in this process).
  `part`: the documents read (`heldout.split`; "train" leaves out `data.holdout`)."""
  bins = data_cfg.packing_bins or slice_rows * slice_count  # as one pipeline of the whole batch
  source = _source(data_cfg, seed, bad_records, part)  # read once, sliced per shard
  parts = [
    _shard_batches(
      source,
      data_cfg,
      tokenizer,
      slice_rows,
      seq_len,
      seed,
      s,
      slice_count,
      eos_tail,
      bins,
      mixture_counts,
    )  # fmt: skip
    for s in slices
  ]
  if len(parts) > 1:
    parts = [grain.experimental.ZipIterDataset(parts).map(_concatenate_rows)]
  return _with_workers(parts[0], data_cfg)


def _concatenate_rows(batches: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _source(
  data_cfg, seed: int, bad_records: sources.BadRecords | None, part: str = "train"
) -> grain.MapDataset:
  """The documents of the run's `part` (records as `sources` reads them; `heldout.split`);
  for a mixture, a list of (documents, weight) per source."""
  data_seed = seed if data_cfg.seed is None else data_cfg.seed
  if data_cfg.skip_bad_records and bad_records is None:
    bad_records = sources.BadRecords()
  bad = bad_records if data_cfg.skip_bad_records else None
  if not data_cfg.get("mixture"):
    split = "eval" if part == "eval" else "train"
    docs = grain.MapDataset.source(sources.make_source(data_cfg, data_seed, bad, split))
    return heldout.split(docs, data_cfg.get("holdout", 0), part, data_cfg.paths or "the source")
  return mixture.sources_of(data_cfg, data_seed, bad, part)


def _shard_batches(
  source, data_cfg, tokenizer, batch_size, seq_len, seed, shard_index, shard_count, eos_tail,
  bins, mixture_counts=None,
) -> grain.IterDataset:  # fmt: skip
  """Batches of shard `shard_index` of `source`'s documents, before worker processes, packed
  `bins` rows at a time."""
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is outside [0, shard_count={shard_count})")
  if batch_size <= 0 or seq_len <= 0:
    raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be positive")
  data_seed = seed if data_cfg.seed is None else data_cfg.seed
  ds = mixture.documents(source, data_cfg, data_seed, shard_index, shard_count, mixture_counts)
  template_dir = os.path.dirname(getattr(tokenizer, "path", "") or "")
  ds = ds.map(
    functools.partial(
      encode_record,
      tokenizer=tokenizer,
      prompt_loss=data_cfg.prompt_loss,
      eos_tail=eos_tail,
      chat_template=chat.ChatTemplate.from_tokenizer_dir(template_dir) if template_dir else None,
    )
  )
  docs = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=data_cfg.read_threads, prefetch_buffer_size=64)
  )
  rows = pack_rows(
    docs,
    seq_len=seq_len,
    packing=data_cfg.packing,
    num_bins=bins,
    seed=(data_seed + 1) % 2**32,
    pad_id=tokenizer.pad_id,
  )
  return rows.batch(batch_size, drop_remainder=True)


def _with_workers(batches: grain.IterDataset, data_cfg) -> grain.IterDataset:
  """`batches` produced by `data_cfg.num_workers` worker processes (0: in this process)."""
  if data_cfg.num_workers > 0:
    if not flags.FLAGS.is_parsed():  # grain workers read absl flags; fine outside absl.app too
      flags.FLAGS.mark_as_parsed()
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.num_workers))
  return batches


def make_train_iterator(*args, **kwargs) -> grain.DatasetIterator:
  """Checkpointable iterator over `make_train_dataset(*args, **kwargs)`."""
  return iter(make_train_dataset(*args, **kwargs))


def make_eval_problems(
  data_cfg: ml_collections.ConfigDict, n: int, seed: int
) -> list[arithmetic.Problem]:
  """The first `n` held-out arithmetic problems for `seed` (never seen in training)."""
  if data_cfg.source != "arithmetic":
    raise ValueError(
      f"eval problems exist only for data.source='arithmetic', not {data_cfg.source!r}"
    )
  difficulty = arithmetic.Difficulty.of(data_cfg.arithmetic)
  return [arithmetic.generate("eval", i, seed, difficulty) for i in range(n)]
