"""The `logprobs` of a response, in OpenAI's two shapes, from (token text, log-probability,
text offset) entries (`text_stream.TextStream.take_sent`).

Each generated token's log-probability in the distribution it was chosen from (with the
request's temperature); under verified SBD, NTP's (the text is NTP's). Only the chosen tokens,
no top alternatives: the decode keeps one log-probability per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Entry = tuple[str, float, int]


def _number(x: float) -> float | None:
  return x if math.isfinite(x) else None


def completion(entries: Sequence[Entry]) -> dict:
  """/v1/completions' `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
  return {
    "tokens": [t for t, _, _ in entries],
    "token_logprobs": [_number(lp) for _, lp, _ in entries],
    "top_logprobs": None,
    "text_offset": [offset for _, _, offset in entries],
  }


def chat(entries: Sequence[Entry]) -> dict:
  """/v1/chat/completions' `logprobs`: content, a list of {token, logprob, bytes,
  top_logprobs}."""
  return {
    "content": [
      {"token": t, "logprob": _number(lp), "bytes": list(t.encode()), "top_logprobs": []}
      for t, lp, _ in entries
    ]
  }
