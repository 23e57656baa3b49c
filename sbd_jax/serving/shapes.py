"""OpenAI's shapes of what the server answers: an error (for every status), a whole response,
a stream's chunks as server-sent events, `usage` and `logprobs`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from starlette import responses

from sbd_jax.serving import logprobs as logprobs_lib
from sbd_jax.serving import requests as requests_lib

RETRY_AFTER_S = 1  # what a 503 asks the client to wait
NOT_RETRIED = (500, 504)  # statuses whose request a retry would only repeat

# Engine outcomes that are not answers: (status, message, error type).
FAILED = {
  "error": (500, "the decode failed: see the server's log", "server_error"),
  "shutdown": (503, "the server shut down before the request finished", "server_unavailable"),
  "timeout": (504, "the request did not finish within the server's --request_timeout", "timeout"),
}


def error(
  status: int,
  message: str,
  kind: str = "invalid_request_error",
  *,
  param: str | None = None,
  code: str | None = None,
) -> responses.Response:
  """{"error": {"message", "type", "param", "code"}}. A 503 (queue full, draining) carries
  Retry-After; a 500 (a failed decode) and a 504 (--request_timeout) carry `x-should-retry:
  false`, which OpenAI's clients obey: retrying them would only repeat the work. The body is
  ASCII JSON: text a message quotes from a request (a lone surrogate too) always encodes."""
  body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
  headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
  if status in NOT_RETRIED:
    headers = {"x-should-retry": "false"}
  return responses.Response(
    json.dumps(body), status_code=status, headers=headers, media_type="application/json"
  )


def error_event(status: int, message: str, kind: str) -> dict:
  """A stream's error: the event that ends it in place of a finish reason."""
  return {"error": {"message": message, "type": kind, "param": None, "code": status}}


@dataclasses.dataclass
class Usage:
  """A request's usage, its choices summed: tokens, forwards, and verified SBD's drafts."""

  prompt_tokens: int
  completion_tokens: int = 0
  forwards: int = 0
  rollbacks: int = 0
  drafts: int = 0
  draft_tokens: int = 0
  accepted_tokens: int = 0
  accepted_by_position: list[int] = dataclasses.field(default_factory=list)
  constrained: bool = False  # structured output: report `forced_tokens`
  forced_tokens: int = 0

  def add(self, finished: requests_lib.Finished) -> None:
    self.completion_tokens += finished.tokens
    self.forced_tokens += finished.forced_tokens
    self.forwards += finished.forwards
    self.rollbacks += finished.rollbacks
    self.drafts += finished.drafts
    self.draft_tokens += finished.draft_tokens
    self.accepted_tokens += finished.accepted_tokens
    by_position = list(finished.accepted_by_position)
    if len(by_position) > len(self.accepted_by_position):
      self.accepted_by_position += [0] * (len(by_position) - len(self.accepted_by_position))
    for i, n in enumerate(by_position):
      self.accepted_by_position[i] += n

  def dict(self) -> dict[str, Any]:
    """OpenAI's usage and SBD's forwards; where verification checked drafts, their numbers as
    vLLM names its spec-decode metrics (`spec_decode`), and the accepted and rejected drafted
    tokens in OpenAI's `completion_tokens_details` (its predicted outputs' fields)."""
    out = {
      "prompt_tokens": self.prompt_tokens,
      "completion_tokens": self.completion_tokens,
      "total_tokens": self.prompt_tokens + self.completion_tokens,
      "forwards": self.forwards,
      "rollbacks": self.rollbacks,
    }
    if self.constrained:  # tokens its automata allowed alone, settled without the model's say
      out["forced_tokens"] = self.forced_tokens
    if self.drafts:
      out["completion_tokens_details"] = {
        "accepted_prediction_tokens": self.accepted_tokens,
        "rejected_prediction_tokens": self.draft_tokens - self.accepted_tokens,
      }
      out["spec_decode"] = {
        "num_drafts": self.drafts,
        "num_draft_tokens": self.draft_tokens,
        "num_accepted_tokens": self.accepted_tokens,
        "num_accepted_tokens_per_pos": list(self.accepted_by_position),
        "mean_acceptance_length": 1 + self.accepted_tokens / self.drafts,
      }
    return out


def logprobs(chat: bool, entries) -> dict:
  return logprobs_lib.chat(entries) if chat else logprobs_lib.completion(entries)


def whole(
  meta: dict, chat: bool, texts: list[str], reasons: list, usage: Usage, scores=None, notes=None
):
  """A non-streamed response: every choice's text (and `logprobs`, given `scores`; a
  constrained choice's `structured_output`, given `notes`), or the error of one that failed."""
  for reason, (status, message, kind) in FAILED.items():
    if reason in reasons:
      return error(status, message, kind)
  choices = []
  for i, (text, reason) in enumerate(zip(texts, reasons)):
    score = scores[i] if scores else None
    if chat:
      message = {"role": "assistant", "content": text}
      choice = {"index": i, "message": message, "logprobs": score, "finish_reason": reason}
    else:
      choice = {"index": i, "text": text, "logprobs": score, "finish_reason": reason}
    choices.append(_noted(choice, notes[i] if notes else None))
  kind = "chat.completion" if chat else "text_completion"
  return {**meta, "object": kind, "choices": choices, "usage": usage.dict()}


def chunk(meta, chat: bool, index: int, delta, reason, logprobs=None, note=None, role=False):
  """A stream's chunk of one choice (`note`: a constrained choice's `structured_output`, with
  its finish reason)."""
  if chat:
    content = {"role": "assistant", "content": ""} if role else {"content": delta or ""}
    choice = {"index": index, "delta": content if role or delta else {}, "finish_reason": reason}
    if logprobs is not None:
      choice["logprobs"] = logprobs
    return {**meta, "object": "chat.completion.chunk", "choices": [_noted(choice, note)]}
  choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
  return {**meta, "object": "text_completion", "choices": [_noted(choice, note)]}


def _noted(choice: dict, note: dict | None) -> dict:
  """A choice with a constrained one's `structured_output` ({"complete": bool})."""
  return choice if note is None else {**choice, "structured_output": note}


def sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"
