"""Prompt lookup: draft branches copied from earlier in the text (docs/lookup.md).

Code edits, quotes, summaries and chat turns repeat what the prompt or the answer already said.
When the last few tokens occurred before, the tokens that followed them then are a cheap draft:
no drafter pass at all. Candidates are the continuations of the longest suffix n-gram
(MAX_NGRAM down to MIN_NGRAM tokens) that occurred before, most recent occurrence first,
distinct continuations only. They join the DDTree as extra branches (tree.graft), or are the
whole tree (`--mode lookup`, for any target without a drafter).
"""

from __future__ import annotations

from collections import defaultdict

MAX_NGRAM = 4
MIN_NGRAM = 2  # of branches(); 1-grams are indexed for echo()
MAX_BRANCHES = 3


class PromptLookup:
    """An n-gram index over one growing token sequence (prompt + everything decided since)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # n-gram -> positions just after its occurrences (where a continuation starts), in order
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def sync(self, tokens: list[int]) -> None:
        """Index `tokens`: appended when they extend what was indexed, else a fresh start."""
        if tokens[: len(self.tokens)] != self.tokens:
            self.tokens, self.index = [], defaultdict(list)
        self.extend(tokens[len(self.tokens) :])

    def extend(self, new: list[int]) -> None:
        """Append and index `new` tokens (each round: what it committed, no copy of the rest)."""
        tokens = self.tokens
        for tok in new:
            tokens.append(int(tok))
            end = len(tokens)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self.index[tuple(tokens[end - n : end])].append(end)

    def branches(self, max_len: int, max_branches: int = MAX_BRANCHES) -> list[list[int]]:
        """Up to `max_branches` distinct continuations (each at most `max_len` tokens) of the
        longest suffix n-gram seen before; the most recent occurrence first."""
        return self._after(range(MAX_NGRAM, MIN_NGRAM - 1, -1), max_len, max_branches)

    def echo(self, max_len: int, max_branches: int = MAX_BRANCHES) -> list[list[int]]:
        """The continuations of the last token alone, newest first: the last resort, where no
        longer suffix matched (here or in a corpus). Structure repeats after one token: in
        JSON `",\n` is followed by the indent and a quote again, a list's newline by its
        bullet. Too loose for branches(): its acceptance is counted apart (ddtree.py)."""
        return self._after([1], max_len, max_branches)

    def _after(self, sizes, max_len: int, max_branches: int) -> list[list[int]]:
        if max_len < 1:
            return []
        end = len(self.tokens)
        for n in sizes:
            if end < n:
                continue
            found: list[list[int]] = []
            for pos in reversed(self.index.get(tuple(self.tokens[end - n :]), ())):
                chain = self.tokens[pos : pos + max_len]
                if pos < end and chain and chain not in found:
                    found.append(chain)
                    if len(found) == max_branches:
                        break
            if found:
                return found
        return []


class LookupStats:
    """How often lookup tokens are accepted, as the chance r that a lookup token is accepted
    given its predecessor was (a geometric model), from decayed counts with a prior of 1/2."""

    DECAY = 0.95

    def __init__(self):
        self.hits, self.misses = 1.0, 1.0

    @property
    def rate(self) -> float:
        return self.hits / (self.hits + self.misses)

    def record(self, chain: list[int], path_tokens: list[int]) -> None:
        """The walk followed `path_tokens`; count how far it went along `chain`."""
        k = 0
        while k < min(len(chain), len(path_tokens)) and chain[k] == path_tokens[k]:
            k += 1
        self.hits = self.DECAY * self.hits + k
        self.misses = self.DECAY * self.misses + (k < len(chain))

    def expected(self, length: int) -> float:
        """Expected lookup tokens accepted from a chain of `length` tokens."""
        return self.expected_each(length)[-1]

    def expected_each(self, length: int) -> list[float]:
        """`expected` at every length 0..length, in one pass (r + r^2 + ... + r^n)."""
        r, term, total, out = self.rate, 1.0, 0.0, [0.0]
        for _ in range(length):
            term *= r
            total += term
            out.append(total)
        return out
