"""Decode settings: one frozen, hashable dataclass per compiled decode, and the only place where
sampling options and their defaults are declared.

A run's config holds them in its `sample` group (`sample_config`, with the evaluation's own
fields beside them); `from_config` builds the settings a decode of that run uses, with
overrides (CLI flags) validated like every other value. `max_new_tokens = 0` in a config means
"automatic": a task's own budget, else `SamplerSettings`' default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from sbd_jax.constrain.spec import Constraint
from sbd_jax.sbd import reveal_rules

MODES = ("sbd", "ntp")
# What a verified row drafts after each forward: every masked position of its block, the
# positions the reveal rule picks, or none (`SamplerSettings.draft`).
DRAFTS = ("all", "rule", "none")
# The temperature a sampled decode's static settings hold (each row's own is traced).
TRACED_TEMPERATURE = 1.0
# The constraint a constrained decode's static settings hold: the automaton's tables are traced
# (`decode.constrained`), so one compilation serves every constraint of the same table sizes.
TRACED_CONSTRAINT = Constraint.regex("(?s:.*)")


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """Hashable decode settings: one compilation per (settings, bucket, batch size). `gamma`
  alone enters the compiled loop as a traced value, so a γ sweep compiles once."""

  eos_id: int  # -1: no EOS, every row decodes max_new_tokens (for timing)
  mask_id: int
  pad_id: int
  mode: str = "sbd"  # "sbd" (set block decoding) or "ntp" (next-token baseline)
  block_size: int = 16  # P, SBD only
  rule: str = "eb_entropy"  # a name in reveal_rules.RULES, SBD only
  # The rule's parameter (`reveal_rules`): γ of the EB and threshold rules, f of the factor
  # rule, τ of confidence_threshold; 0 = one token per forward (except confidence_threshold).
  gamma: float = 0.35
  temperature: float = 0.0  # 0 = argmax; > 0 samples softmax(logits / temperature)
  max_new_tokens: int = 256  # new tokens per prompt (SBD: rounded up to whole blocks inside)
  # SBD: check every drafted token against NTP's own choice, computed by the causal half of the
  # next wide forward, and keep NTP's token at the first disagreement (`decode.verify`): the
  # text is NTP's, token for token; γ and the rule only change how many forwards it takes. On
  # by default: it keeps NTP's accuracy where plain SBD loses points, for a few percent of the
  # speedup where plain SBD loses none (BENCHMARKS.md, every rule side by side).
  verify: bool = True
  # Verified SBD: every forward carries the tokens revealed since the last check (a run after
  # the row's newest verified token) as causal queries beside the block, checks them, and the
  # block slides to start after them (`decode.verify`): a wrong draft costs one forward, and
  # every forward settles at least one token. False: a block's draft is checked by the next
  # block's first forward only.
  check_every_forward: bool = True
  # Verified SBD: "all" drafts every masked position of a row's block at each forward (a
  # wrong draft costs at most the forward that checks it, and NTP keeps the text; measured the
  # fastest or within a few percent of it on every model in BENCHMARKS.md), "rule" only the
  # positions the reveal rule picks at γ, as plain SBD reveals them. "none" drafts nothing:
  # NTP's decode at the verified decode's forward shapes, one token per forward, which a
  # verified decode without pauses equals token for token in bfloat16 too (docs/decoding.md).
  draft: str = "all"
  # Verified SBD checked at every forward: each forward is chosen by expected tokens per second
  # (`decode.policy`): NTP's one-token forward, or a wide forward drafting a block of one of a
  # few widths (`draft_widths`), from each row's estimate of its acceptance (started from what
  # earlier rows of the model accepted) and what each forward costs on the device decoding
  # (`wide_cost`); a row drafting its whole block whose checks accept long runs drafts only
  # what it is sure of. False: every forward is the widest, the block of `block_size`.
  adaptive: bool = True
  # Verified SBD, adaptive: what its forwards cost. 0 (the default): measured on the device that
  # decodes, for the compiled program's batch size (`decode.costs`). A value >= 1 instead says
  # a wide forward of a whole block (2P tokens a row) costs that many one-token forwards, and a
  # narrower one in proportion to its tokens (1: nothing is measured, every forward costs the
  # same, as on an accelerator's memory-bound decode at small batches).
  wide_cost: float = 0.0
  # SBD: when the rule reveals an EOS, also reveal the first position of the run of EOS
  # predictions that reaches it, so that the positions past the answer settle in one forward
  # (`decode.reveal`).
  settle_eos: bool = True
  # SBD batches. True: the batch moves to its next block only when every row has completed
  # the current one. False: each row moves on alone (module docstring).
  lockstep: bool = False
  # Batches of a decode queue (`queue.decode_queue`): True, a finished row takes the next prompt at
  # once (continuous batching); False, each batch decodes until its last row is done.
  refill: bool = False
  # With refill: how many finished rows are refilled together, in one prefill forward. A refill
  # waits until that many rows are done (fewer at the end of the queue).
  refill_rows: int = 1
  # Keep each revealed token's log-probability (`DecodeState.logprob_BR`): what the server's
  # pools do, for `logprobs`. Off, the decode spends nothing on it (the field stays 0).
  logprobs: bool = False
  # What every answer must be (`sbd_jax.constrain`: a regex, a JSON schema, any JSON object, a
  # choice among strings): each choice of NTP, draft and reveal is masked to the tokens the
  # constraint's automaton allows there (`decode.constrained`); verified, the text is
  # constrained NTP's, token for token. None: unconstrained.
  constraint: Constraint | None = None
  # Constrained verified SBD: drafts are masked too, so a position that allows one token drafts
  # it (a forced token) and the next check settles it without the model's say. False: drafts
  # as if unconstrained, only NTP's choices masked (to measure what forced tokens save).
  forced_tokens: bool = True

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown decode mode {self.mode!r}; choose one of {MODES}")
    if self.block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {self.block_size}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.lockstep not in (True, False):
      raise ValueError(f"lockstep must be True or False, got {self.lockstep!r}")
    if self.refill not in (True, False):
      raise ValueError(f"refill must be True or False, got {self.refill!r}")
    if self.refill_rows < 1:
      raise ValueError(f"refill_rows must be >= 1, got {self.refill_rows}")
    if self.refill_rows != 1 and not self.refill:
      raise ValueError(
        f"refill_rows={self.refill_rows} applies to refill: set refill=True (--refill)"
      )
    if self.refill and self.lockstep:
      raise ValueError("refill needs rows that move alone: set lockstep=False")
    if self.constraint is not None and not isinstance(self.constraint, Constraint):
      raise ValueError(f"constraint must be a constrain.spec.Constraint, got {self.constraint!r}")
    names = ("verify", "check_every_forward", "adaptive", "settle_eos", "logprobs")
    for name in (*names, "forced_tokens"):
      if getattr(self, name) not in (True, False):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    if self.draft not in DRAFTS:
      raise ValueError(f"unknown draft {self.draft!r}; choose one of {DRAFTS}")
    if not (self.wide_cost == 0 or self.wide_cost >= 1):  # NaN too
      raise ValueError(
        f"wide_cost must be 0 (measured) or >= 1, got {self.wide_cost} (a wide forward's cost "
        "in one-token forwards)"
      )
    if self.verify and self.lockstep:
      raise ValueError(
        "verify rolls rows back alone: set lockstep=False, or verify=False (--noverify)"
      )
    reveal_rules.check_gamma(self.rule, self.gamma)
    if self.mask_id in (self.eos_id, self.pad_id):
      raise ValueError(f"mask_id {self.mask_id} must differ from eos_id and pad_id")

  @property
  def verified(self) -> bool:
    """SBD checked against NTP (`verify`; NTP itself needs no check)."""
    return self.mode == "sbd" and self.verify

  @property
  def constrained(self) -> bool:
    """Whether the decode masks its choices by a constraint's automaton."""
    return self.constraint is not None

  @property
  def chooses_forwards(self) -> bool:
    """Whether a verified decode chooses each forward (`adaptive`, `decode.policy`): NTP's
    one-token forward or a wide forward of one of `draft_widths`. Only where every forward
    checks (`check_every_forward`)."""
    return self.verified and self.check_every_forward and self.adaptive

  @property
  def draft_widths(self) -> tuple[int, ...]:
    """The block widths D a verified decode's wide forwards draft (2D tokens a row), narrowest
    first: the block, and where forwards are chosen its half and quarter (at least 2). On a
    compute-bound device a narrower forward costs less, and where drafts are accepted in short
    runs it settles nearly as many tokens."""
    p = self.block_size
    if not self.chooses_forwards:
      return (p,)
    return tuple(sorted({p, *(w for w in (p // 2, p // 4) if w >= 2)}))

  @property
  def response_slots(self) -> int:
    """R: generated-token slots: max_new_tokens, rounded up to whole blocks for SBD; verified
    blocks start anywhere, so one more block."""
    if self.mode == "ntp":
      return self.max_new_tokens
    blocks = -(-self.max_new_tokens // self.block_size) + int(self.verified)
    return blocks * self.block_size

  def rows_move_alone(self, rows: int) -> bool:
    """Whether the rows of a `rows`-row batch move through their SBD blocks alone (with refill
    even one row does: its prompts start at their own offsets; verified rows always do)."""
    if self.mode != "sbd" or self.lockstep:
      return False
    return rows > 1 or self.refill or self.verify

  def cache_slots(self, bucket: int, rows: int) -> int:
    """KV-cache slots a decode of `rows` rows needs after a prompt bucket of `bucket` slots:
    the response slots, plus one block where rows may move alone (a row that does not start a
    block in a wide forward writes P placeholders after its block)."""
    spare = self.block_size if self.rows_move_alone(rows) else 0
    return bucket + self.response_slots + spare

  def with_traced_values(self) -> "SamplerSettings":
    """The settings a compiled decode is keyed by: γ and the temperature enter it as traced
    values (one compilation serves every γ, and every temperature of a sampled decode), so
    this copy holds fixed ones: a γ every rule accepts, whether the decode samples, and
    whether it is constrained (the automaton's tables are traced too)."""
    return dataclasses.replace(
      self,
      gamma=reveal_rules.TRACED_GAMMA,
      temperature=TRACED_TEMPERATURE if self.temperature > 0 else 0.0,
      constraint=TRACED_CONSTRAINT if self.constrained else None,
    )

  @property
  def label(self) -> str:
    """How results name this decoding (`decoding_name`), or `ntp`."""
    if self.mode == "ntp":
      return "ntp"
    name = decoding_name(self.rule, self.gamma, verified=self.verified)
    if self.verified and self.draft != "rule":  # the rule and γ do not enter
      name = "sbd verified" + (", no drafts" if self.draft == "none" else "")
    return name + ("" if self.check_every_forward or not self.verified else " checked per block")

  def replace(self, **changes: Any) -> "SamplerSettings":
    return dataclasses.replace(self, **changes)


def decoding_name(
  rule: str, gamma: float, block_size: int | None = None, verified: bool = False
) -> str:
  """`sbd eb_entropy γ=0.35`; with `block_size`, `sbd eb_entropy γ=0.35 k=4`; checked against
  NTP (`SamplerSettings.verify`), `sbd eb_entropy γ=0.35 verified`."""
  name = f"sbd {rule} γ={gamma:g}" + (f" k={block_size}" if block_size else "")
  return name + (" verified" if verified else "")


# The `SamplerSettings` fields a run's config sets (the token ids come from its tokenizer).
CONFIG_FIELDS = (
  "block_size",
  "rule",
  "gamma",
  "temperature",
  "max_new_tokens",
  "lockstep",
  "refill",
  "refill_rows",
  "verify",
  "check_every_forward",
  "draft",
  "adaptive",
  "wide_cost",
  "settle_eos",
)


def sample_config() -> ml_collections.ConfigDict:
  """A run config's `sample` group: the decode defaults of `SamplerSettings`, except
  `max_new_tokens` = 0 (automatic), and what an evaluation of the run decodes."""
  defaults = {f.name: f.default for f in dataclasses.fields(SamplerSettings)}
  c = ml_collections.ConfigDict({name: defaults[name] for name in CONFIG_FIELDS})
  c.max_new_tokens = 0  # 0: a task's own budget (the built-in task: its longest answer)
  c.gammas = (0.1, 0.35)  # γ values an evaluation sweeps (the paper's reasoning γ_low, γ_high)
  c.num_problems = 512  # held-out problems decoded at the end of the main job; 0 = none
  c.batch_size = 64  # rows per decode batch
  # (data, fsdp, tensor) mesh of the decodes; () = weights tensor-parallel over each host's
  # chips, rows over the rest (`sharding.decoding_mesh`). The training mesh is `mesh`.
  c.mesh_shape = ()
  return c


def from_config(
  sample_cfg: ml_collections.ConfigDict,
  tokenizer,
  mask_id: int,
  *,
  budget: int = 0,
  **overrides: Any,
) -> SamplerSettings:
  """The settings a decode of a run uses: its config's `sample` fields, then `overrides` that
  are not None (a CLI flag that was not given), validated as `SamplerSettings` validates.
  A `max_new_tokens` of 0 (configured or overridden) becomes `budget`, or the default."""
  unknown = sorted(set(overrides) - set(CONFIG_FIELDS) - {"mode", "constraint", "forced_tokens"})
  if unknown:
    raise ValueError(f"unknown sampling settings {unknown}; known: {list(CONFIG_FIELDS)}")
  defaults = {f.name: f.default for f in dataclasses.fields(SamplerSettings)}
  # A run saved before a field existed decodes with the field's default.
  fields = {name: sample_cfg.get(name, defaults[name]) for name in CONFIG_FIELDS}
  if "ntp_above_rows" in sample_cfg and fields["wide_cost"] == 1.0:
    # Saved before costs were measured (the batch switch `ntp_above_rows` went with that), when
    # 1 was `wide_cost`'s default and nothing was measured: the run's forwards are measured.
    fields["wide_cost"] = defaults["wide_cost"]
  fields.update({k: v for k, v in overrides.items() if v is not None})
  if fields["max_new_tokens"] == 0:
    fields["max_new_tokens"] = budget or SamplerSettings.max_new_tokens
  return settings_for(tokenizer, mask_id, **fields)


def check_block_size(config: ml_collections.ConfigDict, block_size: int | None) -> None:
  """A one-line ValueError for an SBD block larger than the run trained on (`sbd.k_max`):
  the model has never filled one, and decodes garbage. `block_size` None: the run's own."""
  block = config.sample.block_size if block_size is None else block_size
  if config.sbd.mode != "ntp" and block > config.sbd.k_max:
    raise ValueError(
      f"block_size {block} exceeds the largest block the model was trained on "
      f"(sbd.k_max = {config.sbd.k_max})"
    )


def settings_for(tokenizer, mask_id: int, **overrides: Any) -> SamplerSettings:
  """SamplerSettings with the tokenizer's EOS / pad ids and the run's mask id."""
  return SamplerSettings(
    eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, mask_id=mask_id, **overrides
  )
