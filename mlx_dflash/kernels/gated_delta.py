"""Metal kernels for Gated DeltaNet verification (metal/gated_delta.metal) and their dispatch.

The MLX-ops tree recurrence (`tree_recurrence_reference` below) runs one batched step per depth level, with a gather
and a few full-state temporaries per level; its replay on commit is one op chain per accepted
node. On Apple GPUs two kernels do the same work in one launch each: `gdn_tree_verify` walks
the tree per value row with the state in registers, `gdn_tape_replay` rebuilds the state
after the accepted path. The ops code stays as the reference and the fallback for
shapes the kernels do not take and for machines without Metal.

Backend choice: DFLASH_GDN=auto (default) | metal | reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from . import dispatch as metal_kernels
from . import self_check
from .dispatch import KernelFactory
from .tree_attention import tree_depths, validate_parents

ENV_VAR = "DFLASH_GDN"
SETTING = "gdn"  # SETTINGS.gdn (settings.py)

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_KEY_DIM = 256  # the row state lives in registers: ceil(Dk / 32) floats per lane
MAX_TREE = 1024  # per-row delta log in threadgroup memory: ROWS * TMAX floats <= 16 KiB
ROWS = 4  # value rows (simdgroups) per threadgroup of gdn_tree_verify
SIMD_WIDTH = 32

_METAL_FILE = "gated_delta.metal"
_SECTIONS = ("header", "gdn_tree_verify", "gdn_tape_replay")
_IO = {
    "gdn_tree_verify": (("q", "k", "v", "g", "beta", "state0", "plan"), ("y", "delta")),
    "gdn_tape_replay": (("state0", "k", "g", "delta", "path"), ("state",)),
}


@lru_cache(maxsize=1)
def kernel_sources() -> dict[str, str]:
    """The header and kernel bodies of gated_delta.metal, keyed by section name."""
    return metal_kernels.read_sections(_METAL_FILE, _SECTIONS)


def _kernel_factory() -> KernelFactory:
    """The factory used when none is passed (a function, so tests can swap in the harness)."""
    return mx.fast.metal_kernel


def _kernel(factory: KernelFactory, which: str) -> Any:
    return metal_kernels.cached_kernel(factory, which, kernel_sources, *_IO[which])


def _heads_ok(n_hv: int, n_hk: int) -> bool:
    return n_hk > 0 and n_hv % n_hk == 0


def tree_supported(q: mx.array, k: mx.array, v: mx.array, state0: mx.array) -> bool:
    """Whether gdn_tree_verify takes these shapes and dtypes (it does not check for Metal)."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or state0.ndim != 3:
        return False
    t, n_hk, dk = k.shape
    _, n_hv, dv = v.shape
    return (
        tuple(q.shape) == tuple(k.shape)
        and v.shape[0] == t
        and 1 <= t <= MAX_TREE
        and 1 <= dk <= MAX_KEY_DIM
        and dv >= 1
        and _heads_ok(n_hv, n_hk)
        and tuple(state0.shape) == (n_hv, dv, dk)
        and all(x.dtype in SUPPORTED_DTYPES for x in (q, k, v))
    )


def replay_supported(state0: mx.array, k: mx.array, delta: mx.array) -> bool:
    """Whether gdn_tape_replay takes these shapes and dtypes (it does not check for Metal)."""
    if state0.ndim != 3 or k.ndim != 3 or delta.ndim != 3:
        return False
    n_hv, dv, dk = state0.shape
    return (
        k.shape[2] == dk
        and _heads_ok(n_hv, k.shape[1])
        and tuple(delta.shape[1:]) == (n_hv, dv)
        and k.shape[0] == delta.shape[0]
        and k.dtype in SUPPORTED_DTYPES
    )


def tree_plan(parents: Any) -> np.ndarray:
    """The node order and replay paths gdn_tree_verify follows (layout in gated_delta.metal).

    Depth-first preorder keeps a node's parent state in registers for its first child; each
    later child gets the path root .. parent to replay. Built on the host: T is small and the
    parents are already there.
    """
    p = validate_parents(parents)
    t = len(p)
    children: list[list[int]] = [[] for _ in range(t)]
    for i in range(1, t):
        children[p[i]].append(i)
    order, stack = [], [0]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children[n]))
    offsets, paths = [], []
    base, prev = 2 * t + 1, -1
    for n in order:
        offsets.append(base + len(paths))
        if p[n] >= 0 and p[n] != prev:
            path, a = [], int(p[n])
            while a >= 0:
                path.append(a)
                a = int(p[a])
            paths.extend(reversed(path))
        prev = n
    offsets.append(base + len(paths))
    return np.array(order + offsets + paths + [0], dtype=np.int32)


def _tree_max(t: int) -> int:
    """TMAX: a power of two >= T (at least 32), so few variants get compiled."""
    return max(SIMD_WIDTH, 1 << (t - 1).bit_length())


