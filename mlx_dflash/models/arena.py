"""One key/value buffer per attention layer shared by the rows of a batch (engine/batch.py).

A packed forward (models/forward.py) reads every weight once for all rows, but with each row's
cache its own array, attention ran row by row: ~15 small MLX ops per row per layer, ~120 us
a row's layer on the CPU backend whatever their size, the whole gap between 8 one-token rows packed and
one 8-token row (docs/batching.md). Here the rows' keys and values live in one (slots, kv
heads, capacity, head dim) buffer per layer, a row a slot: a layer writes every row's new keys
with one scatter, and the rows taking a one-token causal step (plain decoding, the most common
pass in a batch) attend in one batched attention over the buffer, whatever their number. Trees
and blocks still attend row by row, over a view of their slot.

Each slot is a `SlotCache`, the engine's Cache over its rows of the buffer; caches move in
and out with `adopt` and `release` (docs/batching.md, "A KV arena shared by the rows"). A
buffer is updated in place only while nothing else refers to it (MLX copies it otherwise), so
within a layer every write goes in before any read, and `release` evaluates what it copies out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..engine.contract import in_place
from ..kernels.cpu_attention import LOG2E, use_cpu_attention
from .cache import KVCache


class KVArena:
    """The shared buffers, one per attention layer, and which slots are taken."""

    step = 256  # capacity grows in steps, as a KVCache's does
    # Every slot is as long as the longest, so a row past this many positions leaves the
    # arena (engine/batch.py): memory stays slots x max_rows per layer, and at such lengths
    # attention is the row's arithmetic, not small ops, so the shared buffer saves nothing.
    max_rows = 2048

    def __init__(self, layers: list[int] | None = None) -> None:
        """`layers`: the standard attention layers it holds (all plain KV layers if None)."""
        self.layers = None if layers is None else set(layers)
        self.keys: dict[int, mx.array] = {}
        self.values: dict[int, mx.array] = {}
        self._free: list[int] = []
        self._slots = 0

    # -- rows in and out ---------------------------------------------------------------------

    def adopt(self, cache: list) -> bool:
        """Move a session's plain KV caches into a free slot (in place in `cache`); False if
        it holds none (windowed, MLA and recurrent layers keep their own caches)."""
        mine = self.layers
        layers = [
            i for i, c in enumerate(cache) if type(c) is KVCache and (mine is None or i in mine)
        ]
        if not layers:
            return False
        slot = self._free.pop() if self._free else self._new_slot()
        for i in layers:
            old, new = cache[i], SlotCache(self, i, slot)
            if old.offset and old.keys is not None and old.values is not None:
                new.append(old.keys[..., : old.offset, :], old.values[..., : old.offset, :])
            cache[i] = new
        return True

    def release(self, cache: list) -> None:
        """Copy a row's slots back out to KVCaches (in place) and free the slot."""
        out, slot = [], None
        for i, c in enumerate(cache):
            if isinstance(c, SlotCache) and c.arena is self:
                kv = KVCache()
                if c.offset:
                    kv.append(*c.held(0))
                    out += kv.state_arrays
                cache[i], slot = kv, c.slot
        mx.eval(out)  # detached from the buffers before their next in-place write
        if slot is not None:
            self._free.append(slot)
        if len(self._free) == self._slots:  # nobody left: give the memory back
            self.keys.clear()
            self.values.clear()
            self._free, self._slots = [], 0

    def _new_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    # -- storage -----------------------------------------------------------------------------

    def reserve(self, layer: int, slots: int, length: int, like_k, like_v) -> None:
        """Make layer's buffers hold `slots` slots of `length` rows (copying what they hold)."""
        k = self.keys.get(layer)
        if k is not None and k.shape[0] >= slots and k.shape[2] >= length:
            return
        v = self.values.get(layer)
        n_slots = max(slots, self._slots, 0 if k is None else k.shape[0])
        cap = max(length, 0 if k is None else k.shape[2])
        cap = ((cap + self.step - 1) // self.step) * self.step
        new_k = mx.zeros((n_slots, like_k.shape[1], cap, like_k.shape[-1]), like_k.dtype)
        new_v = mx.zeros((n_slots, like_v.shape[1], cap, like_v.shape[-1]), like_v.dtype)
        if k is not None and v is not None:
            new_k[: k.shape[0], :, : k.shape[2]] = k
            new_v[: v.shape[0], :, : v.shape[2]] = v
        self.keys[layer], self.values[layer] = new_k, new_v

    def write(self, layer: int, slots: mx.array, rows: mx.array, k, v, top: int, need: int):
        """Every row's new keys and values (k, v: (1, kv, N, D)) in one scatter each: token j
        to slot slots[j], row rows[j]. `top`: the highest slot, `need`: the longest slot."""
        self.reserve(layer, top + 1, need, k, v)
        self.keys[layer][slots, :, rows] = k[0].transpose(1, 0, 2)
        self.values[layer][slots, :, rows] = v[0].transpose(1, 0, 2)


class SlotCache:
    """One layer of one row in the arena: rows 0..offset of slot `slot`."""

    def __init__(self, arena: KVArena, layer: int, slot: int) -> None:
        self.arena, self.layer, self.slot = arena, layer, slot
        self.offset = 0

    def held(self, n_new: int) -> tuple[mx.array, mx.array]:
        """(1, kv, offset + n_new, D) views of the slot's keys and values."""
        end = self.offset + n_new
        k, v = self.arena.keys[self.layer], self.arena.values[self.layer]
        return k[self.slot : self.slot + 1, :, :end], v[self.slot : self.slot + 1, :, :end]

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """A forward of this row alone: write after the offset, return every held row."""
        n = keys.shape[2]
        self.arena.reserve(self.layer, self.slot + 1, self.offset + n, keys, values)
        s, a, b = self.slot, self.offset, self.offset + n
        self.arena.keys[self.layer][s, :, a:b] = keys[0]
        self.arena.values[self.layer][s, :, a:b] = values[0]
        self.offset = b
        return self.held(0)

    def rewind_point(self, length: int) -> int:
        return length

    def snapshot(self) -> None:
        """Nothing to do: a KV cache can always be trimmed."""

    def trim(self, length: int) -> None:
        self.offset = max(0, min(self.offset, length))

    def compact(self, start: int, keep) -> None:
        """Keep rows start+keep[i] (increasing), moved to start+i (a tree's accepted path)."""
        if in_place(keep):
            self.offset = start + len(keep)
            return
        keep = mx.array(keep, dtype=mx.int32) if not isinstance(keep, mx.array) else keep
        n, rows, s = keep.shape[0], start + keep, self.slot
        for buf in (self.arena.keys, self.arena.values):
            buf[self.layer][s, :, start : start + n] = mx.take(buf[self.layer][s], rows, axis=-2)
        self.offset = start + n

    @property
    def state_arrays(self) -> list[mx.array]:
        """The slot's rows (evaluating them runs the writes; their size is what it holds)."""
        return list(self.held(0)) if self.layer in self.arena.keys else []


@dataclass
class Plan:
    """Where a packed forward's tokens go in the arena, the same for every layer: each token's
    slot and row (`slots`, `at`; `tokens`: which packed tokens they are, None for all), the
    highest slot and the longest slot after the write; and,
    when the one-token causal steps attend together, the slots lo..hi-1 they span, each slot's
    query token (`q_at`), the additive mask of its keys (`bias`, 0 up to its length, -inf
    after) and where each packed token's output sits among [the steps' slots, then the other
    rows' tokens] (`order`; None when that is the packed order)."""

    slots: mx.array
    at: mx.array
    top: int
    need: int
    steps: list[int] = field(default_factory=list)
    lo: int = 0
    hi: int = 0
    q_at: mx.array | None = None
    bias: mx.array | None = None
    order: mx.array | None = None
    tokens: mx.array | None = None  # the arena rows' packed tokens, None if every row's


def plan_forward(spans: list[tuple[int, int, bool]], caches: list, together: bool) -> Plan:
    """The Plan of rows (a, b, causal) whose caches are `caches` (before the write; a row
    whose cache is not a SlotCache attends on its own); `together`: whether this layer's
    one-token causal steps may attend as one."""
    held = [j for j, c in enumerate(caches) if isinstance(c, SlotCache)]
    slots = np.concatenate([np.full(spans[j][1] - spans[j][0], caches[j].slot) for j in held])
    at = np.concatenate([caches[j].offset + np.arange(spans[j][1] - spans[j][0]) for j in held])
    plan = Plan(mx.array(slots), mx.array(at), int(slots.max()), int(at.max()) + 1)
    if len(held) < len(spans):  # the arena rows' tokens, out of the packed ones
        plan.tokens = mx.array(np.concatenate([np.arange(*spans[j][:2]) for j in held]))
    steps = [j for j in held if spans[j][1] - spans[j][0] == 1 and spans[j][2]]
    if not together or len(steps) < 2:
        return plan
    lo = min(caches[j].slot for j in steps)
    hi = max(caches[j].slot for j in steps) + 1
    q_at = np.full(hi - lo, spans[steps[0]][0])
    lengths = np.ones(hi - lo, dtype=np.int64)
    order = np.zeros(spans[-1][1], dtype=np.int64)
    for j in steps:
        a, s = spans[j][0], caches[j].slot - lo
        q_at[s], lengths[s], order[a] = a, caches[j].offset + 1, s
    n = hi - lo
    for j, (a, b, _) in enumerate(spans):
        if j not in steps:
            order[a:b] = n + np.arange(b - a)
            n += b - a
    width = int(lengths.max())
    bias = np.where(np.arange(width)[None, :] < lengths[:, None], 0.0, -np.inf)
    plan.steps, plan.lo, plan.hi = steps, lo, hi
    plan.q_at = mx.array(q_at, dtype=mx.int32)
    plan.bias = mx.array(bias[:, None, None, :], dtype=mx.float32)
    if n != len(order) or (order != np.arange(n)).any():
        plan.order = mx.array(order, dtype=mx.int32)
    return plan


def step_attention(q, keys, values, bias: mx.array, scale: float) -> mx.array:
    """One query per slot (q (S, heads, 1, D)) over its slot's keys (keys, values (S, kv, L,
    D)), `bias` (S, 1, 1, L) masking each slot's rows past its length: cpu_attention's base-2
    softmax off Metal, exactly what the row gets alone (masked keys weigh 0, the sums may
    only add in another order); MLX's fused attention on Metal."""
    n_slots, n_q, _, d = q.shape
    n_kv = keys.shape[1]
    if not use_cpu_attention():
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=bias)
    qg = (q * (scale * LOG2E)).reshape(n_slots, n_kv, n_q // n_kv, d)
    s = qg @ keys.swapaxes(-1, -2) + bias
    p = mx.power(2.0, s - s.max(axis=-1, keepdims=True))
    out = (p @ values) / p.sum(axis=-1, keepdims=True)
    return out.reshape(n_slots, n_q, 1, values.shape[-1]).astype(q.dtype)


# mypy checks SlotCache against the engine's Cache protocol (engine/contract.py)
if TYPE_CHECKING:
    from ..engine.contract import Cache

    _conforms_slotcache: type[Cache] = SlotCache
