"""The experiment config: defaults, conversion to typed configs, and validation.

Config files in configs/ call `base_config()` and override a few fields. `validate` turns
invalid values into one-line `ConfigError`s before anything is allocated or written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import ml_collections

from sbd_jax.data import arithmetic, heldout
from sbd_jax.data.pipeline import default_data_config
from sbd_jax.decode.settings import sample_config
from sbd_jax.model import architectures
from sbd_jax.model.architectures import ModelConfig, RopeScaling
from sbd_jax.sbd.objective import MODES, ObjectiveConfig


class ConfigError(ValueError):
  """An invalid configuration value; the message is one line and names the field."""


def model_fields(cfg: ModelConfig) -> ml_collections.ConfigDict:
  """A ModelConfig as a flat ConfigDict (every field overridable from the command line)."""
  fields = {
    f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "rope_scaling"
  }
  scaling = cfg.rope_scaling or RopeScaling(factor=0.0)
  fields.update(
    rope_scaling_factor=scaling.factor,  # 0 disables "llama3" frequency scaling
    rope_low_freq_factor=scaling.low_freq_factor,
    rope_high_freq_factor=scaling.high_freq_factor,
    rope_original_max_position=scaling.original_max_position,
  )
  return ml_collections.ConfigDict(fields)


def base_config(model: ModelConfig | None = None) -> ml_collections.ConfigDict:
  """Every field with its default; the tiny CPU setup unless a model is given."""
  c = ml_collections.ConfigDict()
  c.model = model_fields(model or architectures.tiny())

  c.sbd = ml_collections.ConfigDict()
  c.sbd.mode = "sbd"  # "sbd" (NTP + MATP), "ntp" (plain LM baseline), "matp_only" (ablation)
  c.sbd.k_min = 2  # block size k ~ U{k_min .. k_max}, drawn per step (paper: 2..16)
  c.sbd.k_max = 16
  c.sbd.mask_id = -1  # mask token id; -1 = the tokenizer's mask id
  # Masking rate η ~ Beta(a, b) per document; (1, 1) is the paper's U(0, 1).
  c.sbd.eta_beta = (1.0, 1.0)
  c.sbd.full_block_prob = 0.0  # share of blocks masked whole on top of η (decoding starts so)
  c.sbd.matp_weight = 1.0  # weight of the MATP term against NTP's (1: the paper's eq. 14)
  # Blocks tile each document from its start ("document", the paper), from the completion's
  # first token ("completion": the first block starts where decoding starts), or the packed
  # row ("row": what splash attention's static masks need; a document's edge blocks are cut).
  c.sbd.block_anchor = "document"
  # Append k_max - 1 EOS tokens to every document and train the block positions past its EOS
  # (inside the EOS's block) to predict EOS, as decoding meets them. False: the paper's setup.
  c.sbd.train_past_eos = True
  # The paper fine-tunes an NTP-pretrained model with SBD. For a run from scratch, the first
  # `ntp_steps` optimizer steps use the NTP objective alone (half the tokens per step), then
  # SBD takes over with the same optimizer state and learning-rate schedule. 0 = SBD throughout.
  c.sbd.ntp_steps = 0
  # The same phase as a share of train.steps (floor), so that a shorter or longer run keeps
  # its proportions; at most one of the two may be set.
  c.sbd.ntp_fraction = 0.0

  # "byte" (built-in), "words" (a word vocabulary built from the training data into
  # <workdir>/tokenizer on the first start), or a path to a Hugging Face tokenizer.json / dir.
  c.tokenizer = "byte"
  c.data = default_data_config()

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000  # optimizer steps in total
  c.train.batch_size = 16  # global batch (rows); split over (data, fsdp) and over hosts
  c.train.seq_len = 256  # tokens per packed row (L; the SBD input is 2L)
  c.train.seed = 0  # parameters, masking and k draws derive from it
  c.train.log_every = 20  # steps between metric lines / metrics.jsonl records
  # Tokens per cross-entropy chunk: the [tokens x vocab] logits are computed (and recomputed
  # in the backward pass) a chunk at a time, never whole; 0 = whole (small vocabularies).
  c.train.loss_chunk = 0
  # Params-only checkpoint to start from (e.g. a converted HF model); "" or "random": random
  # weights. A config that fine-tunes a pretrained model sets `pretrained`: then "" is refused
  # when training starts, and random weights must be asked for as "random".
  c.train.init_from = ""
  c.train.pretrained = False
  c.train.peak_tflops_per_device = 0.0  # for MFU; 0 = look up the device kind, if known
  c.train.progress_bar = True  # tqdm bar when attached to a terminal
  c.train.max_hours = 0.0  # wall-clock budget: save and stop cleanly after it; 0 = none
  # Non-finite loss / gradients: 0 stops the run at the first one; N > 0 skips up to N such
  # updates in the whole run (the update is not applied; each skip is logged), then stops.
  c.train.skip_nonfinite_steps = 0
  # Weights & Biases project for the train/ and eval/ scalars (needs `pip install wandb`);
  # "" = TensorBoard event files in <workdir>/tensorboard only.
  c.train.wandb_project = ""
  # Steps between held-out evaluations (NTP loss, MATP loss per masking rate, optionally a
  # small decode; the `eval` group, `data.heldout`), logged as heldout/*; 0 = none.
  c.train.eval_every = 0
  c.eval = heldout.heldout_config()

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 3e-3  # peak learning rate (paper 8B: 3e-4)
  c.optim.warmup_steps = 50  # linear warm-up (paper 8B: 200)
  c.optim.decay_steps = -1  # cosine decay length; -1 = train.steps - warmup_steps
  c.optim.end_lr_ratio = 0.1  # final lr = lr * end_lr_ratio
  c.optim.weight_decay = 0.1
  # Whether weight decay also shrinks the token embedding table (the output projection too, when
  # tied). Tokens whose only distinct job is to be copied (configs/tiny.py's operation verbs)
  # can collapse onto one vector under it (`optim.decay_mask`).
  c.optim.decay_embeddings = True
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.clip_norm = 1.0  # global gradient norm clip; 0 disables

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (1, -1, 1)  # (data, fsdp, tensor); one entry may be -1 (all remaining)
  # Multislice: how many slices each axis spans (product = the number of slices; each slice
  # holds shape / dcn_shape of the mesh). (1, 1, 1) = automatic: one slice, or all slices on
  # "data", whose gradient all-reduce is what best tolerates the data-centre network.
  c.mesh.dcn_shape = (1, 1, 1)

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 200  # save period
  c.checkpoint.keep = 3  # keep the last N checkpoints
  c.checkpoint.async_save = True  # save in a background thread while training continues

  c.sample = sample_config()  # decode settings (`sbd_jax.decode.settings`) and evaluation
  # JAX's persistent compilation cache for the train step and the decodes (`compile_cache`):
  # "" off, "workdir" = <workdir>/compile_cache, or a directory (gs:// too) shared by runs.
  c.compile_cache = ""
  return c


def from_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file such as configs/tiny.py (what `--config=` loads)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no config file {path}")
  spec = importlib.util.spec_from_file_location(os.path.basename(path).removesuffix(".py"), path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def apply_8b_finetune_recipe(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The paper's 8B SBD fine-tune: AdamW lr 3e-4, 200 warm-up steps then cosine, 2M-token
  batches (64 x 32k), 34k steps (~70B tokens), k ~ U{2..16}, FSDP over every device. Beyond
  the paper: held-out losses every 1000 steps on the last 1024 documents of each source, kept
  out of training (4 batches x 4 masking rates: about 5 steps' compute, 0.5 % of the run)."""
  c.tokenizer = ""  # path to the converted model's tokenizer.json (python -m sbd_jax.convert)
  c.train.pretrained = True  # train.init_from must name the converted params (or be "random")
  c.sbd.k_min, c.sbd.k_max = 2, 16
  c.sbd.block_anchor = "row"  # splash attention (the TPU presets' kernel) needs row-tiled blocks
  c.train.seq_len = 32_768
  c.train.batch_size = 64
  c.train.steps = 34_000
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 200
  c.optim.end_lr_ratio = 0.0
  c.mesh.shape = (1, -1, 1)  # set tensor > 1 on large slices
  c.data.source = "jsonl"  # prompt/completion SFT records; set data.paths
  c.checkpoint.every_steps = 1000
  c.train.eval_every = 1000
  c.data.holdout = 1024
  c.compile_cache = "workdir"  # a restart after preemption loads the step instead of compiling
  c.model.attention_chunk = 1024
  # 2 x 32k positions x a 128k-152k vocabulary: float32 logits of one row would be 32-40 GiB.
  c.train.loss_chunk = 2048
  return c


