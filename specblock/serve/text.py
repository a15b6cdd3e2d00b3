"""Token ids in, text deltas out: what may be sent now, and where a stop string ends the answer.

Stop strings live in text, not tokens (one token may hold half a stop string, or a stop string
may span tokens), so the whole generation is re-decoded after every iteration (cheap next to a
target forward) and two things are held back from the client: a trailing partial UTF-8 character
and any tail that could still grow into a stop string.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self.decode, self.stops = decode, list(stops)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already handed out
        self.stopped = False  # a stop string matched: the answer is complete
        self.n_tokens = 0  # tokens that count for the answer (up to the one completing a stop string)

    def push(self, new: list[int]) -> str:
        """Take an iteration's tokens; return the text now safe to send (maybe empty)."""
        before = len(self.ids)
        self.ids.extend(new)
        text = self.decode(self.ids)
        hit = self._first_stop(text)
        if hit is not None:
            self.stopped = True
            self.text = text[:hit]
            self.n_tokens = self._tokens_to_stop(before)
            return self._take(len(self.text))
        self.text, self.n_tokens = text, len(self.ids)
        safe = len(text.rstrip("\ufffd"))
        return self._take(safe - self._partial_stop(text[:safe]))

    def rest(self) -> str:
        """Everything not yet sent, when generation has ended."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:upto], upto
        return delta

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _tokens_to_stop(self, before: int) -> int:
        """The fewest tokens whose text already holds a stop string (only this iteration's are new)."""
        for k in range(before + 1, len(self.ids) + 1):
            if self._first_stop(self.decode(self.ids[:k])) is not None:
                return k
        return len(self.ids)
