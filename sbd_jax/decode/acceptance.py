"""Verified SBD's drafts counted as serving stacks count speculative decoding's (vLLM's
spec-decode metrics): per row on device (`Acceptance`), summarised on the host (`summary`).

A draft is the drafted tokens one check compares with NTP's choices (`verify.check_drafts`):
the unverified tokens of the run a forward carries as causal queries. Its tokens are accepted
up to the first that differs from NTP's. Each token tried (accepted, or the first wrong one) is
also counted by its position in the block that drafted it (1 .. P - 1; position 0 is NTP's own
token): what `acceptance_prior.Prior` learns acceptance by position from. Dimension letters
(docs/dimensions.md): B batch, P block positions.
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
  """Per row: the drafts checked, their tokens, and those accepted (in total and by position);
  and the tokens tried and rejected by their position in the block that drafted them."""

  drafts_B: jax.Array  # checks that compared at least one drafted token
  draft_tokens_B: jax.Array  # drafted tokens compared
  accepted_B: jax.Array  # of them, accepted
  # Accepted tokens by their position in the draft (0: the first token after the verified one
  # that starts the checked run). A draft holds at most P - 1 tokens: the last column stays 0.
  accepted_at_BP: jax.Array
  # Tokens tried (accepted, or the first wrong one of a draft) and rejected, by their position
  # in the block that drafted them (column 0 stays 0: a block's first token is NTP's own)
  tried_in_block_BP: jax.Array
  rejected_in_block_BP: jax.Array

  @classmethod
  def zeros(cls, rows: int, block_size: int) -> "Acceptance":
    zeros_B, zeros_BP = jnp.zeros((rows,), jnp.int32), jnp.zeros((rows, block_size), jnp.int32)
    return cls(zeros_B, zeros_B, zeros_B, zeros_BP, zeros_BP, zeros_BP)

  def add(self, drafted_BT: jax.Array, accepted_BT: jax.Array, first_B: jax.Array) -> "Acceptance":
    """These counts plus one check's: [B, T] bools, T <= P draft positions, whose first token
    sits at block position `first_B` [B] (`policy.Estimates.next_at_B`)."""
    b, p = self.accepted_at_BP.shape
    t_T = jnp.arange(accepted_BT.shape[1])
    pad = ((0, 0), (0, p - accepted_BT.shape[1]))
    accepted_n_B = jnp.sum(accepted_BT, axis=-1, dtype=jnp.int32)
    rejected_BT = drafted_BT & (t_T == accepted_n_B[:, None])  # the first wrong token
    at_BTP = jax.nn.one_hot(jnp.minimum(first_B[:, None] + t_T, p - 1), p, dtype=jnp.int32)
    by_block = lambda x_BT: jnp.einsum("bt,btp->bp", x_BT.astype(jnp.int32), at_BTP)  # noqa: E731
    return Acceptance(
      drafts_B=self.drafts_B + jnp.any(drafted_BT, axis=-1).astype(jnp.int32),
      draft_tokens_B=self.draft_tokens_B + jnp.sum(drafted_BT, axis=-1, dtype=jnp.int32),
      accepted_B=self.accepted_B + accepted_n_B,
      accepted_at_BP=self.accepted_at_BP + jnp.pad(accepted_BT.astype(jnp.int32), pad),
      tried_in_block_BP=self.tried_in_block_BP + by_block(accepted_BT | rejected_BT),
      rejected_in_block_BP=self.rejected_in_block_BP + by_block(rejected_BT),
    )

  def packed(self) -> jax.Array:
    """int32 [B, 3 + 3P]: the counts as columns, for a decode's one transfer to the host."""
    per_row = jnp.stack([self.drafts_B, self.draft_tokens_B, self.accepted_B], axis=1)
    by_position = [self.accepted_at_BP, self.tried_in_block_BP, self.rejected_in_block_BP]
    return jnp.concatenate([per_row, *by_position], axis=1).astype(jnp.int32)

  @classmethod
  def unpacked(cls, packed_BX: np.ndarray) -> "Acceptance":
    """`packed`'s columns [B, 3 + 3P] as numpy leaves."""
    p = (packed_BX.shape[1] - 3) // 3
    by_position = [packed_BX[:, 3 + i * p : 3 + (i + 1) * p] for i in range(3)]
    return cls(packed_BX[:, 0], packed_BX[:, 1], packed_BX[:, 2], *by_position)


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
