"""Key/value caches that speculative decoding can rewind.

Verification writes K/V for every drafted token; only the accepted ones may stay. A linear
block keeps a prefix (`trim`), a tree keeps one root-to-leaf path scattered through the
window (`compact`). Storage grows in steps so appends rarely reallocate.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """One attention layer's keys and values, shaped (1, n_kv_heads, capacity, head_dim)."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write new rows after the current offset; return all valid rows."""
        n = keys.shape[2]
        needed = self.offset + n
        if self.keys is None or needed > self.keys.shape[2]:
            capacity = ((needed + self.step - 1) // self.step) * self.step
            k_shape = (*keys.shape[:2], capacity, keys.shape[3])
            v_shape = (*values.shape[:2], capacity, values.shape[3])
            new_k = mx.zeros(k_shape, keys.dtype)
            new_v = mx.zeros(v_shape, values.dtype)
            if self.keys is not None and self.offset:
                new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
                new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., self.offset : needed, :] = keys
        self.values[..., self.offset : needed, :] = values
        self.offset = needed
        return self.keys[..., :needed, :], self.values[..., :needed, :]

    def extend(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """All valid rows followed by these, without keeping them (the next append writes
        over them): a drafter's block attends to them once, and nothing is concatenated."""
        out = self.append(keys, values)
        self.offset -= keys.shape[2]
        return out

    def rewind_point(self, length: int) -> int:
        return length

    def snapshot(self) -> None:
        """Nothing to do: a KV cache can always be trimmed."""

    def trim(self, length: int) -> None:
        """Forget every row from `length` on (rejected drafts)."""
        self.offset = max(0, min(self.offset, length))

    def compact(self, start: int, keep: mx.array | list[int]) -> None:
        """Keep rows start+keep[i] (increasing), moved to start+i; drop the rest of the window."""
        keep = mx.array(keep, dtype=mx.int32) if not isinstance(keep, mx.array) else keep
        n = keep.shape[0]
        if self.keys is None:
            return
        rows = start + keep
        self.keys[..., start : start + n, :] = self.keys[..., rows, :]
        self.values[..., start : start + n, :] = self.values[..., rows, :]
        self.offset = start + n

    @property
    def state_arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]
