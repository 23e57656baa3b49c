"""Stop strings found in a text as it grows, at a cost proportional to the new text: an
Aho-Corasick automaton over a request's stop strings, built once and shared by its choices, each
of which keeps its own state (an int). A state is the longest end of the text read that begins
some stop string: that much text could still become one, so it is held back from the client.
"""

from __future__ import annotations

import collections


class StopStrings:
  """The automaton of `stops` (non-empty strings)."""

  def __init__(self, stops: list[str]):
    self._next: list[dict[str, int]] = [{}]  # the trie's edges
    self.depth = [0]  # per state: the length of the text it stands for
    self._match = [0]  # per state: the longest stop string its text ends with (0: none)
    for stop in stops:
      state = 0
      for ch in stop:
        if ch not in self._next[state]:
          self._next[state][ch] = len(self.depth)
          self._next.append({})
          self.depth.append(self.depth[state] + 1)
          self._match.append(0)
        state = self._next[state][ch]
      self._match[state] = max(self._match[state], len(stop))
    self._fail = [0] * len(self.depth)  # the longest proper end of a state's text that is one
    queue = collections.deque(self._next[0].values())
    while queue:
      state = queue.popleft()
      for ch, child in self._next[state].items():
        fail = self._fail[state]
        while fail and ch not in self._next[fail]:
          fail = self._fail[fail]
        found = self._next[fail].get(ch, 0)
        self._fail[child] = found if found != child else 0  # (a child of the root: the root)
        self._match[child] = max(self._match[child], self._match[self._fail[child]])
        queue.append(child)

  def __bool__(self) -> bool:
    return len(self.depth) > 1

  def scan(self, state: int, text: str, start: int) -> tuple[int, tuple[int, int] | None]:
    """Read `text[start:]` from `state`: the state after it and None, or, at the first stop
    string completed, the state there and (where it ends in `text`, its length; of two ending
    at one character, the longer)."""
    if not self:
      return 0, None
    nxt, fail, match = self._next, self._fail, self._match
    for i in range(start, len(text)):
      ch = text[i]
      while state and ch not in nxt[state]:
        state = fail[state]
      state = nxt[state].get(ch, 0)
      if match[state]:
        return state, (i + 1, match[state])
    return state, None
