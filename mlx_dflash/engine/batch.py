"""Batched rounds: several generations share every target forward.

Every kind of round reaches the target through `Session.target.forward`. Here that target is a
`BatchedTarget`, whose forward suspends the row (a greenlet on the calling thread) until every
row has asked for a forward or ended; the pending passes then run as one packed forward. Why
rows are greenlets and what each row keeps: docs/batching.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from greenlet import getcurrent, greenlet

from .contract import DraftAsk, Pass


@dataclass
class BudgetAsk:
    """A batched row's auto budget waiting for its share of the round's verify budget."""

    policy: Any  # engine/budget.py AutoBudget
    tree: Any  # engine/tree.py Tree


@dataclass
class _Slot:
    p: Any  # a target Pass, a DraftAsk or a BudgetAsk
    row: Any  # the greenlet waiting for it
    result: Any = None
    error: BaseException | None = None


class Batcher:
    """The rows, and the meeting point of their forwards. Drive it with `tick()` from one
    thread; `add` rows between ticks."""

    def __init__(self, target) -> None:
        self.target = target
        self._runnable: list[Any] = []  # greenlets to resume in this tick
        self._pending: list[_Slot] = []  # target passes
        self._drafts: list[_Slot] = []  # drafter passes
        self._allots: list[_Slot] = []  # auto-budget trees waiting for the round's budget
        self._hub: Any = None  # the greenlet running tick(), where rows come back to
        self._live: list[Any] = []  # every row added and not ended (for close())
        self.forwards = 0  # packed forwards run, the rows they carried, the most at once
        self.rows = 0
        self.max_rows = 0
        self.drafts = 0  # packed drafter passes, and the rows they carried
        self.draft_rows = 0
        self.allots = 0  # rounds whose trees shared one verify budget (split_budget)
        # The rows' KV caches share one buffer per layer while they run (models/arena.py):
        # a session's caches move in at its first packed forward and out when its row ends.
        self.arena = target.new_arena()
        self._adopted: dict[Any, list[list]] = {}
        self._tokens_ema = 0.0  # tokens and rows per packed forward, lately
        self._rows_ema = 0.0

    def add(self, fn: Callable[[], None]) -> None:
        """A new row running fn() (a whole generation; it must handle its own errors)."""
        row = greenlet(fn)
        self._runnable.append(row)
        self._live.append(row)

    @property
    def active(self) -> int:
        """Rows not finished."""
        waiting = len(self._pending) + len(self._drafts) + len(self._allots)
        return len(self._runnable) + waiting

    def in_row(self) -> bool:
        """Whether the caller is a row of a tick under way (else it runs alone)."""
        return self._hub is not None and getcurrent() is not self._hub

    def tick(self) -> bool:
        """Run every runnable row until it asks for a forward or ends, then run the pending
        forwards as one. True while rows remain."""
        self._hub = getcurrent()
        while True:
            runnable, self._runnable = self._runnable, []
            for row in runnable:
                row.parent = self._hub  # a row that ends comes back here
                row.switch()
                if row.dead:  # its caches leave the arena (back to the session's own)
                    self._release(row)
                    self._live.remove(row)
            if self._drafts:
                # The drafts first: their rows then build their trees and join the verify.
                drafts, self._drafts = self._drafts, []
                self._run_drafts(drafts)
                self._runnable = [slot.row for slot in drafts]
            elif self._allots:
                # Every tree of this round is built: split one verify budget across them.
                allots, self._allots = self._allots, []
                self._split(allots)
                self._runnable = [slot.row for slot in allots]
            else:
                break
        if self._pending:
            batch, self._pending = self._pending, []
            self._run(batch)
            self._runnable = [slot.row for slot in batch]
        return self.active > 0

    def forward(self, p: Pass):
        """Called inside a row: its pass joins the next packed forward; resumes with its
        (logits, taps)."""
        if not self.in_row():  # not inside a row: run it now
            return self._alone(p)
        return self._wait(self._pending, p)

    def propose(self, runner, last: int, start: int, n: int):
        """Called inside a row by its DrafterRunner: the pass joins the next packed drafter
        pass (models/drafter.py propose_rows); resumes with its Proposal."""
        return self._wait(self._drafts, DraftAsk(runner, last, start, n))

    def allot(self, policy, tree) -> int | None:
        """Called inside a row by its auto budget (engine/budget.py AutoBudget.cut): the
        row's share of this round's one verify budget, in nodes after the root, once every
        row's tree is built; None outside a tick (the policy then decides alone)."""
        if not self.in_row():
            return None
        return self._wait(self._allots, BudgetAsk(policy, tree))

    def close(self) -> None:
        """End every row still suspended, running its `finally` blocks (the wired-memory
        block, the session's caches). For when an error escaped a tick: left suspended, the
        rows would hold those blocks open for as long as the error's traceback lives."""
        rows, self._live = self._live, []
        self._runnable, self._pending, self._drafts, self._allots = [], [], [], []
        for row in rows:
            if not row.dead:
                row.parent = getcurrent()
                row.throw()  # GreenletExit, which ends the row quietly
            self._release(row)

    def _wait(self, queue: list[_Slot], p: Any):
        """Queue this row's request `p`, suspend the row until the tick has served it, and
        return its result (or raise its error)."""
        slot = _Slot(p, getcurrent())
        queue.append(slot)
        self._hub.switch()
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _split(self, batch: list[_Slot]) -> None:
        from .budget import split_budget

        self.allots += 1

        def budgets() -> list[int]:
            policies = [s.p.policy for s in batch]
            gains = [s.p.policy.gains(s.p.tree) for s in batch]
            # The passes already waiting: plain steps and blocks emit about a token each.
            base = sum(int(s.p.tokens.shape[0]) for s in self._pending)
            overhead = float(np.mean([p.overhead for p in policies]))
            split = split_budget(gains, base, len(self._pending), overhead, policies[0].profile)
            return [int(b) for b in split]

        _serve(batch, budgets)

    def _run_drafts(self, batch: list[_Slot]) -> None:
        self.drafts += 1
        self.draft_rows += len(batch)
        _serve(batch, lambda: batch[0].p.drafter.propose_together([s.p for s in batch]))

    def others_tokens(self) -> float:
        """Tokens a row's pass has lately shared its packed forward with (the auto budget
        prices a tree at what it adds to them: engine/budget.py MarginalProfile)."""
        if self._rows_ema <= 1.0:
            return 0.0
        return self._tokens_ema * (1.0 - 1.0 / self._rows_ema)

    def _alone(self, p: Pass):
        return self.target.forward([p])[0]

    def _release(self, row) -> None:
        for cache in self._adopted.pop(row, []):
            if self.arena is not None:
                self.arena.release(cache)

    def _adopt(self, slot: _Slot) -> None:
        """Move the pass's caches into the arena if they are not there yet, or out of it once
        the row is longer than the arena keeps (KVArena.max_rows)."""
        if self.arena is None:
            return
        caches = self._adopted.setdefault(slot.row, [])
        held = any(c is slot.p.cache for c in caches)
        fits = slot.p.start + int(slot.p.tokens.shape[0]) <= self.arena.max_rows
        if held and not fits:
            self.arena.release(slot.p.cache)
            caches.remove(slot.p.cache)
        elif fits and not held and self.arena.adopt(slot.p.cache):
            caches.append(slot.p.cache)

    def _run(self, batch: list[_Slot]) -> None:
        self.forwards += 1
        self.rows += len(batch)
        self.max_rows = max(self.max_rows, len(batch))
        tokens = sum(int(s.p.tokens.shape[0]) for s in batch)
        a = 0.25 if self.forwards > 1 else 1.0
        self._tokens_ema += a * (tokens - self._tokens_ema)
        self._rows_ema += a * (len(batch) - self._rows_ema)

        def forward() -> list:
            if len(batch) == 1:  # alone: exactly the forward of an unbatched generation
                return [self._alone(batch[0].p)]
            for slot in batch:
                self._adopt(slot)
            return self.target.forward([s.p for s in batch])

        _serve(batch, forward)


