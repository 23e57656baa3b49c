"""A choice's text as its tokens arrive, cut at stop strings and stop token ids, and the
log-probabilities of the tokens whose text has been sent.

Tokens are detokenized incrementally: each new token decodes a short window of the tokens before
it (from the start of the previous token's text, so that a tokenizer whose decoding of a token
depends on its left neighbour, a leading space for one, decodes it as in the whole text), and the
text grows only by complete characters. A response of n tokens costs O(n) decoding, not the
O(n^2) of decoding the whole text at every token; a server decodes it on its event loop.
"""

from __future__ import annotations

import bisect


class TextStream:
  """A choice's text as its tokens arrive: what may be sent so far, cut at the first stop
  string or before the first stop token id. Text that could still change (a partial UTF-8
  character, a possible start of a stop string) is held back until the next tokens settle it."""

  def __init__(self, tokenizer, stops: list[str], stop_ids=()):
    self.tokenizer, self.stops, self.stop_ids = tokenizer, stops, frozenset(stop_ids)
    self.ids: list[int] = []
    self.logprobs: list[float] = []  # of `ids`, when the tokens came with them
    self.text = ""  # the text of ids[:_read]: complete characters, final
    self._prefix = self._read = 0  # ids[_prefix:_read]: the window the next token decodes after
    self._ends: list[int] = []  # per token: len(text) once it was read (where its text ends)
    self.sent = ""
    self.stopped = False
    self._reported = 0  # tokens whose log-probabilities `take_sent` has returned
    self._reported_chars = 0
    # Once stopped: the tokens the choice generated, as OpenAI counts them: through the token
    # that completes the stop string, or those before the stop token id (as an EOS, not counted).
    self.kept_tokens: int | None = None

  def add(self, ids: list[int]) -> str:
    """The text that may be sent now, given the next tokens (`requests.Tokens` bring their
    log-probabilities)."""
    logprobs = list(getattr(ids, "logprobs", ())) or [float("nan")] * len(ids)
    cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
    if cut is not None:  # the text ends before the stop token, as at an EOS
      delta = self._add(list(ids[:cut]), logprobs[:cut])  # (a stop string there ends it first)
      if not self.stopped:
        delta += self.finish()
        self.stopped, self.kept_tokens = True, len(self.ids)
      return delta
    return self._add(list(ids), logprobs)

  def take_sent(self) -> list[tuple[str, float, int]]:
    """(token text, log-probability, its offset in the text) of the tokens whose text has been
    sent since the last call; a token whose text is cut by a stop string is not. Tokens that
    each hold part of one character are reported with the token that completes it (the
    others with empty text)."""
    out = []
    while self._reported < self._read and self._ends[self._reported] <= len(self.sent):
      i, start = self._reported, self._reported_chars
      out.append((self.text[start : self._ends[i]], self.logprobs[i], start))
      self._reported, self._reported_chars = i + 1, self._ends[i]
    return out

  def _read_new_tokens(self) -> None:
    """Extend `text` over the tokens added since the last call, one token at a time."""
    decode = self.tokenizer.decode
    for n in range(len(self._ends), len(self.ids)):
      before = decode(self.ids[self._prefix : self._read])
      after = decode(self.ids[self._prefix : n + 1])
      if len(after) > len(before) and not after.endswith("\ufffd"):
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, n + 1
      self._ends.append(len(self.text))  # a token in a character's middle: the text so far

  def _add(self, ids: list[int], logprobs: list[float]) -> str:
    self.ids += ids
    self.logprobs += logprobs
    self._read_new_tokens()
    text = self.text
    # A stop string starts after the text already sent (which never ends in a stop's prefix);
    # searching from there keeps the matching linear in the text's length.
    start = max(0, len(self.sent) - max((len(s) for s in self.stops), default=0))
    hits = [(i, len(s)) for i, s in ((text.find(s, start), s) for s in self.stops) if i >= 0]
    if hits:
      at, length = min(hits)
      # The fewest tokens whose text holds the whole stop string.
      self.stopped = True
      self.kept_tokens = bisect.bisect_left(self._ends, at + length) + 1
      return self._send(text[:at])
    safe = len(text)
    for stop in self.stops:
      for k in range(min(len(stop) - 1, safe), 0, -1):
        if text[:safe].endswith(stop[:k]):
          safe -= k
          break
    return self._send(text[:safe])

  def finish(self) -> str:
    """The rest of the text (the tokens ended): what the last tokens hold, a partial character
    included."""
    if self.stopped:
      return ""
    if self._read < len(self.ids):
      decode = self.tokenizer.decode
      before = decode(self.ids[self._prefix : self._read])
      self.text += decode(self.ids[self._prefix :])[len(before) :]
      self._prefix, self._read = self._read, len(self.ids)
      self._ends[-1] = len(self.text)
    return self._send(self.text)

  def _send(self, text: str) -> str:
    delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
    self.sent = text if text.startswith(self.sent) else self.sent
    return delta
