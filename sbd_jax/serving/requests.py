"""What the engine serves: a request (one prompt with its row's settings and a callback for
its events), its tokens as they settle (`Tokens`), how it ends (`Finished`), and the two
refusals of a request the engine cannot take.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from sbd_jax.constrain.automaton import TokenAutomaton
from sbd_jax.constrain.spec import Constraint
from sbd_jax.decode.settings import SamplerSettings


class QueueFull(RuntimeError):
  """The bounded queue of waiting requests is full."""


class ShuttingDown(RuntimeError):
  """The server no longer admits requests."""


class Tokens(list):
  """Token ids that settled, in order (a list), with `logprobs`: each one's log-probability
  (`DecodeState.logprob_BR`), and `forwards`: the forwards its row had run when it settled
  (`slots.Slots.settled_at_BR`)."""

  def __init__(self, ids, logprobs=(), forwards=()):
    super().__init__(ids)
    self.logprobs = list(logprobs)
    self.forwards = list(forwards)


@dataclasses.dataclass(frozen=True)
class Finished:
  """A request's last event: why it ended and what it cost."""

  # "stop" (EOS), "length" (its max_tokens), "cancelled" (the client left, a stop string),
  # "timeout" (not done within the server's request timeout),
  # "shutdown" (not done at the server's drain deadline), "error" (its decode failed)
  reason: str
  tokens: int  # generated tokens, its EOS excluded
  forwards: int  # the forwards its row ran for it (its NFE), the prefill included
  rollbacks: int = 0  # verified SBD: its drafts that verification rejected
  # Verified SBD, as vLLM counts speculative decoding: the drafts checked, their tokens, those
  # accepted, and those accepted by position in the draft (`decode.acceptance`).
  drafts: int = 0
  draft_tokens: int = 0
  accepted_tokens: int = 0
  accepted_by_position: tuple[int, ...] = ()
  # Constrained requests (`Request.constraint`): whether its automaton accepts the tokens it
  # generated (None: unconstrained), and how many of them were forced (`DecodeState.forced_B`).
  complete: bool | None = None
  forced_tokens: int = 0


@dataclasses.dataclass(eq=False)
class Request:
  """One prompt to decode. `settings` holds the compiled fields (mode, block size, rule); `gamma`,
  `max_tokens`, `temperature`, `verify`, the constraint and the key (`seed`, and `index`, the
  prompt's place in its request) are the row's own, as in `sample`. `emit` receives lists of
  new token ids (EOS excluded), then a `Finished`."""

  prompt_ids: list[int]
  settings: SamplerSettings
  gamma: float
  max_tokens: int
  seed: int
  emit: Callable[[Any], None]
  index: int = 0
  temperature: float = 0.0  # 0: greedy; read when `settings` sample (`TRACED_TEMPERATURE`)
  verify: bool = False  # SBD: drafts checked against NTP, read when `settings.verified`
  # What its text must be (None: anything), with its automaton over the model's vocabulary,
  # decoded in a pool whose settings are constrained (`SamplerSettings.constrained`).
  constraint: Constraint | None = None
  automaton: TokenAutomaton | None = None
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
  cancel_reason: str = "cancelled"

  def cancel(self, reason: str = "cancelled") -> None:
    """Stop decoding (a client that left, a stop string seen, the drain deadline); its row is
    freed at the next pass and it finishes with `reason`."""
    if not self.cancelled.is_set():
      self.cancel_reason = reason
    self.cancelled.set()
