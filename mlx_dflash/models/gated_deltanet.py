"""Gated DeltaNet layers (Qwen3.5 / Qwen3.6 / Qwen3-Next) under speculative verification.

A recurrent layer cannot be trimmed like a KV cache: after a partially accepted verify its
state must be the state after the accepted tokens only (docs/hybrid.md). Every verify here
treats its tokens as a tree given by parent indices (a linear block is the chain
parents[i] = i - 1): each node's recurrent state starts from its parent's, and its causal conv
window runs along its ancestor path. The forward records a tape per node (k, g, delta); the
commit replays the accepted path's tape from the snapshot taken before the verify, and takes
the conv state from the accepted inputs. No full state per step is kept beyond one tree level.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from ..errors import DFlashError
from ..kernels.gated_delta import replay, tree_recurrence
from ..kernels.tree_attention import tree_depths


class RecurrentCache:
    """Conv window + recurrent state of one Gated DeltaNet layer, rewindable to one verify."""

    def __init__(self) -> None:
        self.conv: mx.array | None = None  # (1, K-1, conv_dim): last inputs before `offset`
        self.state: mx.array | None = None  # (1, Hv, Dv, Dk) float32
        self.offset = 0
        self.pending: dict[str, Any] | None = None  # the last verify's tape, until committed
        # (conv, state, offset) after the last prompt
        self.snapshot_state: tuple[mx.array | None, mx.array | None, int] | None = None

    def rewind_point(self, length: int) -> int:
        """The longest prefix <= length this layer can return to: inside its last linear
        verify, or the snapshot taken after the last prompt (what chat turns reuse), or 0."""
        p = self.pending
        if length >= self.offset or (p is not None and p["chain"] and p["start"] <= length):
            return length
        snap = self.snapshot_state
        return snap[2] if snap is not None and snap[2] <= length else 0

    def snapshot(self) -> None:
        """Remember the state here (after a prompt) so a later turn can rewind to it."""
        if self.pending is None:
            self.snapshot_state = (self.conv, self.state, self.offset)

    def reset(self) -> None:
        self.conv = self.state = self.pending = self.snapshot_state = None
        self.offset = 0

    def trim(self, length: int) -> None:
        """Keep the first `length` positions: within a linear verify, its accepted prefix;
        else the snapshot when it sits exactly there; else only 0 (a fresh start)."""
        p, snap = self.pending, self.snapshot_state
        if p is not None and p["chain"] and length >= p["start"]:
            self.commit(list(range(min(length, self.offset) - p["start"])))
        elif length >= self.offset:
            return
        elif length == 0:
            self.reset()
        elif snap is not None and snap[2] == length:
            self.conv, self.state, self.offset = snap
            self.pending = None
        else:
            raise DFlashError("A recurrent layer cannot rewind past its last verify.")

    def compact(self, start: int, keep) -> None:
        """Keep the tree nodes `keep` (a root-to-node path) of the verify that began at start."""
        keep = [int(i) for i in (np.array(keep) if isinstance(keep, mx.array) else keep)]
        if self.pending is None or self.pending["start"] != start:
            raise DFlashError("Nothing to compact: the last verify did not start there.")
        self.commit(keep)

    def commit(self, path: list[int]) -> None:
        """State after the nodes of `path` (root first, each the parent of the next)."""
        p = self.pending
        if p is None:
            raise DFlashError("Nothing to commit: no verify is pending.")
        self.state = replay(p["state0"], p["k"], p["g"], p["delta"], path)[None]
        # Conv window: the last K-1 inputs along the accepted path (pre-verify rows first).
        rows = (
            mx.concatenate([p["conv0"][0], p["inputs"][mx.array(path, dtype=mx.int32)]])
            if path
            else p["conv0"][0]
        )
        self.conv = rows[-p["conv0"].shape[1] :][None]
        self.offset = p["start"] + len(path)
        self.pending = None

    @property
    def state_arrays(self) -> list[mx.array]:
        return [a for a in (self.conv, self.state) if a is not None]

    def saved(self) -> tuple[dict[str, mx.array], dict]:
        """What a prompt cache file holds of this layer (prompt_cache.py): the state after the
        prompt and the snapshot a later turn rewinds to."""
        if self.pending is not None:
            raise DFlashError("A recurrent layer is saved between rounds, not inside a verify.")
        snap = self.snapshot_state or (None, None, -1)
        named = {"conv": self.conv, "state": self.state, "snap_conv": snap[0],
                 "snap_state": snap[1]}  # fmt: skip
        arrays = {k: a for k, a in named.items() if a is not None}
        return arrays, {"offset": self.offset, "snap_offset": snap[2]}

    def restore(self, arrays: dict[str, mx.array], meta: dict) -> None:
        self.conv, self.state = arrays.get("conv"), arrays.get("state")
        self.offset, self.pending = int(meta["offset"]), None
        snap = int(meta["snap_offset"])
        self.snapshot_state = None
        if snap >= 0:
            self.snapshot_state = (arrays.get("snap_conv"), arrays.get("snap_state"), snap)


def _projections(layer, x: mx.array):
    """qkv (conv input), z, b, a for both module layouts (Qwen3.5 split / Qwen3-Next fused)."""
    B, T, _ = x.shape
    if hasattr(layer, "in_proj_qkv"):
        qkv = layer.in_proj_qkv(x)
        z = layer.in_proj_z(x).reshape(B, T, layer.num_v_heads, layer.head_v_dim)
        return qkv, z, layer.in_proj_b(x), layer.in_proj_a(x)
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(x), layer.in_proj_ba(x)
    )
    qkv = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
    return qkv, z, b, a


def _split_qkv(layer, conv_out: mx.array):
    T = conv_out.shape[0]
    q, k, v = mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], axis=-1)
    q = q.reshape(T, layer.num_k_heads, layer.head_k_dim)
    k = k.reshape(T, layer.num_k_heads, layer.head_k_dim)
    v = v.reshape(T, layer.num_v_heads, layer.head_v_dim)
    return normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6) + (v,)


def conv_window_index(parents: np.ndarray, kernel: int) -> np.ndarray:
    """(T, K) rows into [conv state (K-1 rows) ; tree inputs (T rows)] that feed each node.

    Column K-1 is the node itself, column K-1-m its m-th ancestor; past the root the window
    continues into the pre-verify conv state, newest row (K-2) first.
    """
    return _conv_windows(np.asarray(parents, dtype=np.int64).tobytes(), kernel)


@lru_cache(maxsize=16)
def _conv_windows(parents_bytes: bytes, kernel: int) -> np.ndarray:
    """Computed once per verify, not once per layer."""
    parents = np.frombuffer(parents_bytes, dtype=np.int64)
    T = len(parents)
    depth = tree_depths(parents)
    idx = np.zeros((T, kernel), dtype=np.int32)
    for i in range(T):
        node = i
        for m in range(kernel):
            if m <= depth[i]:
                idx[i, kernel - 1 - m] = kernel - 1 + node
                node = parents[node] if m < depth[i] else node
            else:
                idx[i, kernel - 1 - m] = (kernel - 1) - (m - depth[i])
    return idx


def gdn_forward(layer, x: mx.array, cache: RecurrentCache, start: int, parents, rewindable: bool):
    """One Gated DeltaNet layer over T tokens after `start`; parents=None is a causal chain.

    rewindable=False (prefill, plain decoding) commits straight away through mlx-lm's own
    recurrence; otherwise the verify is recorded for a later trim/compact.
    """
    B, T, _ = x.shape
    qkv, z, b, a = _projections(layer, x)
    K = layer.conv_kernel_size
    conv0 = cache.conv if cache.conv is not None else mx.zeros((1, K - 1, layer.conv_dim), x.dtype)
    state0 = (
        cache.state
        if cache.state is not None
        else mx.zeros((1, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), mx.float32)
    )
    if cache.offset != start:
        raise DFlashError("Recurrent cache out of sync with the target position.")
    w = layer.conv1d.weight[:, :, 0]  # (conv_dim, K): depthwise kernel
    if not rewindable and parents is None:
        conv_in = mx.concatenate([conv0, qkv], axis=1)
        conv_out = nn.silu(layer.conv1d(conv_in))[0]
        q, k, v = _split_qkv(layer, conv_out)
        out, state = gated_delta_update(
            q[None],
            k[None],
            v[None],
            a,
            b,
            layer.A_log,
            layer.dt_bias,
            state0,
            None,
            use_kernel=True,
        )
        cache.conv = conv_in[:, -(K - 1) :]
        cache.state = state
        cache.pending = None
    else:
        chain = parents is None
        parents = np.arange(-1, T - 1) if chain else np.asarray(parents)
        rows = mx.concatenate([conv0[0], qkv[0]])  # (K-1+T, conv_dim)
        window = rows[mx.array(conv_window_index(parents, K))]  # (T, K, conv_dim)
        conv_out = nn.silu((window * w.T[None]).sum(axis=1))
        q, k, v = _split_qkv(layer, conv_out)  # q, k keep Hk heads: the kernels map hv -> hk
        beta = mx.sigmoid(b[0])
        g = compute_g(layer.A_log, a[0], layer.dt_bias)
        y, delta = tree_recurrence(q, k, v, g, beta, state0[0], parents)
        cache.pending = dict(
            start=start,
            chain=chain,
            state0=state0[0],
            conv0=conv0,
            inputs=qkv[0],
            k=k,
            g=g,
            delta=delta,
        )
        out = y[None].astype(x.dtype)
    cache.offset = start + T
    return _reduced(layer, layer.out_proj(layer.norm(out, z).reshape(B, T, -1)))


def _reduced(layer, out: mx.array) -> mx.array:
    """Sum the heads' shares over the ranks when mlx-lm sharded this layer (Qwen3.5's shard
    splits the heads and leaves the all-reduce to the layer's own call, which we replace)."""
    group = getattr(layer, "sharding_group", None)
    return out if group is None else mx.distributed.all_sum(out, group=group)


# mypy checks RecurrentCache against the engine's Cache protocol (engine/contract.py)
if TYPE_CHECKING:
    from ..engine.contract import Cache

    _conforms_recurrentcache: type[Cache] = RecurrentCache