def gdn_tree_verify(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state0: mx.array,
    parents: Any,
    *,
    kernel_factory: KernelFactory | None = None,
) -> tuple[mx.array, mx.array]:
    """The gdn_tree_verify kernel: y and delta (T, Hv, Dv) float32, as tree_recurrence.

    q, k: (T, Hk, Dk) with Hv % Hk == 0 (heads shared as mx.repeat would); kernel_factory
    defaults to mx.fast.metal_kernel, tests pass the CPU harness's drop-in.
    """
    if not tree_supported(q, k, v, state0):
        raise ValueError(
            f"gdn_tree_verify cannot take q {q.shape} {q.dtype}, k {k.shape}, v {v.shape}, "
            f"state0 {state0.shape}"
        )
    t, n_hv, dv = v.shape
    if tuple(g.shape) != (t, n_hv) or tuple(beta.shape) != (t, n_hv):
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be (T, Hv) = {(t, n_hv)}")
    parents = validate_parents(parents)
    if len(parents) != t:
        raise ValueError(f"parents describe {len(parents)} nodes, q/k/v have {t}")
    plan = tree_plan(parents)
    dt = q.dtype if k.dtype == q.dtype == v.dtype else mx.float32
    q, k, v = (x.astype(dt) for x in (q, k, v))
    factory = kernel_factory or _kernel_factory()
    y, delta = _kernel(factory, "gdn_tree_verify")(
        inputs=[
            q,
            k,
            v,
            g.astype(mx.float32),
            beta.astype(mx.float32),
            state0.astype(mx.float32),
            mx.array(plan),
        ],
        template=[("InT", dt), ("DK", k.shape[2]), ("NSG", ROWS), ("TMAX", _tree_max(t))],
        grid=(SIMD_WIDTH, dv, n_hv),
        threadgroup=(SIMD_WIDTH, ROWS, 1),
        output_shapes=[(t, n_hv, dv), (t, n_hv, dv)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return y, delta


def _path_array(path: Sequence[int] | np.ndarray | mx.array, t: int) -> np.ndarray:
    a = np.asarray(path.tolist() if isinstance(path, mx.array) else path, dtype=np.int64)
    if a.ndim != 1 or (a.size and (a.min() < 0 or a.max() >= t)):
        raise ValueError(f"path must list node indices in [0, {t}), got {a.tolist()}")
    return a.astype(np.int32)


def gdn_tape_replay(
    state0: mx.array,
    k: mx.array,
    g: mx.array,
    delta: mx.array,
    path: Sequence[int] | np.ndarray | mx.array,
    *,
    kernel_factory: KernelFactory | None = None,
) -> mx.array:
    """The gdn_tape_replay kernel: (Hv, Dv, Dk) float32 state after the nodes of `path`."""
    if not replay_supported(state0, k, delta):
        raise ValueError(
            f"gdn_tape_replay cannot take state0 {state0.shape}, k {k.shape} {k.dtype}, "
            f"delta {delta.shape}"
        )
    p = _path_array(path, k.shape[0])
    state0 = state0.astype(mx.float32)
    if p.size == 0:
        return state0
    n_hv, dv, dk = state0.shape
    factory = kernel_factory or _kernel_factory()
    (state,) = _kernel(factory, "gdn_tape_replay")(
        inputs=[state0, k, g.astype(mx.float32), delta.astype(mx.float32), mx.array(p)],
        template=[("InT", k.dtype)],
        grid=(dk, dv, n_hv),
        threadgroup=(min(dk, 256), max(1, 256 // dk), 1),
        output_shapes=[(n_hv, dv, dk)],
        output_dtypes=[mx.float32],
    )
    return state


def depth_levels(parents: np.ndarray) -> list[np.ndarray]:
    """Node indices grouped by depth (root level first)."""
    return _depth_levels(np.asarray(parents, dtype=np.int64).tobytes())


@lru_cache(maxsize=16)
def _depth_levels(parents_bytes: bytes) -> list[np.ndarray]:
    """Once per verify, not once per Gated DeltaNet layer."""
    depth = tree_depths(np.frombuffer(parents_bytes, dtype=np.int64))
    return [np.nonzero(depth == d)[0] for d in range(int(depth.max()) + 1)]


def _repeat_heads(x: mx.array, heads: int) -> mx.array:
    """(T, Hk, D) -> (T, heads, D), value head h reading key head h // (heads // Hk)."""
    return x if x.shape[1] == heads else mx.repeat(x, heads // x.shape[1], axis=1)


def replay_reference(state0, k, g, delta, path) -> mx.array:
    """State after the tape's nodes `path`: state = g * state + k (x) delta, as the forward."""
    k = _repeat_heads(k, delta.shape[1])
    state = state0
    for i in path:
        state = state * g[i][:, None, None] + k[i][:, None, :] * delta[i][..., None]
    return state


def replay(state0, k, g, delta, path) -> mx.array:
    """replay_reference, on the gdn_tape_replay Metal kernel where DFLASH_GDN picks it."""
    ok = replay_supported(state0, k, delta)
    if len(path) and use_metal(ok, f"replay of k {k.shape} {k.dtype}"):
        return gdn_tape_replay(state0, k, g, delta, path)
    return replay_reference(state0, k, g, delta, path)


def tree_recurrence(q, k, v, g, beta, state0, parents: np.ndarray):
    """Gated delta rule over a tree: the gdn_tree_verify Metal kernel where DFLASH_GDN picks
    it, else tree_recurrence_reference. Same arguments and results."""
    ok = tree_supported(q, k, v, state0)
    what = f"a {len(parents)}-node tree with k {k.shape} {k.dtype}"
    if use_metal(ok, what):
        return gdn_tree_verify(q, k, v, g, beta, state0, parents)
    return tree_recurrence_reference(q, k, v, g, beta, state0, parents)


def tree_recurrence_reference(q, k, v, g, beta, state0, parents: np.ndarray):
    """Gated delta rule over a tree, one batched step per depth level (MLX-ops reference).

    q, k: (T, Hk, Dk) with Hv a multiple of Hk (repeated here to the value heads), v: (T, Hv,
    Dv), g, beta: (T, Hv), state0: (Hv, Dv, Dk). Returns y (T, Hv, Dv) and delta (T, Hv, Dv).
    """
    q, k = _repeat_heads(q, v.shape[1]), _repeat_heads(k, v.shape[1])
    T = len(parents)
    ys, deltas = [None] * T, [None] * T
    prev_nodes, prev_states = None, state0[None]
    for nodes in depth_levels(parents):
        if prev_nodes is None:
            sp = prev_states
        else:
            where = {int(n): j for j, n in enumerate(prev_nodes)}
            sp = prev_states[mx.array([where[int(parents[n])] for n in nodes], dtype=mx.int32)]
        idx = mx.array(nodes, dtype=mx.int32)
        kd, qd = k[idx], q[idx]
        s = sp * g[idx][:, :, None, None]
        kv_mem = (s * kd[:, :, None, :]).sum(axis=-1)
        delta = (v[idx] - kv_mem) * beta[idx][..., None]
        s = s + kd[:, :, None, :] * delta[..., None]
        y = (s * qd[:, :, None, :]).sum(axis=-1)
        for j, n in enumerate(nodes):
            ys[n], deltas[n] = y[j], delta[j]
        prev_nodes, prev_states = nodes, s
    return mx.stack(ys), mx.stack(deltas)


def _self_check(make: KernelFactory, _verify=gdn_tree_verify, _replay=gdn_tape_replay) -> None:
    """On-device self-check (kernels/self_check.py): the tree verify (output and tape) and the
    replay against the references. The kernels are bound here, so wrappers that tests put on
    the module attributes do not see the check's calls."""
    rng = np.random.default_rng(0)
    t, n_hv, n_hk, dk, dv = 7, 4, 2, 64, 32
    parents = np.array([-1, 0, 0, 1, 1, 2, 3], dtype=np.int32)
    q = rng.standard_normal((t, n_hk, dk)).astype(np.float32)
    k = rng.standard_normal((t, n_hk, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((t, n_hv, dv)).astype(np.float32)
    g = rng.uniform(0.3, 1.0, (t, n_hv)).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (t, n_hv)).astype(np.float32)
    state0 = 0.3 * rng.standard_normal((n_hv, dv, dk)).astype(np.float32)
    q, k, v, g, beta, state0 = map(mx.array, (q, k, v, g, beta, state0))
    y, delta = _verify(q, k, v, g, beta, state0, parents, kernel_factory=make)
    y_ref, delta_ref = tree_recurrence_reference(q, k, v, g, beta, state0, parents)
    self_check.assert_close("gdn_tree_verify output", y, y_ref, 1e-4, 1e-3)
    self_check.assert_close("gdn_tree_verify delta", delta, delta_ref, 1e-4, 1e-3)
    path = [0, 1, 3]
    state = _replay(state0, k, g, delta_ref, path, kernel_factory=make)
    want = replay_reference(state0, k, g, delta_ref, path)
    self_check.assert_close("gdn_tape_replay", state, want, 1e-4, 1e-3)


self_check.register(
    "gated_deltanet", _self_check, lambda: kernel_sources(), lambda: _kernel_factory()
)


def _metal_available() -> bool:
    """Whether there is a Metal GPU (a function, so tests can simulate one for GDN alone)."""
    return mx.metal.is_available()


def use_metal(supported: bool, what: str) -> bool:
    """Whether to run a GDN kernel for a call whose shape support is `supported`.

    auto: the kernel when Metal is there and it takes the shape; reference: never; metal:
    always, and a clear error where it cannot run rather than a silent fallback.
    """
    return metal_kernels.use_kernel(
        SETTING,
        supported,
        what,
        f"Dk <= {MAX_KEY_DIM}, T <= {MAX_TREE}, Hv a multiple of Hk, float16/bfloat16/float32",
        sources=kernel_sources,
        available=_metal_available,
        family="gated_deltanet",
    )


def gdn_backend() -> str:
    """One line for `dflash-mlx doctor`: which Gated DeltaNet verify path runs, and why."""
    return metal_kernels.describe_backend(
        SETTING,
        "reference (MLX ops, one step per tree level)",
        "hybrid verify",
        "metal gdn_tree_verify + gdn_tape_replay kernels",
        f"Dk <= {MAX_KEY_DIM}",
        sources=kernel_sources,
        available=_metal_available,
        family="gated_deltanet",
    )
