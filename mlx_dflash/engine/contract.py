"""What the engine asks of the models it drives: a target, its caches, a drafter, a world.

The engine never imports `models/`; it runs whatever it is given through these four protocols.
Every implementation (models/cache.py's KVCache, models/gated_deltanet.py's RecurrentCache,
distributed.py's OtherRankCache and worlds, models/drafter.py's DrafterRunner, models/target.py's
Target, and the tests' oracle drafters) is checked against them by mypy (`make lint`), through
the `_conforms` lines at the end of each implementing module.

A round of any kind is: draft (Drafter.propose) -> verify (TargetModel.forward) -> walk ->
commit (engine/session.py's Session.commit, the one place that calls Cache.trim / compact and
Drafter.add_context).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from ..kernels.tree_attention import tree_depths


@dataclass
class Pass:
    """One forward's arguments (TargetModel.forward): a batched row's pass waits in a
    Batcher (engine/batch.py) for the packed forward of every row's."""

    tokens: mx.array
    cache: list
    start: int
    parents: np.ndarray | None = None
    logits: str = "all"
    taps: bool = True
    rewindable: bool = True

    def positions(self) -> np.ndarray:
        T = int(self.tokens.shape[0])
        depth = np.arange(T) if self.parents is None else tree_depths(self.parents)
        return self.start + np.asarray(depth, dtype=np.int64)


class Cache(Protocol):
    """One target layer's cache: verification writes every drafted token, commit keeps some."""

    offset: int

    def rewind_point(self, length: int) -> int:
        """The longest prefix <= length this cache can return to."""

    def snapshot(self) -> None:
        """Remember this point (the end of a prompt) as one a later turn can rewind to."""

    def trim(self, length: int) -> None:
        """Keep the first `length` positions (a linear block's accepted prefix)."""

    def compact(self, start: int, keep: Any) -> None:
        """Keep the tree nodes `keep` (a root-to-node path) of the verify that began at start."""

    @property
    def state_arrays(self) -> list[mx.array]:
        """The arrays to evaluate so the cache is materialised (prefill syncs on them)."""


def in_place(keep: Any) -> bool:
    """Whether a tree's kept nodes (a host list) are the verify's first rows 0..n-1, so that
    compacting them is a trim and their taps a prefix: no row moves (a third of the default
    configuration's tree rounds on the planted case, docs/host-time.md)."""
    return not isinstance(keep, mx.array) and list(keep) == list(range(len(keep)))


class Proposal(Protocol):
    """One drafter pass over the n positions after the last token, as the engine uses it: a
    chain (the DFlash round) or a best-first tree (DDTree), free or under a grammar. A drafter
    kind is one implementation: DFlash's independent marginals (engine/marginals.py), DFlash
    2's lattice (engine/lattice.py LatticeDrafts); the engine never asks which it has."""

    logits: mx.array  # (n, V): the drafter's logits

    def chain(self, sampling: Any, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """Drafts (n,) on the device; with a key (sampling) also their distribution q (n, V),
        which the acceptance rule divides by."""

    def queue(self, budget: int, branching: int | None, temperature: float, constrained: bool):
        """Queue the pass (mx.async_eval) with what the tree of these arguments will read
        from the device, so that one wait finds it computed (the host looks for lookup
        branches meanwhile)."""

    def tree(self, root: int, budget: int, branching: int | None, temperature: float) -> Any:
        """The best-first tree (engine/tree.py Tree) of at most budget + 1 nodes after
        `root`, at most `branching` children a node (None: no limit)."""

    def constrained_tree(
        self,
        root: int,
        budget: int,
        branching: int | None,
        temperature: float,
        grammar: Any,
        tokens_left: int,
        cut: Any,
    ) -> tuple[Any, int]:
        """Under a grammar (engine/grammar.py): (a tree of what it allows with its forced
        runs, cut by the budget policy's `cut`; nodes pruned). No node deeper than `tokens_left`."""


class Drafter(Protocol):
    """A draft source fed with the target's taps (KV injection): a DFlash drafter, or a test's
    oracle. It holds context for exactly the positions the target's cache holds."""

    block_size: int
    # The answers of the target it was trained on, shipped beside it (a lookup corpus file,
    # engine/corpus.py), or None: lookup reads it where GenerationConfig names no corpus.
    corpus_file: str | None

    @property
    def context_len(self) -> int: ...

    def reset(self, length: int = 0) -> None:
        """Forget context from `length` on (the Session rewound to a shorter prefix)."""

    def add_context(self, taps: mx.array) -> None:
        """Taps (T, n_taps * H) of T newly committed positions."""

    def propose(self, last_token: int, start: int, n: int) -> Proposal:
        """The n positions start+1..start+n, from one drafter pass."""

    def propose_together(self, asks: list[DraftAsk]) -> list[Proposal]:
        """Batched rows' drafter passes (this drafter's among them) as one packed pass where
        they share a drafter, each row's Proposal as its own pass would give it."""


@dataclass
class DraftAsk:
    """A batched row's drafter pass waiting for the packed one (engine/batch.py)."""

    drafter: Drafter
    last_token: int
    start: int
    n: int


class World(Protocol):
    """Where host decisions are agreed: one process (distributed.LocalWorld), or the ranks of
    a sharded target (distributed.World), where rank 0 decides and broadcasts."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    @property
    def sharded(self) -> bool: ...

    def agree(self, values: Any) -> np.ndarray: ...

    def all_min(self, value: int) -> int: ...

    def all_true(self, flag: bool) -> bool: ...

    def agree_seq(self, values: Any) -> np.ndarray: ...

    def agree_device(self, x: mx.array) -> mx.array: ...

    def heartbeat(self) -> None: ...

    def idle(self) -> AbstractContextManager[Any]: ...

    def send_text(self, text: str | None) -> str | None: ...


class TargetModel(Protocol):
    """The model whose output the engine reproduces exactly."""

    tokenizer: Any
    config: dict
    model_type: str
    vocab_size: int
    model: Any  # the mlx-lm module (Metal's wired limit sizes itself from its weights)

    @property
    def world(self) -> World:
        """Where this target's host decisions are agreed (distributed.LOCAL when unsharded)."""

    @property
    def runs_alone(self) -> bool:
        """Whether its forwards run as soon as they are asked for, for this caller alone: not
        a row of a batch (engine/batch.py) waiting for the others, nor a target sharded over
        ranks that agree every host decision. Plain decoding then keeps a step in flight."""

    @property
    def batcher(self) -> Any:
        """The Batcher its forwards join (engine/batch.py), or None: forwards of its own."""

    @property
    def unbatched(self) -> TargetModel:
        """The target itself, outside any batch (the auto budget times its own forwards)."""

    @property
    def forward_paths(self) -> str:
        """Which forward paths it runs, in a few characters ("" for stock ones): row padding
        on the CPU, the verify kernel's choices on Metal. A verify profile measured under one
        choice does not price another, so the profile's cache name includes it."""

    def make_cache(self, kv: Any = None, max_kv_size: int | None = None) -> list[Any]:
        """One Cache per layer (kv: a quantized KV cache's settings, models/cache.py)."""

    def new_arena(self) -> Any:
        """A KV buffer the rows of a batch share (models/arena.py), or None."""

    def forward(self, passes: list[Pass]) -> list[tuple[mx.array | None, mx.array | None]]:
        """Each pass's (logits, taps): T tokens after `start` cached positions, a causal block
        or a tree given by `parents` (models/forward.py). One pass runs alone; several (a
        batch's rows) run as one packed forward, weights read once for all, each row's result
        as its own forward would give it."""
