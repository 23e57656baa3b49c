"""What the Table-1 benchmark runs at each size, and the paper's numbers it is set beside.

Every size sets the model, training, evaluation and timing budgets; see `table1` for what the
`cpu` size costs on two CPU cores.
"""

from __future__ import annotations

import dataclasses
from typing import Any

RULES = ("eb_entropy", "eb_confidence", "factor")
GAMMA_LOW, GAMMA_HIGH = 0.1, 0.35  # the paper's γ_low, γ_high for reasoning tasks

# Paper Table 1, Llama-3.1 8B rows: accuracy and NFE speedup (None = NTP).
PAPER_BENCHMARKS = ("MATH500", "AIME25", "LCB v6", "GSM8K", "HE+", "MBPP")
PAPER_LLAMA = {
  "ntp_model_ntp": (
    "Llama-3.1 8B, NTP-trained",
    "NTP",
    [(80.2, None), (33.3, None), (31.5, None), (85.3, None), (56.7, None), (70.4, None)],
  ),
  "sbd_model_ntp": (
    "Llama-3.1 8B, SBD-trained",
    "NTP",
    [(81.6, None), (30.0, None), (31.3, None), (85.6, None), (57.9, None), (70.9, None)],
  ),
  "sbd_gamma_low": (
    "Llama-3.1 8B, SBD-trained",
    "SBD γ_low",
    [(81.0, 3.55), (30.0, 3.35), (31.7, 3.72), (84.2, 2.20), (57.9, 2.61), (69.5, 2.49)],
  ),
  "sbd_gamma_high": (
    "Llama-3.1 8B, SBD-trained",
    "SBD γ_high",
    [(80.4, 3.23), (23.3, 4.50), (29.9, 4.59), (84.0, 2.34), (54.9, 2.95), (67.2, 2.66)],
  ),
}


@dataclasses.dataclass(frozen=True)
class Size:
  """Everything a benchmark size sets: model, training, evaluation and timing."""

  model: dict[str, Any]  # overrides of architectures.tiny()
  steps: int  # arithmetic optimizer steps (every model, same seed and data)
  batch_size: int
  seq_len: int
  code_steps: int  # code-corpus optimizer steps
  code_batch_size: int
  code_seq_len: int
  lr: float
  warmup_steps: int
  num_problems: int  # held-out arithmetic problems decoded per setting
  eval_batch: int
  max_new_tokens: int
  block_size: int  # SBD decode block k
  gammas: tuple[float, ...]  # eb_entropy sweep (must hold 0, γ_low and γ_high)
  confidence_gammas: tuple[float, ...]  # eb_confidence sweep
  factor_thresholds: tuple[float, ...]  # f of the factor rule
  code_max_files: int  # 0 = the whole stdlib
  code_prompts: int  # held-out files continued
  code_prompt_len: int  # N: prompt = first N tokens (BOS included)
  code_new_tokens: int  # M
  loss_rows: int  # held-out packed rows for the code NTP loss
  loss_problems: int  # held-out problems for the arithmetic NTP loss
  wall_problems: int  # prompts of the wall-clock decode
  wall_batch: int
  wall_repeats: int  # timed calls per setting, at least
  wall_min_s: float  # timed seconds of calls per setting, at least (`side_by_side.measure`)
  forward_ns: tuple[int, ...]  # time(n) measured besides 1, k and 2k
  forward_repeats: int  # rounds of the time(n) loops, at least
  compute_dtype: str = "float32"
  checkpoints: int = 4  # checkpoints per training run (resume points)
  sbd: dict[str, Any] = dataclasses.field(default_factory=dict)  # overrides of config.sbd
  optim: dict[str, Any] = dataclasses.field(default_factory=dict)  # overrides of config.optim


WORD_VOCAB_SIZE = 384  # embedding rows of the arithmetic models (bytes, specials, ~100 words)
FULL_GAMMAS = (0.0, 0.01, 0.1, 0.2, 0.35, 0.6, 1.0, 1.5)
FACTORS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)
FORWARD_NS = (1, 2, 4, 8, 16, 32)

