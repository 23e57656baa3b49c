"""A choice's text as its tokens arrive, cut at stop strings and stop token ids."""

from __future__ import annotations


class TextStream:
  """A choice's text as its tokens arrive: what may be sent so far, cut at the first stop
  string or before the first stop token id. Text that could still change (a partial UTF-8
  character, a possible start of a stop string) is held back until the next tokens settle it."""

  def __init__(self, tokenizer, stops: list[str], stop_ids=()):
    self.tokenizer, self.stops, self.stop_ids = tokenizer, stops, frozenset(stop_ids)
    self.ids: list[int] = []
    self.sent = ""
    self.stopped = False

  def add(self, ids: list[int]) -> str:
    cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
    if cut is not None:  # the text ends before the stop token, as at an EOS
      delta = self.add(ids[:cut])  # (a stop string there ends it first)
      if not self.stopped:
        delta += self.finish()
        self.stopped = True
      return delta
    self.ids += ids
    text = self.tokenizer.decode(self.ids)
    # A stop string starts after the text already sent (which never ends in a stop's prefix);
    # searching from there keeps the matching linear in the text's length.
    start = max(0, len(self.sent) - max((len(s) for s in self.stops), default=0))
    hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
    if hits:
      self.stopped = True
      return self._send(text[: min(hits)])
    safe = len(text.rstrip("\ufffd"))
    for stop in self.stops:
      for k in range(min(len(stop) - 1, safe), 0, -1):
        if text[:safe].endswith(stop[:k]):
          safe -= k
          break
    return self._send(text[:safe])

  def finish(self) -> str:
    return "" if self.stopped else self._send(self.tokenizer.decode(self.ids))

  def _send(self, text: str) -> str:
    delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
    self.sent = text if text.startswith(self.sent) else self.sent
    return delta
