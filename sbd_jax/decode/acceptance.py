"""Verified SBD's drafts counted as serving stacks count speculative decoding's (vLLM's
spec-decode metrics): per row on device (`Acceptance`), summarised on the host (`summary`).

A draft is the drafted tokens one check compares with NTP's choices (`verify.check_drafts`):
the unverified tokens of the run a forward carries as causal queries. Its tokens are accepted
up to the first that differs from NTP's. Dimension letters (docs/dimensions.md): B batch,
P block positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Acceptance:
  """Per row: the drafts checked, their tokens, and those accepted (in total and by position)."""

  drafts_B: jax.Array  # checks that compared at least one drafted token
  draft_tokens_B: jax.Array  # drafted tokens compared
  accepted_B: jax.Array  # of them, accepted
  # Accepted tokens by their position in the draft (0: the first token after the verified one
  # that starts the checked run). A draft holds at most P - 1 tokens: the last column stays 0.
  accepted_at_BP: jax.Array

  @classmethod
  def zeros(cls, rows: int, block_size: int) -> "Acceptance":
    zeros_B = jnp.zeros((rows,), jnp.int32)
    return cls(zeros_B, zeros_B, zeros_B, jnp.zeros((rows, block_size), jnp.int32))

  def add(self, drafted_BT: jax.Array, accepted_BT: jax.Array) -> "Acceptance":
    """These counts plus one check's: [B, T] bools, T <= P draft positions."""
    pad = ((0, 0), (0, self.accepted_at_BP.shape[1] - accepted_BT.shape[1]))
    return Acceptance(
      drafts_B=self.drafts_B + jnp.any(drafted_BT, axis=-1).astype(jnp.int32),
      draft_tokens_B=self.draft_tokens_B + jnp.sum(drafted_BT, axis=-1, dtype=jnp.int32),
      accepted_B=self.accepted_B + jnp.sum(accepted_BT, axis=-1, dtype=jnp.int32),
      accepted_at_BP=self.accepted_at_BP + jnp.pad(accepted_BT.astype(jnp.int32), pad),
    )


def summary(
  drafts: int, draft_tokens: int, accepted: int, accepted_by_position: Sequence[int]
) -> dict[str, Any] | None:
  """Counts summed over rows or requests, as vLLM reports them: the drafts, drafted and accepted
  tokens, the acceptance rate (accepted / drafted), the mean acceptance length (1 + accepted /
  drafts: the tokens a check settles, NTP's own included) and the acceptance rate by position
  in the draft (accepted there / drafts). None without drafts (NTP, plain SBD)."""
  if not drafts:
    return None
  return {
    "drafts": int(drafts),
    "draft_tokens": int(draft_tokens),
    "accepted_tokens": int(accepted),
    "acceptance_rate": accepted / max(draft_tokens, 1),
    "mean_acceptance_length": 1 + accepted / drafts,
    "acceptance_by_position": [float(n) / drafts for n in np.asarray(accepted_by_position)],
  }
