"""Answer corpus: lookup branches from the target's past answers (docs/lookup.md).

Where the text at hand has no match, the continuations of the longest suffix n-gram that a
file of the same target's answers holds join the tree as lookup branches, the most frequent
first. The index is numpy arrays, not a dict of tuples: one sorted array of 64-bit n-gram
hashes per n, with the positions after them (about 16 bytes per token per n).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from ..atomic import atomic_file
from ..errors import DFlashError

MAX_NGRAM = 8  # a corpus is large: longer contexts pick continuations more precisely
MIN_NGRAM = 3  # 2-grams match nearly anywhere in a corpus, and mostly mislead
MAX_OCCURRENCES = 256  # the most recent occurrences counted per query
# A corpus that grows (serve adds each answer) keeps its newest tokens up to this many: about
# 100 bytes of index a token.
MAX_TOKENS = 4_000_000
# Answers join a small recent index first, merged into the main one once it holds this many
# n-grams or an eighth of the main one's: merging into the main index copies all of its arrays
# (80 ms an answer at 3.6M tokens), the recent one's only a little.
RECENT_MIN = 65_536
_SEP = -1  # between two answers: no n-gram or continuation crosses it
_MUL = np.uint64(0x9E3779B97F4A7C15)


def _hash(tokens: list[int]) -> np.uint64:
    """The index's hash of one n-gram (AnswerCorpus builds all of them at once)."""
    h = np.uint64(0)
    with np.errstate(over="ignore"):
        for x in tokens:
            h = h * _MUL + np.uint64(x) + np.uint64(1)
    return h


def split_answers(flat) -> list[list[int]]:
    """Answers joined with separators (the corpus's tokens, or a flat list sent between ranks)
    back into one list each; empty ones dropped."""
    flat = np.asarray(flat, dtype=np.int64)
    parts = np.split(flat, np.nonzero(flat == _SEP)[0] + 1)
    return [p[p != _SEP].tolist() for p in parts if (p != _SEP).any()]


def join_answers(answers: list[list[int]]) -> list[int]:
    """split_answers' inverse: each answer followed by a separator."""
    return [t for a in answers for t in (*a, _SEP)]


def newest_answers(answers: list[list[int]], limit: int) -> list[list[int]]:
    """The newest of `answers` (in order, oldest first) that hold at most `limit` tokens with
    their separators."""
    total = sum(len(a) + 1 for a in answers)
    kept = 0
    while kept < len(answers) and total > limit:
        total -= len(answers[kept]) + 1
        kept += 1
    return answers[kept:]


