"""A choice's text as its tokens arrive, cut at stop strings and stop token ids, and the
log-probabilities of the tokens whose text has been sent.

Tokens are detokenized incrementally: each new token decodes a short window of the tokens before
it (from the start of the previous token's text, so that a tokenizer whose decoding of a token
depends on its left neighbour, a leading space for one, decodes it as in the whole text), and the
text grows only by complete characters. A response of n tokens costs O(n) decoding, not the
O(n^2) of decoding the whole text at every token, and stop strings cost each new character one
step of their automaton (`stops.StopStrings`); a server does both on its event loop.

A choice ends at the first stop string to complete (of two completing at one character, the
longer), whatever tokens the text arrives in.
"""

from __future__ import annotations

import bisect

from sbd_jax.serving.stops import StopStrings


class TextStream:
  """A choice's text as its tokens arrive: what may be sent so far, cut at the first stop
  string or before the first stop token id. Text that could still change (a partial UTF-8
  character, a possible start of a stop string) is held back until the next tokens settle it."""

  def __init__(self, tokenizer, stops: list[str] | StopStrings, stop_ids=()):
    self.tokenizer, self.stop_ids = tokenizer, frozenset(stop_ids)
    self.stops = stops if isinstance(stops, StopStrings) else StopStrings(stops)
    self._stop_state = 0  # the stop automaton's state after `text`
    self.ids: list[int] = []
    self.logprobs: list[float] = []  # of `ids`, when the tokens came with them
    self.forwards: list[int | None] = []  # of `ids`: the row's forwards when each settled
    self.text = ""  # the text of ids[:_read]: complete characters, final
    self._prefix = self._read = 0  # ids[_prefix:_read]: the window the next token decodes after
    self._ends: list[int] = []  # per token: len(text) once it was read (where its text ends)
    self.sent_chars = 0  # text[:sent_chars] has been sent
    self.stopped = False
    self._reported = 0  # tokens whose log-probabilities `take_sent` has returned
    self._reported_chars = 0
    # Once stopped: the tokens the choice generated, as OpenAI counts them: through the token
    # that completes the stop string, or those before the stop token id (as an EOS, not counted);
    # and the forwards its row had run when the token that ended it settled (None: not known).
    self.kept_tokens: int | None = None
    self.kept_forwards: int | None = None

  @property
  def sent(self) -> str:
    return self.text[: self.sent_chars]

  def add(self, ids: list[int]) -> str:
    """The text that may be sent now, given the next tokens (`requests.Tokens` bring their
    log-probabilities and forwards); once stopped, nothing."""
    if self.stopped:
      return ""
    logprobs = list(getattr(ids, "logprobs", ())) or [float("nan")] * len(ids)
    forwards = list(getattr(ids, "forwards", ())) or [None] * len(ids)
    cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
    if cut is not None:  # the text ends before the stop token, as at an EOS
      delta = self._add(list(ids[:cut]), logprobs[:cut], forwards[:cut])
      if not self.stopped:  # (a stop string before it ends the text first)
        delta += self.finish()
        self.stopped, self.kept_tokens, self.kept_forwards = True, len(self.ids), forwards[cut]
      return delta
    return self._add(list(ids), logprobs, forwards)

  def take_sent(self) -> list[tuple[str, float, int]]:
    """(token text, log-probability, its offset in the text) of the tokens whose text has been
    sent since the last call; a token whose text is cut by a stop string is not. Tokens that
    each hold part of one character are reported with the token that completes it (the
    others with empty text)."""
    out = []
    while self._reported < self._read and self._ends[self._reported] <= self.sent_chars:
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

  def _add(self, ids: list[int], logprobs: list[float], forwards: list) -> str:
    self.ids += ids
    self.logprobs += logprobs
    self.forwards += forwards
    read = len(self.text)
    self._read_new_tokens()
    self._stop_state, hit = self.stops.scan(self._stop_state, self.text, read)
    if hit is not None:
      end, length = hit
      # The fewest tokens whose text holds the whole stop string.
      self.stopped = True
      self.kept_tokens = bisect.bisect_left(self._ends, end) + 1
      self.kept_forwards = self.forwards[self.kept_tokens - 1]
      return self._send(end - length)
    return self._send(len(self.text) - self.stops.depth[self._stop_state])

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
    return self._send(len(self.text))

  def _send(self, end: int) -> str:
    """`text` up to `end` that has not been sent."""
    if end <= self.sent_chars:
      return ""
    delta, self.sent_chars = self.text[self.sent_chars : end], end
    return delta
