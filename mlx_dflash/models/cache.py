"""Key/value caches that speculative decoding can rewind.

Verification writes K/V for every drafted token; only the accepted ones may stay. A linear
block keeps a prefix (`trim`), a tree keeps one root-to-leaf path scattered through the
window (`compact`). Storage grows in steps so appends rarely reallocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from ..engine.contract import in_place
from ..errors import DFlashError


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
        k_buf, v_buf = self.keys, self.values
        if k_buf is None or v_buf is None or needed > k_buf.shape[2]:
            capacity = ((needed + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((*keys.shape[:2], capacity, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((*values.shape[:2], capacity, values.shape[3]), values.dtype)
            if k_buf is not None and v_buf is not None and self.offset:
                new_k[..., : self.offset, :] = k_buf[..., : self.offset, :]
                new_v[..., : self.offset, :] = v_buf[..., : self.offset, :]
            self.keys, self.values = k_buf, v_buf = new_k, new_v
        # (1, heads, positions, dim): written without an Ellipsis, whose parsing cost MLX's
        # indexing 1.5 us an access (every layer of every forward)
        k_buf[:, :, self.offset : needed] = keys
        v_buf[:, :, self.offset : needed] = values
        self.offset = needed
        return k_buf[:, :, :needed], v_buf[:, :, :needed]

    def rewind_point(self, length: int) -> int:
        return length

    def snapshot(self) -> None:
        """Nothing to do: a KV cache can always be trimmed."""

    def trim(self, length: int) -> None:
        """Forget every row from `length` on (rejected drafts)."""
        self.offset = max(0, min(self.offset, length))

    def compact(self, start: int, keep: mx.array | list[int]) -> None:
        """Keep rows start+keep[i] (increasing), moved to start+i; drop the rest of the window.
        (Every array of `state_arrays` holds a row per position: QuantizedKVCache's too.)"""
        buffers = self.state_arrays
        if not buffers:
            return
        if in_place(keep):
            self.offset = start + len(keep)
            return
        keep = mx.array(keep, dtype=mx.int32) if not isinstance(keep, mx.array) else keep
        n = keep.shape[0]
        rows = start + keep
        for a in buffers:  # (take, not a[..., rows, :]: its index parsing was ~4x the build)
            a[..., start : start + n, :] = mx.take(a, rows, axis=-2)
        self.offset = start + n

    @property
    def state_arrays(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    def saved(self) -> tuple[dict[str, mx.array], dict]:
        """What a prompt cache file holds of this layer (prompt_cache.py): the valid rows, and
        the numbers that place them."""
        arrays = {}
        if self.keys is not None and self.values is not None:
            arrays = {"keys": self.keys[..., : self.offset, :],
                      "values": self.values[..., : self.offset, :]}  # fmt: skip
        return arrays, {"offset": self.offset, "dropped": getattr(self, "dropped", 0)}

    def restore(self, arrays: dict[str, mx.array], meta: dict) -> None:
        """This layer as `saved` left it (on a cache made as the saved one was)."""
        self.keys, self.values = arrays.get("keys"), arrays.get("values")
        self.offset = int(meta["offset"])
        if hasattr(self, "dropped"):
            self.dropped = int(meta["dropped"])


class WindowedKVCache(KVCache):
    """A sliding-window layer's keys and values (Gemma 4, gpt-oss, MiMo, Muse Glimmer): only the
    newest `window` positions are ever attended to, so older rows are dropped, amortised (the
    buffer is cut once it holds `window` rows too many), and memory stays bounded.

    Rows are held for positions [0, keep) (none here; RotatingKVCache's sinks) and
    [dropped, end). A verify starting at `end` only needs rows from end - window + 1 on, and a
    rewind never goes before the verify's start, so dropping before an append is always safe.
    A later turn rewinds to where its prompt leaves the cached tokens, which is near the end
    (the new prompt carries the answer); a rewind to a point whose window is gone returns 0
    (`rewind_point`), so the prompt is computed again rather than read wrong.
    """

    keep = 0  # the first positions, always held

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = int(window)
        self.dropped = self.keep  # the first position held after those

    @property
    def end(self) -> int:
        return self.offset + self.dropped - self.keep

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write new rows after `end`; return the rows held (the first `keep`, dropped..end)."""
        self._drop()
        return super().append(keys, values)

    def _drop(self) -> None:
        cut = self.end - self.window + 1 - self.dropped  # positions no query will see
        if cut < self.window or self.keys is None or self.values is None:
            return
        k, a, b = self.keep, self.keep + cut, self.offset

        def held(x: mx.array) -> mx.array:
            if not k:
                return mx.contiguous(x[..., a:b, :])
            return mx.concatenate([x[..., :k, :], x[..., a:b, :]], axis=2)

        self.keys, self.values = held(self.keys), held(self.values)
        self.dropped += cut
        self.offset -= cut

    def rewind_point(self, length: int) -> int:
        """`length` while what a forward from there sees is held, else 0 (compute it again)."""
        ok = self.dropped == self.keep or length - self.window + 1 >= self.dropped
        return length if ok else 0

    def trim(self, length: int) -> None:
        """Keep the positions before `length` (absolute); before the held rows: start over."""
        if length < self.dropped and self.dropped > self.keep:
            self.keys = self.values = None
            self.dropped, self.offset = self.keep, 0
        else:
            self.offset = max(0, min(self.offset, length - (self.dropped - self.keep)))

    def compact(self, start: int, keep: mx.array | list[int]) -> None:
        super().compact(start - (self.dropped - self.keep), keep)


class RotatingKVCache(WindowedKVCache):
    """mlx-lm's --max-kv-size (its RotatingKVCache, keep=4): at most `max_size` positions of
    keys and values, the first `keep` ("attention sinks") always among them, under verify and
    rewind.

    Rows are held for positions [0, keep) and [dropped, end): the sinks, then a window of
    max_size - keep that is cut, amortised, to what the next forward can see. What a query
    sees is mlx-lm's (`rotating_mask`): a one-token step at position p sees the sinks and the
    newest max_size - keep positions up to p, and every row of a verify stands for such a
    step; a prompt chunk sees what mlx-lm's concatenated buffer shows it, a window of max_size
    over the buffer's order: a WindowedKVCache with sinks, that models/attention.py tells
    apart first, to mask as mlx-lm does."""

    def __init__(self, max_size: int, keep: int = 4) -> None:
        if max_size <= keep:
            raise DFlashError(f"--max-kv-size must be more than {keep}, not {max_size}.")
        self.max_size, self.keep = int(max_size), int(keep)
        super().__init__(self.max_size - self.keep)

    def positions(self) -> mx.array:
        """The position of every row held before this forward's (sinks, then the window)."""
        if self.dropped == self.keep:
            return mx.arange(self.offset)
        return mx.concatenate([mx.arange(self.keep), mx.arange(self.dropped, self.end)])

    def saved(self) -> tuple[dict[str, mx.array], dict]:
        arrays, meta = super().saved()
        return arrays, {**meta, "max_size": self.max_size}

    def restore(self, arrays: dict[str, mx.array], meta: dict) -> None:
        if meta.get("max_size") != self.max_size:
            raise DFlashError(
                f"The prompt cache was made with --max-kv-size {meta.get('max_size')}; give the "
                "same."
            )
        super().restore(arrays, meta)


def rotating_mask(cache: RotatingKVCache, start: int, T: int, positions, parents, verify: bool):
    """Boolean (T, held + T) mask of what each of a forward's T queries sees in a
    RotatingKVCache (called after the append), as mlx-lm's RotatingKVCache shows it.

    A verify's rows and a one-token step are steps at their positions p: the sinks and the
    positions after p - (max_size - keep). A prompt chunk of T > 1 at offset o is mlx-lm's
    concatenated forward: from o >= max_size - 1 on its buffer is the sinks, the newest
    max_size - keep - 1 earlier positions and the chunk, and row j sees buffer entries j..;
    so the sinks from j on and the positions from max(p - max_size, o - max_size + keep) + 1;
    before that, a plain window of max_size positions."""
    from ..kernels.tree_attention import ancestor_mask

    before = cache.positions()[: cache.offset - T]
    q_pos = start + mx.arange(T) if positions is None else positions
    k_pos = mx.concatenate([before, q_pos])
    prefix = mx.ones((T, before.shape[0]), dtype=mx.bool_)
    own = mx.tril(mx.ones((T, T), dtype=mx.bool_)) if parents is None else ancestor_mask(parents, 0)
    base = mx.concatenate([prefix, own], axis=1)
    qp, kp = q_pos[:, None], k_pos[None, :]
    size, keep = cache.max_size, cache.keep
    if verify or T == 1:
        seen = (kp < keep) | (kp > qp - cache.window)
    elif start <= size - 1:
        seen = kp > qp - size
    else:
        j = qp - start
        first = mx.maximum(qp - size + 1, start - size + 1 + keep)
        seen = mx.where(kp < keep, kp >= j, kp >= first)
    return base & seen


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's --kv-bits, --kv-group-size and --quantized-kv-start: a layer's keys and values
    are held quantized (MLX's affine quantization along the head dimension) once the context
    reaches `start` tokens."""

    bits: int
    group_size: int = 64
    start: int = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise DFlashError(f"--kv-bits must be 2, 3, 4, 5, 6 or 8, not {self.bits}.")
        if self.group_size not in (32, 64, 128):
            raise DFlashError(f"--kv-group-size must be 32, 64 or 128, not {self.group_size}.")
        if self.start < 0:
            raise DFlashError(f"--quantized-kv-start must be >= 0, not {self.start}.")


class QuantizedKVCache(KVCache):
    """An attention layer's keys and values as mlx-lm's QuantizedKVCache holds them, under
    verify and rewind.

    mlx-lm quantizes a layer's cache after a forward that leaves it holding `start` tokens or
    more; every later forward quantizes its own keys and values before attending over the whole
    quantized cache. Here the float rows are kept until the first append at or past `start`
    (the next forward, which is the same point), then quantized at once, as mlx-lm's
    `to_quantized` does. A quantized row is a token's packed words, scales and biases: groups
    run along the head dimension, so every row is quantized alone, and `trim` and `compact`
    move or drop whole rows; no group ever mixes a kept token with a rejected one (a verify
    across `start`: models/attention.py _attend_quantized)."""

    def __init__(self, quant: KVQuantization) -> None:
        super().__init__()
        self.quant = quant
        self.packed: tuple[list[mx.array], list[mx.array]] | None = None  # (keys, values)

    @property
    def quantized(self) -> bool:
        return self.packed is not None

    def quantize(self, x: mx.array) -> list[mx.array]:
        """(words, scales, biases) of float rows x (..., T, D)."""
        return list(mx.quantize(x, group_size=self.quant.group_size, bits=self.quant.bits))

    def append(self, keys: mx.array, values: mx.array):
        """Write new rows after the offset; return every valid row: float (keys, values) before
        the cache is quantized, else each as its (words, scales, biases)."""
        if self.packed is None and self.offset >= self.quant.start and self.offset > 0:
            self._to_quantized()
        if self.packed is None:
            return super().append(keys, values)
        n = keys.shape[2]
        needed = self.offset + n
        k_buf, v_buf = self.packed
        if needed > k_buf[0].shape[2]:
            grow = ((needed + self.step - 1) // self.step) * self.step - k_buf[0].shape[2]
            self.packed = k_buf, v_buf = (
                [_grown(a, grow) for a in k_buf],
                [_grown(a, grow) for a in v_buf],
            )
        for buf, new in ((k_buf, self.quantize(keys)), (v_buf, self.quantize(values))):
            for a, b in zip(buf, new, strict=True):
                a[:, :, self.offset : needed] = b  # (1, heads, positions, words): as KVCache
        self.offset = needed
        return [a[:, :, :needed] for a in k_buf], [a[:, :, :needed] for a in v_buf]

    def _to_quantized(self) -> None:
        assert self.keys is not None and self.values is not None
        self.packed = (self.quantize(self.keys), self.quantize(self.values))
        self.keys = self.values = None

    @property
    def state_arrays(self) -> list[mx.array]:
        if self.packed is None:
            return super().state_arrays
        return [*self.packed[0], *self.packed[1]]

    def saved(self) -> tuple[dict[str, mx.array], dict]:
        if self.packed is None:
            return super().saved()
        n = self.offset
        keys, values = self.packed
        arrays = {f"k{i}": a[..., :n, :] for i, a in enumerate(keys)}
        arrays.update({f"v{i}": a[..., :n, :] for i, a in enumerate(values)})
        q = self.quant
        return arrays, {"offset": n, "bits": q.bits, "group_size": q.group_size}

    def restore(self, arrays: dict[str, mx.array], meta: dict) -> None:
        if "bits" not in meta:
            super().restore(arrays, meta)
            return
        if (meta["bits"], meta["group_size"]) != (self.quant.bits, self.quant.group_size):
            raise DFlashError(
                f"The prompt cache holds keys and values at {meta['bits']} bits, group "
                f"{meta['group_size']}: give the same --kv-bits and --kv-group-size."
            )
        self.packed = ([arrays[f"k{i}"] for i in range(3)], [arrays[f"v{i}"] for i in range(3)])
        self.offset = int(meta["offset"])

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (its whole buffer)."""
        return sum(a.nbytes for a in self.state_arrays)


def _grown(a: mx.array, rows: int) -> mx.array:
    return mx.concatenate([a, mx.zeros((*a.shape[:2], rows, a.shape[3]), a.dtype)], axis=2)


class ContextCache(KVCache):
    """A drafter layer's context rows, for absolute positions [dropped, end).

    With `window` (a sliding-window drafter: every layer sees at most `window` rows before a
    block), rows older than that are dropped, amortised: the buffer is cut back to `window`
    rows once it holds twice as many. A rewind to before the dropped rows leaves an empty
    context that starts there: drafts see less until new rows come, the output is unchanged.
    """

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.dropped = 0  # positions before the first row held

    @property
    def end(self) -> int:
        """The position after the last context row."""
        return self.dropped + self.offset

    @property
    def visible(self) -> int:
        """Rows a block attends to: the newest `window` (all, without a window)."""
        return self.offset if self.window is None else min(self.offset, self.window)

    def skip(self, n: int) -> None:
        """Forget every row and move the end n positions on (rows nobody will see)."""
        self.dropped = self.end + n
        self.offset = 0

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = super().append(keys, values)
        w = self.window
        if w is not None and self.offset >= 2 * w and self.keys is not None:
            assert self.values is not None
            cut = self.offset - w
            self.keys = mx.contiguous(self.keys[..., cut : self.offset, :])
            self.values = mx.contiguous(self.values[..., cut : self.offset, :])
            self.dropped += cut
            self.offset = w
            out = self.keys, self.values
        return out

    def extend(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The visible rows followed by these, without keeping them (the next append writes
        over them): a drafter's block attends to them once, and nothing is concatenated."""
        k, v = KVCache.append(self, keys, values)  # never cut the buffer under a block
        self.offset -= keys.shape[2]
        first = self.offset - self.visible
        return k[:, :, first:], v[:, :, first:]

    def trim(self, length: int) -> None:
        """Keep the positions before `length` (absolute)."""
        if length < self.dropped:
            self.dropped, self.offset = max(0, length), 0
        else:
            self.offset = min(self.offset, length - self.dropped)


# mypy checks KVCache against the engine's Cache protocol (engine/contract.py)
if TYPE_CHECKING:
    from ..engine.contract import Cache

    _conforms_kvcache: type[Cache] = KVCache