class AnswerCorpus:
    """An n-gram index over many token sequences, queried with the text's last tokens."""

    def __init__(self, sequences: list[list[int]]):
        self._build(sequences)

    def _build(self, sequences: list[list[int]]) -> None:
        parts = []
        for s in sequences:
            parts += [np.asarray(s, dtype=np.int64), np.array([_SEP])]
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.keys: dict[int, np.ndarray] = {}
        self.ends: dict[int, np.ndarray] = {}
        t = self.tokens.astype(np.uint64)
        h = np.zeros(len(t), dtype=np.uint64)  # h[s]: hash of the n tokens from s (as _hash)
        ok = np.ones(len(t), dtype=bool)  # no separator among them
        for n in range(1, MAX_NGRAM + 1):
            m = max(len(t) - n + 1, 0)
            with np.errstate(over="ignore"):
                h = h[:m] * _MUL + t[n - 1 :] + np.uint64(1)
            ok = ok[:m] & (self.tokens[n - 1 :] != _SEP)
            if n >= MIN_NGRAM:
                starts = np.nonzero(ok)[0]
                order = np.argsort(h[starts], kind="stable")  # by hash, then position
                self.keys[n] = h[starts][order]
                self.ends[n] = (starts + n)[order]
        # The recent index (RECENT_MIN): answers since the last merge, every position after
        # the main index's.
        self.recent_keys = {n: self.keys[n][:0] for n in self.keys}
        self.recent_ends = {n: self.ends[n][:0] for n in self.ends}

    def __len__(self) -> int:
        return int((self.tokens != _SEP).sum())

    def copy(self) -> AnswerCorpus:
        """A corpus that can grow apart from this one (add() replaces arrays, never writes
        into them, so the copy shares them until then)."""
        twin = AnswerCorpus([])
        twin.tokens, twin.keys, twin.ends = self.tokens, dict(self.keys), dict(self.ends)
        twin.recent_keys, twin.recent_ends = dict(self.recent_keys), dict(self.recent_ends)
        return twin

    def index(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The n-gram index as queries see it, main and recent as one sorted pair."""
        at = np.searchsorted(self.keys[n], self.recent_keys[n], "right")
        return (
            np.insert(self.keys[n], at, self.recent_keys[n]),
            np.insert(self.ends[n], at, self.recent_ends[n]),
        )

    def add(self, answer: list[int]) -> None:
        """One more answer joins the index (serve adds each one it finishes, so an agent's
        later calls find its earlier ones)."""
        self.extend([answer])

    def extend(self, answers: list[list[int]]) -> None:
        """Answers join the index, in order, by one merge: their n-grams go in after the equal
        ones already there, which keeps each hash's run in position order (newest last). Past
        MAX_TOKENS the oldest answers leave, by a rebuild from the newer half."""
        answers = [a[-MAX_TOKENS // 4 :] for a in answers if a]
        # (more than the newer half: only the newest stay)
        answers = newest_answers(answers, MAX_TOKENS // 2)
        if not answers:
            return
        new = AnswerCorpus(answers)
        if len(self.tokens) + len(new.tokens) > MAX_TOKENS:  # keep the newer half, then merge
            seps = np.nonzero(self.tokens == _SEP)[0]  # (the last token is one)
            cut = seps[np.searchsorted(seps, len(self.tokens) - MAX_TOKENS // 2)] + 1
            self._build(split_answers(self.tokens[cut:]))
        offset = len(self.tokens)
        self.tokens = np.concatenate([self.tokens, new.tokens])
        for n in self.keys:
            at = np.searchsorted(self.recent_keys[n], new.keys[n], "right")
            self.recent_keys[n] = np.insert(self.recent_keys[n], at, new.keys[n])
            self.recent_ends[n] = np.insert(self.recent_ends[n], at, new.ends[n] + offset)
        if len(self.recent_keys[MIN_NGRAM]) > max(RECENT_MIN, len(self.keys[MIN_NGRAM]) // 8):
            for n in self.keys:
                self.keys[n], self.ends[n] = self.index(n)
                self.recent_keys[n], self.recent_ends[n] = self.keys[n][:0], self.ends[n][:0]

    def branches(self, context: list[int], max_len: int, max_branches: int) -> list[list[int]]:
        """Up to `max_branches` distinct continuations (at most `max_len` tokens each) of the
        longest suffix of `context` (MAX_NGRAM down to MIN_NGRAM tokens) the corpus holds,
        ranked by how often the corpus continued that way (each prefix's count summed)."""
        if max_len < 1:
            return []
        for n in range(min(MAX_NGRAM, len(context)), MIN_NGRAM - 1, -1):
            suffix = np.asarray(context[-n:], dtype=np.int64)
            near = self._newest(n, _hash(context[-n:]))
            ends = [int(e) for e in near if np.array_equal(self.tokens[e - n : e], suffix)]
            found = self._ranked(ends, max_len, max_branches)
            if found:
                return found
        return []

    def _newest(self, n: int, h: np.uint64) -> np.ndarray:
        """Where the n-grams hashed `h` end, the newest MAX_OCCURRENCES, oldest first (the
        recent index's positions all follow the main one's)."""
        found = []
        for keys, ends in (
            (self.keys[n], self.ends[n]),
            (self.recent_keys[n], self.recent_ends[n]),
        ):
            lo, hi = np.searchsorted(keys, h, "left"), np.searchsorted(keys, h, "right")
            found.append(ends[max(lo, hi - MAX_OCCURRENCES) : hi])
        return np.concatenate(found)[-MAX_OCCURRENCES:]

    def _ranked(self, ends: list[int], max_len: int, max_branches: int) -> list[list[int]]:
        counts: Counter[tuple[int, ...]] = Counter()
        chains = []
        for e in ends:
            chain = tuple(self.tokens[e : e + max_len].tolist())
            if _SEP in chain:
                chain = chain[: chain.index(_SEP)]
            chains.append(chain)
            for k in range(1, len(chain) + 1):
                counts[chain[:k]] += 1

        def score(c: tuple[int, ...]) -> int:
            return sum(counts[c[:k]] for k in range(1, len(c) + 1))

        distinct = sorted({c for c in chains if c}, key=lambda c: (-score(c), c))
        return [list(c) for c in distinct[:max_branches]]


_LOADED: dict[tuple[str, float], AnswerCorpus] = {}


def corpus_of(spec: str | AnswerCorpus | None) -> AnswerCorpus | None:
    """GenerationConfig.lookup_corpus as an index: a file is read once per version (shared,
    never changed here); an AnswerCorpus is the caller's own, which may grow between
    generations (serve's); None or "" is no corpus."""
    if spec is None or isinstance(spec, AnswerCorpus):
        return spec
    return load_corpus(spec) if spec else None


def lookup_corpus(cfg, drafter) -> str | AnswerCorpus | None:
    """The corpus a generation's lookup reads: the one its GenerationConfig names (a file or
    an AnswerCorpus; "" for none), else the drafter's own (Drafter.corpus_file)."""
    if cfg.lookup_corpus is not None:
        return cfg.lookup_corpus
    return None if drafter is None else drafter.corpus_file


def live_corpus(spec: str | AnswerCorpus | None) -> AnswerCorpus | None:
    """A corpus of the caller's own that starts as the file's answers (or empty) and grows:
    a copy, so the file's shared index stays as read (a caller's AnswerCorpus is already its
    own). None for "" (no corpus at all)."""
    if isinstance(spec, AnswerCorpus):
        return spec
    if spec == "":
        return None
    return load_corpus(spec).copy() if spec else AnswerCorpus([])


def load_corpus(path: str | os.PathLike) -> AnswerCorpus:
    """The corpus in a JSONL file (gzip or not) of `{"tokens": [...]}` lines, indexed once per
    file version; a missing or malformed file is one sentence."""
    p = Path(path)
    if not p.is_file():
        raise DFlashError(f"The lookup corpus {p} does not exist.")
    key = (str(p.resolve()), p.stat().st_mtime)
    if key not in _LOADED:
        opener = gzip.open if p.suffix == ".gz" else open
        seqs = []
        try:
            with opener(p, "rt", encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    record = json.loads(line) if line.strip() else None
                    if record is not None and not _is_header(record):
                        seqs.append(_tokens(record, p, i))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DFlashError(f"The lookup corpus {p} cannot be read: {e}.") from None
        if not seqs:
            raise DFlashError(f"The lookup corpus {p} holds no answers.")
        _LOADED.clear()  # one corpus in memory at a time
        _LOADED[key] = AnswerCorpus(seqs)
    return _LOADED[key]


def _tokens(record, path: Path, line: int) -> list[int]:
    toks = record.get("tokens") if isinstance(record, dict) else None
    if not isinstance(toks, list) or not all(isinstance(t, int) and t >= 0 for t in toks):
        raise DFlashError(
            f"Line {line} of the lookup corpus {path} has no 'tokens' list of token ids."
        )
    return toks


def _is_header(record) -> bool:
    return isinstance(record, dict) and LOG_HEADER in record


LOG_HEADER = "dflash_mlx_answer_log"  # the first line's key: format version and tokenizer


class AnswerLog:
    """serve's answers kept on disk (`serve --keep-answers FILE`), so the lookup corpus a
    server grew survives its restart: one `{"tokens": [...]}` line appended per answer after
    a header line naming the tokenizer (token ids mean nothing under another one). The file
    is also a corpus file (--lookup-corpus reads it). Only the newest MAX_TOKENS tokens count:
    opening a longer log rewrites it with those, so it stays bounded."""

    def __init__(self, path: str | os.PathLike, tokenizer: str) -> None:
        self.path, self.tokenizer = Path(path), tokenizer
        self.failed = False
        self.kept = 0  # answers read back at start (serve says how many)

    def read(self) -> list[list[int]]:
        """The kept answers, oldest first ([] for a new file). A last line cut short (the
        server stopped mid-write) is dropped; any other damage, or another tokenizer's log,
        is one sentence."""
        p = self.path
        if not p.exists():
            return []
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DFlashError(f"The answer log {p} cannot be read: {e}.") from None
        if not lines:
            return []
        try:
            head = json.loads(lines[0])
        except ValueError:
            head = None
        if not _is_header(head):
            raise DFlashError(f"{p} is not an answer log written by serve --keep-answers.")
        if head[LOG_HEADER].get("tokenizer") != self.tokenizer:
            raise DFlashError(
                f"The answer log {p} was written for another tokenizer "
                f"({head[LOG_HEADER].get('model')}); give this model its own log."
            )
        answers, cut_short = [], False
        for i, line in enumerate(lines[1:], 2):
            try:
                answers.append(_tokens(json.loads(line), p, i))
            except (ValueError, DFlashError):
                if i < len(lines):
                    raise DFlashError(f"Line {i} of the answer log {p} is damaged.") from None
                cut_short = True  # (rewritten without it: the next line must not join it)
        too_long = sum(len(a) + 1 for a in answers) > MAX_TOKENS
        if too_long:  # keep it bounded: the newest
            answers = newest_answers(answers, MAX_TOKENS // 2)
        if cut_short or too_long:
            self._rewrite(head, answers)
        return answers

    def start(self, model: str) -> None:
        """Create the file with its header if it does not exist (readable by its owner)."""
        if self.path.exists() and self.path.stat().st_size:
            return
        head = {LOG_HEADER: {"version": 1, "tokenizer": self.tokenizer, "model": model}}
        self._rewrite(head, [])

    def append(self, answer: list[int]) -> None:
        """One line per answer, written whole (a failed write is said once, and serving goes
        on: the corpus in memory still has the answer)."""
        if not answer:
            return
        line = (json.dumps({"tokens": answer}) + "\n").encode()
        try:  # one write to an O_APPEND file: two servers on one log never split a line
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            if not self.failed:
                print(f"Cannot add to the answer log {self.path}: {e.strerror or e}.",
                      file=sys.stderr)  # fmt: skip
            self.failed = True

    def _rewrite(self, head: dict, answers: list[list[int]]) -> None:
        def write(tmp: str) -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(head) + "\n")
                f.writelines(json.dumps({"tokens": a}) + "\n" for a in answers)

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_file(self.path, write)
        except OSError as e:
            raise DFlashError(
                f"Cannot write the answer log {self.path}: {e.strerror or e}."
            ) from None
