"""Where a migrated stream resumes: the tokens whose whole text the client has (pure).

A detokenizer sends a token's text late in two cases: the token ends inside a character (its
text comes with the tokens that complete it), and, for a request with stop strings, the last
len(longest stop) - 1 characters are held back while they could still begin one. A migration
puts the tokens whose text the client has into the new leg's context and has its engine draw
the others again (controller/sequence.py drops the text the client already has from what they
bring). A token put in the context whose text was still held back would lose that text, and a
stop string that began in it would go unseen.

What the client has is known only at some deltas: one of a single token that brought text (its
detokenizer sent everything up to that token, less the stop-string hold-back). A delta of
several tokens (outputs merged while their reader was busy) may end with tokens whose text is
still held back, so it is no such point.
"""

from __future__ import annotations

from collections import deque


class Resume:
    """The latest point whose tokens' text the client has whole, as deltas reach it."""

    def __init__(self, holdback: int = 0):
        self.holdback = holdback  # characters the detokenizer holds back for stop strings
        self.tokens = self.text_len = 0  # what the client has
        # (tokens, length of their whole text), oldest first; the first is always one whose
        # text the client has.
        self._marks: deque[tuple[int, int]] = deque([(0, 0)])

    def add(self, tokens: int, text: str) -> None:
        """After a delta of `tokens` tokens bringing `text` went to the client."""
        self.tokens += tokens
        self.text_len += len(text)
        if tokens == 1 and text:
            self._marks.append((self.tokens, self.text_len + self.holdback))
        while len(self._marks) > 1 and self._marks[1][1] <= self.text_len:
            self._marks.popleft()

    def point(self) -> tuple[int, int]:
        """(leading tokens whose whole text the client has, the length of that text)."""
        return self._marks[0]


def holdback(params) -> int:
    """Characters vLLM's detokenizer holds back from a stream with these sampling params."""
    if not params.stop or params.include_stop_str_in_output:  # SamplingParams: a list
        return 0
    return max(len(s) for s in params.stop) - 1