# The recipe of configs/tiny.py (its docstring says why): the first 40 % of the steps NTP alone
# (SBD and MATP-only runs), then blocks of 4 from the completion's first token, 80 % of them
# masked whole, decoded with blocks of 4; MATP weighted twice, peak lr 2e-3, a cosine to zero.
# The `cpu` size trains it for 1750 steps with attention chunks of 128 (the model's default), so
# that its six trainings and the evaluation fit in about 25 minutes on 2 cores.
CPU_SBD = dict(
  k_min=4,
  k_max=4,
  block_anchor="completion",
  full_block_prob=0.8,
  matp_weight=2.0,
  ntp_fraction=0.4,
)
CPU_OPTIM = dict(end_lr_ratio=0.0, decay_embeddings=False)  # configs/tiny.py's

SIZES = {
  "toy": Size(
    model=dict(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128),
    steps=20,
    batch_size=8,
    seq_len=256,
    code_steps=20,
    code_batch_size=8,
    code_seq_len=128,
    lr=3e-3,
    warmup_steps=5,
    num_problems=8,
    eval_batch=8,
    max_new_tokens=16,
    block_size=4,
    gammas=(0.0, GAMMA_LOW, GAMMA_HIGH),
    confidence_gammas=(GAMMA_HIGH,),
    factor_thresholds=(1.0,),
    code_max_files=120,
    code_prompts=8,
    code_prompt_len=128,
    code_new_tokens=16,
    loss_rows=8,
    loss_problems=16,
    wall_problems=8,
    wall_batch=8,
    wall_repeats=2,
    wall_min_s=0.0,
    forward_ns=(1, 2, 4, 8),
    forward_repeats=3,
    checkpoints=1,
  ),
  "cpu": Size(
    model={},
    steps=1750,
    batch_size=8,
    seq_len=176,  # one word problem per row (configs/tiny.py)
    code_steps=300,
    code_batch_size=8,
    code_seq_len=256,
    lr=2e-3,
    warmup_steps=60,
    num_problems=512,
    eval_batch=128,
    max_new_tokens=0,  # the longest reference answer, in whole blocks
    block_size=4,
    gammas=FULL_GAMMAS,
    confidence_gammas=FULL_GAMMAS,
    factor_thresholds=FACTORS,
    code_max_files=0,
    code_prompts=64,
    code_prompt_len=128,
    code_new_tokens=48,
    loss_rows=64,
    loss_problems=256,
    wall_problems=16,
    wall_batch=1,
    wall_repeats=3,
    wall_min_s=0.5,
    forward_ns=FORWARD_NS,
    forward_repeats=15,
    sbd=CPU_SBD,
    optim=CPU_OPTIM,
  ),
  "gpu": Size(
    model=dict(
      num_layers=8,
      embed_dim=512,
      num_heads=8,
      num_kv_heads=4,
      head_dim=64,
      mlp_dim=1536,
      attention_chunk=256,
    ),
    steps=12000,
    batch_size=32,
    seq_len=256,
    code_steps=6000,
    code_batch_size=32,
    code_seq_len=512,
    lr=1e-3,
    warmup_steps=300,
    num_problems=512,
    eval_batch=128,
    max_new_tokens=0,  # the longest reference answer, in whole blocks
    block_size=16,
    gammas=FULL_GAMMAS,
    confidence_gammas=FULL_GAMMAS,
    factor_thresholds=FACTORS,
    code_max_files=0,
    code_prompts=128,
    code_prompt_len=128,
    code_new_tokens=48,
    loss_rows=256,
    loss_problems=1024,
    wall_problems=64,
    wall_batch=1,
    wall_repeats=5,
    wall_min_s=0.5,
    forward_ns=FORWARD_NS,
    forward_repeats=30,
  ),
}

# configs/paper_small.py: the 8B configs' recipe (k ~ U{2..16} decoded in blocks of 16, per-token
# masking, equal weights, row-tiled blocks) after an NTP phase, on configs/tiny.py's model and
# data in rows of 192 tokens (a problem and its 15-token EOS tail).
PAPER_SBD = dict(
  k_min=2,
  k_max=16,
  block_anchor="row",
  full_block_prob=0.0,
  matp_weight=1.0,
  ntp_fraction=0.3,
)
SIZES["paper_small"] = dataclasses.replace(
  SIZES["cpu"],
  model=dict(attention_chunk=192),
  steps=6000,
  seq_len=192,
  block_size=16,
  sbd=PAPER_SBD,
)


def sweep_values(size: Size, rule: str) -> tuple[float, ...]:
  """The γ (or f) values swept for `rule`."""
  return {
    "eb_entropy": size.gammas,
    "eb_confidence": size.confidence_gammas,
    "factor": size.factor_thresholds,
  }[rule]
