"""A decode's results on the host, one entry per prompt (`DecodeOutput`), gathered call by
call from the compiled program's `compiled.BatchResult`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from sbd_jax.decode import acceptance as acceptance_lib
from sbd_jax.decode import costs
from sbd_jax.decode.compiled import BatchResult
from sbd_jax.decode.settings import SamplerSettings


@dataclasses.dataclass
class DecodeOutput:
  """Host-side results, one entry per prompt (tokens after EOS dropped; EOS kept in tokens)."""

  tokens: list[list[int]]
  reveal_step: list[list[int]]
  nfe: np.ndarray  # [num_prompts] int
  finished: np.ndarray  # [num_prompts] bool: an EOS was produced
  texts: list[str] | None = None
  # [num_prompts] int: forwards run by the batch each prompt was decoded in (>= its NFE), and
  # of them the 2P-token SBD forwards after the prefill. With refill: those its row ran while
  # holding it (`queue.decode_queue`).
  batch_forwards: np.ndarray | None = None
  batch_wide_forwards: np.ndarray | None = None
  batch_ntp_forwards: np.ndarray | None = None  # of them, verified SBD's NTP one-token forwards
  rollbacks: np.ndarray | None = None  # [num_prompts] int: verified SBD's rejected drafts
  # Verified SBD's drafts as speculative decoding reports them (`state.Acceptance`), per prompt:
  # checks of a draft, drafted and accepted tokens, and accepted tokens by position in the
  # draft ([num_prompts, block_size - 1]). Zero for NTP and plain SBD.
  drafts: np.ndarray | None = None
  draft_tokens: np.ndarray | None = None
  accepted_tokens: np.ndarray | None = None
  accepted_by_position: np.ndarray | None = None
  # Calls of a verified decode that ran NTP's own program, its drafts not paying
  # (`acceptance_prior.Prior.verifies_next`): the same text, NTP's forwards.
  ntp_calls: int = 0
  forwards: int = 0  # every forward run, prefills included
  wide_forwards: int = 0  # of them, SBD's 2P-token forwards after a prefill
  ntp_forwards: int = 0  # of them, verified SBD's NTP one-token forwards
  prefills: int = 0  # of them, prompt forwards: one per batch, or one per prompt with refill
  # What the forwards of a verified decode that chose them cost (`decode.costs`): the table of
  # its (first) program, None where nothing was chosen.
  cost_table: costs.CostTable | None = None
  # [num_prompts, K]: the forwards of the call that decoded each prompt, by kind (NTP's
  # one-token forwards, then each draft width's wide forwards: `costs.kind_names`).
  batch_kind_forwards: np.ndarray | None = None
  # Constrained decodes (`settings.constraint`), per prompt: tokens settled where the automaton
  # allowed one token only, and whether the text is complete (the automaton accepts it; a text
  # that reached its token limit first is not). None where unconstrained.
  forced_tokens: np.ndarray | None = None
  complete: np.ndarray | None = None

  def acceptance(self, prompts: Sequence[int] | None = None) -> dict[str, Any] | None:
    """The verified drafts of `prompts` (indices; default all), summed and summarised as vLLM
    reports speculative decoding (`acceptance.summary`); None without drafts."""
    picked = slice(None) if prompts is None else list(prompts)
    return acceptance_lib.summary(
      int(self.drafts[picked].sum()),
      int(self.draft_tokens[picked].sum()),
      int(self.accepted_tokens[picked].sum()),
      self.accepted_by_position[picked].sum(axis=0),
    )

  def draft_counts(self, prompt: int) -> dict[str, Any]:
    """Prompt `prompt`'s verified drafts as record fields (`evals.results`), and its rejected
    ones (0 where the output holds no counts)."""
    if self.drafts is None:
      return dict(rollbacks=0, drafts=0, draft_tokens=0, accepted_tokens=0, accepted_by_position=[])
    return {
      "rollbacks": int(self.rollbacks[prompt]),
      "drafts": int(self.drafts[prompt]),
      "draft_tokens": int(self.draft_tokens[prompt]),
      "accepted_tokens": int(self.accepted_tokens[prompt]),
      "accepted_by_position": [int(n) for n in self.accepted_by_position[prompt]],
    }


def empty(num_prompts: int, s: SamplerSettings) -> DecodeOutput:
  counts = lambda *shape: np.zeros((num_prompts, *shape), np.int64)  # noqa: E731
  return DecodeOutput(
    tokens=[],
    reveal_step=[],
    nfe=counts(),
    finished=np.zeros(num_prompts, bool),
    batch_forwards=counts(),
    batch_wide_forwards=counts(),
    batch_ntp_forwards=counts(),
    rollbacks=counts(),
    drafts=counts(),
    draft_tokens=counts(),
    accepted_tokens=counts(),
    accepted_by_position=counts(max(s.block_size - 1, 0)),
    batch_kind_forwards=counts(1 + len(s.draft_widths)),
    forced_tokens=counts() if s.constrained else None,
    complete=np.zeros(num_prompts, bool) if s.constrained else None,
  )


def record(out: DecodeOutput, got: BatchResult, first: int, count: int, s: SamplerSettings):
  """Append prompts [first, first + count)'s results, rows [0, count) of `got`, to `out`."""
  out.batch_forwards[first : first + count] = got.row_forwards_B[:count]
  out.batch_wide_forwards[first : first + count] = got.row_wide_forwards_B[:count]
  out.batch_ntp_forwards[first : first + count] = got.row_ntp_forwards_B[:count]
  out.batch_kind_forwards[first : first + count] = got.kind_forwards
  if s.constrained:
    out.forced_tokens[first : first + count] = got.forced_B[:count]
    out.complete[first : first + count] = got.complete_B[:count]
  out.rollbacks[first : first + count] = got.rollbacks_B[:count]
  a = got.acceptance
  out.drafts[first : first + count] = a.drafts_B[:count]
  out.draft_tokens[first : first + count] = a.draft_tokens_B[:count]
  out.accepted_tokens[first : first + count] = a.accepted_B[:count]
  p = out.accepted_by_position.shape[1]
  out.accepted_by_position[first : first + count] = a.accepted_at_BP[:count, :p]
  out.forwards += got.forwards
  out.wide_forwards += got.wide_forwards
  out.ntp_forwards += got.ntp_forwards
  out.prefills += got.prefills
  for i in range(count):
    n = int(got.length_B[i])
    out.tokens.append([int(t) for t in got.tokens_BR[i, :n]])
    out.reveal_step.append([int(t) for t in got.reveal_step_BR[i, :n]])
    out.nfe[first + i] = got.nfe_B[i]
    out.finished[first + i] = n > 0 and got.tokens_BR[i, n - 1] == s.eos_id