def _serve(batch: list[_Slot], compute: Callable[[], list]) -> None:
    """Each slot's result from compute(), slot by slot; where it raises, every row waiting on
    it hears of the error, in its own round."""
    try:
        results = compute()
        for slot, result in zip(batch, results, strict=True):
            slot.result = result
    except Exception as e:
        for slot in batch:
            slot.error = e


class BatchedTarget:
    """A target whose forward joins the batch; every other member of the contract is the
    target's own (named here, none forwarded by lookup: engine/contract.py lists them)."""

    def __init__(self, target, batcher: Batcher) -> None:
        self._target = target
        self._batcher = batcher
        self.tokenizer = target.tokenizer
        self.config = target.config
        self.model_type = target.model_type
        self.vocab_size = target.vocab_size
        self.model = target.model

    @property
    def batcher(self) -> Batcher:
        return self._batcher

    @property
    def world(self):
        return self._target.world

    @property
    def forward_paths(self) -> str:
        return self._target.forward_paths

    def make_cache(self, kv=None, max_kv_size=None) -> list:
        if kv is None and max_kv_size is None:
            return self._target.make_cache()
        return self._target.make_cache(kv, max_kv_size)

    def new_arena(self):
        return None  # the batch's own arena is the Batcher's

    @property
    def runs_alone(self) -> bool:
        return False  # its forwards wait for the other rows'

    @property
    def unbatched(self):
        """The target itself (forwards of its own: the auto budget's one-time profile)."""
        return self._target

    def forward(self, passes: list[Pass]):
        """A row's passes join the batch's next packed forward (each in turn)."""
        return [self._batcher.forward(p) for p in passes]


def run_rows(target, rows: list[Callable[[Any], None]], join_at: list[int] | None = None):
    """Run each row fn(batched_target) to its end, row i joining once `join_at[i]` packed
    forwards have run; returns the Batcher (its counters). For tests and scripts; `serve`
    drives a Batcher itself."""
    batcher = Batcher(target)
    shared = BatchedTarget(target, batcher)
    waiting = list(enumerate(rows))

    def row(fn: Callable[[Any], None]) -> Callable[[], None]:
        return lambda: fn(shared)

    try:
        while True:
            due = [w for w in waiting if join_at is None or batcher.forwards >= join_at[w[0]]]
            if not due and waiting and not batcher.active:  # nothing runs until the next joins
                due = waiting[:1]
            for w in due:
                batcher.add(row(w[1]))
                waiting.remove(w)
            if not batcher.tick() and not waiting:
                return batcher
    except BaseException:
        batcher.close()
        raise


# mypy checks BatchedTarget against the engine's TargetModel protocol (engine/contract.py)
if TYPE_CHECKING:
    from .contract import TargetModel

    _conforms_batchedtarget: type[TargetModel] = BatchedTarget
