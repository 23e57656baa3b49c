"""A choice's text as its tokens arrive, cut at stop strings and stop token ids, and the
log-probabilities of the tokens whose text has been sent."""

from __future__ import annotations


class TextStream:
  """A choice's text as its tokens arrive: what may be sent so far, cut at the first stop
  string or before the first stop token id. Text that could still change (a partial UTF-8
  character, a possible start of a stop string) is held back until the next tokens settle it."""

  def __init__(self, tokenizer, stops: list[str], stop_ids=()):
    self.tokenizer, self.stops, self.stop_ids = tokenizer, stops, frozenset(stop_ids)
    self.ids: list[int] = []
    self.logprobs: list[float] = []  # of `ids`, when the tokens came with them
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
    out, n = [], self._reported
    while n < len(self.ids):
      n += 1
      text = self.tokenizer.decode(self.ids[:n])
      if text.endswith("\ufffd") and text != self.sent:
        continue  # part of a character: reported with the token that completes it
      if len(text) > len(self.sent) or not self.sent.startswith(text):
        break
      for i in range(self._reported, n):
        piece = text[self._reported_chars :] if i == n - 1 else ""
        out.append((piece, self.logprobs[i], self._reported_chars))
      self._reported, self._reported_chars = n, len(text)
    return out

  def _add(self, ids: list[int], logprobs: list[float]) -> str:
    self.ids += ids
    self.logprobs += logprobs
    text = self.tokenizer.decode(self.ids)
    # A stop string starts after the text already sent (which never ends in a stop's prefix);
    # searching from there keeps the matching linear in the text's length.
    start = max(0, len(self.sent) - max((len(s) for s in self.stops), default=0))
    hits = [(i, len(s)) for i, s in ((text.find(s, start), s) for s in self.stops) if i >= 0]
    if hits:
      at, length = min(hits)
      self.stopped, self.kept_tokens = True, self._tokens_through(at + length, len(ids))
      return self._send(text[:at])
    safe = len(text.rstrip("\ufffd"))
    for stop in self.stops:
      for k in range(min(len(stop) - 1, safe), 0, -1):
        if text[:safe].endswith(stop[:k]):
          safe -= k
          break
    return self._send(text[:safe])

  def _tokens_through(self, chars: int, new: int) -> int:
    """The fewest tokens whose text has `chars` characters; among the `new` last ones (a stop
    string is found as soon as the token that completes it arrives)."""
    for n in range(len(self.ids) - new + 1, len(self.ids)):
      if len(self.tokenizer.decode(self.ids[:n]).rstrip("\ufffd")) >= chars:
        return n
    return len(self.ids)

  def finish(self) -> str:
    return "" if self.stopped else self._send(self.tokenizer.decode(self.ids))

  def _send(self, text: str) -> str:
    delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
    self.sent = text if text.startswith(self.sent) else self.sent
    return delta
