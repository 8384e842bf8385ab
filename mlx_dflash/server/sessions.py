"""Cached prompt prefixes across requests: a pool of Sessions, least recently used out first.

A request takes the Session whose cached tokens share the longest prefix with its prompt
(Session.rewind then prefills only the rest: the next turn of a conversation costs its new
tokens), and gives it back afterwards. The pool is bounded by the bytes its caches hold.
"""

from __future__ import annotations

from ..engine import Session
from ..models.drafter import DrafterRunner


def common_prefix(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def session_bytes(session: Session) -> int:
    arrays = [a for c in session.cache for a in c.state_arrays]
    if session.drafter is not None and hasattr(session.drafter, "cache"):
        arrays += [a for c in session.drafter.cache for a in c.state_arrays]
    return sum(a.nbytes for a in arrays if a is not None)


class SessionPool:
    """Sessions for one target (and drafter model), each with its own drafter cache."""

    def __init__(
        self,
        target,
        runner: DrafterRunner | None,
        max_bytes: int,
        max_sessions: int,
        kv=None,
        max_kv_size: int | None = None,
    ):
        self.target = target
        # a quantized or rotating KV cache's settings (--kv-bits, --max-kv-size)
        self.kv, self.max_kv_size = kv, max_kv_size
        self.drafter_model = runner.drafter if runner is not None else None
        self.max_bytes = max_bytes
        self.max_sessions = max(1, max_sessions)
        self.idle: list[Session] = []  # least recently used first

    def _new(self, with_drafter: bool) -> Session:
        runner = None
        if with_drafter and self.drafter_model is not None:
            runner = DrafterRunner(self.drafter_model, self.target)
        return Session(self.target, runner, self.kv, self.max_kv_size)

    def take(self, prompt: list[int], with_drafter: bool) -> tuple[Session, int]:
        """The idle Session sharing the longest prefix with `prompt` (a new one if none
        shares any), and how many prompt tokens it holds already."""
        best, best_n = None, 0
        for s in self.idle:
            if with_drafter and s.drafter is None:
                continue
            n = common_prefix(s.tokens, prompt)
            if n > best_n:
                best, best_n = s, n
        if best is None:
            return self._new(with_drafter), 0
        self.idle.remove(best)
        return best, best_n

    def give_back(self, session: Session) -> None:
        """Keep `session` as the most recent; drop the least recent past the bounds."""
        self.idle.append(session)
        while len(self.idle) > self.max_sessions or (
            len(self.idle) > 1 and sum(session_bytes(s) for s in self.idle) > self.max_bytes
        ):
            self.idle.pop(0)
        if session_bytes(session) > self.max_bytes:
            self.idle.remove(session)