def to_model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  fields = dict(c.model)
  factor = fields.pop("rope_scaling_factor")
  scaling = RopeScaling(
    factor=factor,
    low_freq_factor=fields.pop("rope_low_freq_factor"),
    high_freq_factor=fields.pop("rope_high_freq_factor"),
    original_max_position=fields.pop("rope_original_max_position"),
  )
  try:
    return ModelConfig(rope_scaling=scaling if factor > 0 else None, **fields)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"model: {e}") from None


def resolve_mask_id(c: ml_collections.ConfigDict, tokenizer) -> int:
  """The run's mask id: sbd.mask_id, or the tokenizer's when it is -1."""
  return tokenizer.mask_id if c.sbd.mask_id < 0 else c.sbd.mask_id


def to_objective_config(c: ml_collections.ConfigDict, mask_id: int) -> ObjectiveConfig:
  try:
    return ObjectiveConfig(
      mode=c.sbd.mode,
      mask_id=mask_id,
      k_min=c.sbd.k_min,
      k_max=c.sbd.k_max,
      eta_beta=tuple(float(x) for x in c.sbd.eta_beta),
      full_block_prob=c.sbd.full_block_prob,
      block_anchor=c.sbd.block_anchor,
      loss_chunk=c.train.loss_chunk,
      matp_weight=float(c.sbd.matp_weight),
    )
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e)) from None


def eos_tail_length(c: ml_collections.ConfigDict) -> int:
  """EOS tokens the data pipeline appends to each document (see `sbd_jax.sbd.noising`)."""
  return c.sbd.k_max - 1 if c.sbd.train_past_eos and c.sbd.mode != "ntp" else 0


def ntp_phase_steps(c: ml_collections.ConfigDict) -> int:
  """Optimizer steps of the NTP-only phase that opens an SBD run (`sbd.ntp_steps` or
  `sbd.ntp_fraction` of train.steps); 0 for a run without one."""
  if c.sbd.mode == "ntp":
    return 0
  if c.sbd.ntp_steps:
    return c.sbd.ntp_steps
  return int(c.sbd.ntp_fraction * c.train.steps + 1e-9)


def validate(
  c: ml_collections.ConfigDict, *, num_devices: int | None = None, tokenizer=None
) -> None:
  """Raise ConfigError with a one-line message on the first invalid value."""
  model = to_model_config(c)
  _validate_objective(c, model)
  _require(c.train.batch_size > 0, f"train.batch_size must be positive, got {c.train.batch_size}")
  _require(
    c.sample.num_problems >= 0, f"sample.num_problems must be >= 0, got {c.sample.num_problems}"
  )
  _require(c.optim.lr > 0, f"optim.lr must be positive, got {c.optim.lr}")
  _require(c.train.max_hours >= 0, f"train.max_hours must be >= 0, got {c.train.max_hours}")
  _require(
    not c.train.wandb_project or importlib.util.find_spec("wandb") is not None,
    f"train.wandb_project={c.train.wandb_project!r} needs wandb: pip install wandb, or unset it",
  )
  _require(
    c.train.skip_nonfinite_steps >= 0,
    f"train.skip_nonfinite_steps must be >= 0, got {c.train.skip_nonfinite_steps}",
  )
  _require(
    0 <= c.optim.warmup_steps, f"optim.warmup_steps must be >= 0, got {c.optim.warmup_steps}"
  )
  _require(
    c.checkpoint.every_steps > 0 and c.checkpoint.keep > 0,
    "checkpoint.every_steps and checkpoint.keep must be positive",
  )
  complaint = heldout.validate(c, c.sbd.k_min, c.sbd.k_max)
  _require(complaint is None, str(complaint))
  _validate_mesh(c, num_devices)
  if tokenizer is not None:
    _validate_tokenizer(c, model, tokenizer)


def _require(ok: bool, message: str) -> None:
  """ConfigError(message) unless ok."""
  if not ok:
    raise ConfigError(message)


def _validate_objective(c: ml_collections.ConfigDict, model) -> None:
  """The SBD objective, its schedule, the attention kernel's needs and the decode block."""
  _require(c.sbd.mode in MODES, f"sbd.mode must be one of {MODES}, got {c.sbd.mode!r}")
  _require(
    1 <= c.sbd.k_min <= c.sbd.k_max,
    f"sbd.k_min ({c.sbd.k_min}) must be >= 1 and <= sbd.k_max ({c.sbd.k_max})",
  )
  to_objective_config(c, mask_id=0)  # the remaining sbd.* fields
  _require(c.train.steps > 0, f"train.steps must be positive, got {c.train.steps}")
  _require(
    0 <= c.sbd.ntp_steps < c.train.steps or c.sbd.mode == "ntp",
    f"sbd.ntp_steps ({c.sbd.ntp_steps}) must be >= 0 and < train.steps ({c.train.steps}), "
    "so that some steps train SBD",
  )
  _require(
    0 <= c.sbd.ntp_fraction < 1,
    f"sbd.ntp_fraction ({c.sbd.ntp_fraction}) must be in [0, 1), so that some steps train SBD",
  )
  _require(
    not (c.sbd.ntp_steps and c.sbd.ntp_fraction),
    f"set sbd.ntp_steps ({c.sbd.ntp_steps}) or sbd.ntp_fraction ({c.sbd.ntp_fraction}), not both",
  )
  _require(c.train.seq_len > 1, f"train.seq_len must be > 1, got {c.train.seq_len}")
  if model.attention_impl == "splash":
    tile = model.attention_chunk
    whole_tiles = all(n % min(tile, n) == 0 for n in (c.train.seq_len, 2 * c.train.seq_len))
    _require(
      c.sbd.mode == "ntp" or c.sbd.block_anchor == "row",
      "model.attention_impl='splash' needs sbd.block_anchor='row' (a static mask: blocks tile "
      f"the packed row), got {c.sbd.block_anchor!r}",
    )
    _require(
      whole_tiles and c.train.seq_len >= c.sbd.k_max,
      f"model.attention_impl='splash' needs L and 2L (train.seq_len {c.train.seq_len}) to be "
      f"whole tiles (model.attention_chunk, {tile}) or fit in one, and L >= sbd.k_max "
      f"({c.sbd.k_max})",
    )
  _require(
    c.sbd.mode == "ntp" or c.sample.block_size <= c.sbd.k_max,
    f"sample.block_size ({c.sample.block_size}) is larger than the largest block trained, "
    f"sbd.k_max ({c.sbd.k_max}): decoding would ask for positions the model never learned",
  )


def _validate_mesh(c: ml_collections.ConfigDict, num_devices: int | None) -> None:
  """The mesh's shape, and (given the device count) that it and the batch fit the devices."""
  shape = tuple(c.mesh.shape)
  _require(
    len(shape) == 3 and all(s > 0 or s == -1 for s in shape) and shape.count(-1) <= 1,
    f"mesh.shape {shape} must be 3 positive sizes (data, fsdp, tensor), at most one -1",
  )
  dcn = tuple(c.mesh.dcn_shape)
  _require(
    len(dcn) == 3 and all(isinstance(d, int) and d > 0 for d in dcn),
    f"mesh.dcn_shape {dcn} must be 3 positive slice counts (data, fsdp, tensor)",
  )
  if num_devices is not None:
    known = math.prod(s for s in shape if s != -1)
    fits = num_devices % known == 0 if -1 in shape else known == num_devices
    _require(fits, f"mesh.shape {shape} does not match the {num_devices} available devices")
    sizes = [num_devices // known if s == -1 else s for s in shape]
    batch_ways = sizes[0] * sizes[1]  # the batch's row slices: one per (data, fsdp) pair
    _require(
      c.train.batch_size % batch_ways == 0,
      f"train.batch_size {c.train.batch_size} is not divisible by the {batch_ways} "
      "data-parallel (data x fsdp) devices",
    )


def _validate_tokenizer(c: ml_collections.ConfigDict, model, tokenizer) -> None:
  """The tokenizer fits the model's vocabulary, and the mask token is a token of its own."""
  _require(
    tokenizer.vocab_size <= model.vocab_size,
    f"tokenizer vocabulary ({tokenizer.vocab_size}) is larger than model.vocab_size "
    f"({model.vocab_size})",
  )
  mask_id = resolve_mask_id(c, tokenizer)
  _require(
    0 <= mask_id < model.vocab_size,
    f"sbd.mask_id {mask_id} is outside the model vocabulary [0, {model.vocab_size})",
  )
  _require(
    mask_id not in (tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id),
    f"sbd.mask_id {mask_id} must differ from eos/bos/pad ids",
  )


def random_init(c: ml_collections.ConfigDict) -> bool:
  """Whether the run starts from random weights; a one-line ConfigError when a config that
  fine-tunes a pretrained model (`train.pretrained`) names no params to start from."""
  if c.train.pretrained and not c.train.init_from:
    raise ConfigError(
      "this config fine-tunes a pretrained model: set train.init_from to its converted params "
      "(python -m sbd_jax.convert hf-to-orbax makes them), or train.init_from=random to start "
      "from random weights on purpose"
    )
  return c.train.init_from in ("", "random")


def longest_arithmetic_document(c: ml_collections.ConfigDict, tokenizer, sample: int = 256) -> int:
  """Tokens of the longest of `sample` training problems, as the pipeline encodes them."""
  difficulty = arithmetic.Difficulty.of(c.data.arithmetic)
  lengths = [
    len(tokenizer.encode(arithmetic.generate("train", i, c.train.seed, difficulty).text))
    for i in range(sample)
  ]
  return max(lengths) + 2 + eos_tail_length(c)  # BOS, EOS
