"""Attention for DDTree verification: every tree token sees the prefix and its own ancestors.

The tree is given compactly as parent indices (docs/ddtree.md); a dense mask is built
only for the reference path. On Apple GPUs a custom Metal kernel (metal/tree_attention.metal)
walks the parent chain itself, so verify cost grows with the tree's depth, not its size, and
no (T, S + T) mask is materialised. Everywhere else, or when the kernel cannot take a shape,
MLX's fused attention with an ancestor mask gives the same result.

Backend choice: DFLASH_ATTENTION=auto (default) | metal | reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from . import dispatch as metal_kernels
from . import self_check
from .cpu_attention import cpu_attention, use_cpu_attention
from .dispatch import KernelFactory

ENV_VAR = "DFLASH_ATTENTION"
SETTING = "attention"  # SETTINGS.attention (settings.py)

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

SIMD_WIDTH = 32
SIMDGROUPS = 4  # per threadgroup: 128 threads share one tree token and head block
MAX_ROW_REGISTERS = 16  # rows per threadgroup x ceil(D / 32) floats per lane, for q and acc
SPLIT_MIN_KEYS = 256  # never give a KV split fewer prefix keys than this
TARGET_THREADGROUPS = 512  # enough threadgroups to keep a large Apple GPU busy
MAX_SPLITS = 64

_METAL_FILE = "tree_attention.metal"
_SECTIONS = ("header", "tree_attention_fwd", "tree_attention_merge")
_IO = {
    "tree_attention_fwd": (("q", "k", "v", "parents", "scale"), ("o", "ml")),
    "tree_attention_merge": (("part_o", "part_ml"), ("out",)),
}


def tree_depths(parents: Any) -> np.ndarray:
    """Depth of every node (root = 0); parents come before children."""
    depth = np.zeros(len(parents), dtype=np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def validate_parents(parents: Any) -> np.ndarray:
    """Check the tree contract (root first, parents before children); returns int32 numpy."""
    p = np.asarray(parents)
    if p.ndim != 1 or p.size == 0:
        raise DFlashError(f"parents must be a non-empty 1-D array, got shape {p.shape}.")
    if not np.issubdtype(p.dtype, np.integer):
        raise DFlashError(f"parents must hold integers, got {p.dtype}.")
    p = p.astype(np.int32)
    idx = np.arange(p.size)
    if p[0] != -1 or np.any(p[1:] < 0) or np.any(p[1:] >= idx[1:]):
        raise DFlashError(
            "parents must be -1 for the root and satisfy 0 <= parents[i] < i for every other node."
        )
    return p


def _parents_array(parents: Any) -> mx.array:
    """mx int32 parents; plain sequences and numpy arrays are validated on the way."""
    if isinstance(parents, mx.array):
        return parents if parents.dtype == mx.int32 else parents.astype(mx.int32)
    return mx.array(validate_parents(parents))


def ancestor_mask(parents: Any, prefix_len: int) -> mx.array:
    """Boolean (T, prefix_len + T) mask: row i keeps the prefix, node i and its ancestors.

    Built lazily in MLX by pointer doubling: after step k each row holds the ancestors closer
    than 2**k, so ceil(log2 T) gather-and-or steps cover the deepest chain.
    """
    p = _parents_array(parents)
    t = int(p.shape[0])
    sentinel = mx.array([t], dtype=mx.int32)
    up = mx.where(p < 0, t, p).astype(mx.int32)  # index t is an all-False row
    anc = mx.eye(t, dtype=mx.bool_)
    empty_row = mx.zeros((1, t), dtype=mx.bool_)
    for _ in range(math.ceil(math.log2(t)) if t > 1 else 0):
        anc = anc | mx.concatenate([anc, empty_row], axis=0)[up]
        up = mx.concatenate([up, sentinel])[up]
    if prefix_len:
        anc = mx.concatenate([mx.ones((t, int(prefix_len)), dtype=mx.bool_), anc], axis=1)
    return anc


def tree_mask(masks: dict | None, parents: Any, prefix_len: int) -> mx.array:
    """ancestor_mask(parents, prefix_len), built once per forward: `masks` is the dict the
    layers of one verify share (None: build it here)."""
    if masks is None:
        return ancestor_mask(parents, prefix_len)
    if prefix_len not in masks:
        masks[prefix_len] = ancestor_mask(parents, prefix_len)
    return masks[prefix_len]


def _check_shapes(q: mx.array, k: mx.array, v: mx.array, parents_len: int) -> tuple[int, ...]:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k and v must be (1, heads, rows, head_dim)")
    if q.shape[0] != 1 or k.shape[0] != 1 or v.shape[0] != 1:
        raise ValueError("tree attention runs with batch size 1")
    _, n_q, t, d = q.shape
    _, n_kv, rows, dk = k.shape
    if tuple(v.shape) != tuple(k.shape) or dk != d:
        raise ValueError(f"k {k.shape} and v {v.shape} must match each other and q's head dim {d}")
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads cannot share {n_kv} KV heads evenly")
    if t != parents_len or rows < t:
        raise ValueError(
            f"q has {t} tree rows, parents {parents_len}, k {rows} rows (prefix + tree expected)"
        )
    return n_q, n_kv, t, d, rows - t


def tree_attention_reference(
    q: mx.array, k: mx.array, v: mx.array, parents: Any, scale: float, masks: dict | None = None
) -> mx.array:
    """MLX fused attention with the dense ancestor mask: the semantics the kernel must match.

    `masks`: a dict shared by the layers of one verify, so the mask is built once, not per layer.
    """
    p = _parents_array(parents)
    _, _, _, _, prefix = _check_shapes(q, k, v, int(p.shape[0]))
    mask = tree_mask(masks, p, prefix)
    k = k if k.dtype == q.dtype else k.astype(q.dtype)
    v = v if v.dtype == q.dtype else v.astype(q.dtype)
    if use_cpu_attention():
        return cpu_attention(q, k, v, float(scale), mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=float(scale), mask=mask)


@lru_cache(maxsize=1)
def kernel_sources() -> dict[str, str]:
    """The header and kernel bodies of tree_attention.metal, keyed by section name."""
    return metal_kernels.read_sections(_METAL_FILE, _SECTIONS)


def row_budget(head_dim: int) -> int:
    """Rows ((head, token) pairs) one threadgroup can hold in registers at this head dim."""
    return max(1, MAX_ROW_REGISTERS // -(-head_dim // SIMD_WIDTH))


def heads_per_threadgroup(gqa: int, head_dim: int) -> int:
    """Most query heads of one KV group that fit the row budget (they share K/V loads)."""
    budget = row_budget(head_dim)
    return max(h for h in range(1, gqa + 1) if gqa % h == 0 and h <= max(1, budget))


def tokens_per_threadgroup(tree_len: int, head_blocks: int, max_tokens: int) -> int:
    """Tokens sharing a threadgroup's K/V loads, while enough threadgroups remain."""
    best = 1
    for qb in range(2, max_tokens + 1):
        if -(-tree_len // qb) * head_blocks >= TARGET_THREADGROUPS:
            best = qb
    return best


def choose_splits(prefix_len: int, base_threadgroups: int) -> int:
    """KV splits: only for long prefixes, and only as many as needed to fill the GPU."""
    if prefix_len < 2 * SPLIT_MIN_KEYS or base_threadgroups >= TARGET_THREADGROUPS:
        return 1
    wanted = -(-TARGET_THREADGROUPS // base_threadgroups)
    return max(1, min(MAX_SPLITS, prefix_len // SPLIT_MIN_KEYS, wanted))


@dataclass(frozen=True)
class TreeAttentionPlan:
    """Launch geometry of one tree_attention_metal call."""

    n_q_heads: int
    n_kv_heads: int
    tree_len: int
    prefix_len: int
    head_dim: int
    heads_per_group: int  # HPS
    tokens_per_group: int  # QB
    n_splits: int

    @property
    def gqa(self) -> int:
        return self.n_q_heads // self.n_kv_heads

    @property
    def head_blocks(self) -> int:
        return self.n_kv_heads * (self.gqa // self.heads_per_group)

    @property
    def token_blocks(self) -> int:
        return -(-self.tree_len // self.tokens_per_group)

    @property
    def threadgroup(self) -> tuple[int, int, int]:
        return (SIMD_WIDTH * SIMDGROUPS, 1, 1)

    @property
    def grid(self) -> tuple[int, int, int]:
        """In threads, as mx.fast.metal_kernel counts it (not threadgroups)."""
        return (SIMD_WIDTH * SIMDGROUPS * self.head_blocks, self.token_blocks, self.n_splits)

    @property
    def merge_threadgroup(self) -> tuple[int, int, int]:
        return (self.head_dim, max(1, 256 // self.head_dim), 1)

    @property
    def merge_grid(self) -> tuple[int, int, int]:
        return (self.head_dim, self.n_q_heads * self.tree_len, 1)


def plan_tree_attention(
    n_q_heads: int,
    n_kv_heads: int,
    tree_len: int,
    prefix_len: int,
    head_dim: int,
    *,
    n_splits: int | None = None,
    tokens_per_group: int | None = None,
) -> TreeAttentionPlan:
    """Pick heads and tokens per threadgroup, then KV splits; the overrides are for tests."""
    gqa = n_q_heads // n_kv_heads
    hps = heads_per_threadgroup(gqa, head_dim)
    head_blocks = n_kv_heads * (gqa // hps)
    if tokens_per_group is None:
        qb = tokens_per_threadgroup(tree_len, head_blocks, max(1, row_budget(head_dim) // hps))
    else:
        qb = int(tokens_per_group)
    base = -(-tree_len // qb) * head_blocks
    splits = choose_splits(prefix_len, base) if n_splits is None else int(n_splits)
    if splits < 1 or qb < 1:
        raise ValueError("n_splits and tokens_per_group must be at least 1")
    return TreeAttentionPlan(n_q_heads, n_kv_heads, tree_len, prefix_len, head_dim, hps, qb, splits)


def _kernel(factory: KernelFactory, which: str) -> Any:
    """Build (once per factory) the fwd or merge kernel object from the .metal sources."""
    return metal_kernels.cached_kernel(
        factory,
        which,
        kernel_sources,
        *_IO[which],
        # fwd reads q/k/v through their strides, so KV-cache slices are not copied.
        ensure_row_contiguous=which != "tree_attention_fwd",
    )


def tree_attention_metal(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    parents: Any,
    scale: float,
    *,
    n_splits: int | None = None,
    tokens_per_group: int | None = None,
    kernel_factory: KernelFactory | None = None,
) -> mx.array:
    """The Metal kernel path. kernel_factory defaults to mx.fast.metal_kernel; tests pass the
    CPU harness's drop-in so this exact glue and kernel source run without a GPU."""
    factory = kernel_factory or mx.fast.metal_kernel
    p = _parents_array(parents)
    n_q, n_kv, t, d, prefix = _check_shapes(q, k, v, int(p.shape[0]))
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"tree_attention_metal does not take {q.dtype}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"tree_attention_metal has no kernel for head dim {d}")
    k = k if k.dtype == q.dtype else k.astype(q.dtype)
    v = v if v.dtype == q.dtype else v.astype(q.dtype)
    plan = plan_tree_attention(
        n_q, n_kv, t, prefix, d, n_splits=n_splits, tokens_per_group=tokens_per_group
    )
    split = plan.n_splits > 1
    o, ml = _kernel(factory, "tree_attention_fwd")(
        inputs=[q, k, v, p, mx.array([float(scale)], dtype=mx.float32)],
        template=[
            ("T", q.dtype),
            ("O", mx.float32 if split else q.dtype),
            ("D", d),
            ("G", plan.gqa),
            ("HPS", plan.heads_per_group),
            ("QB", plan.tokens_per_group),
            ("NSG", SIMDGROUPS),
            ("SPLIT", int(split)),
        ],
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[(plan.n_splits, n_q, t, d), (plan.n_splits, n_q, t, 2)],
        output_dtypes=[mx.float32 if split else q.dtype, mx.float32],
    )
    if not split:
        return o
    (out,) = _kernel(factory, "tree_attention_merge")(
        inputs=[o, ml],
        template=[("T", q.dtype), ("D", d)],
        grid=plan.merge_grid,
        threadgroup=plan.merge_threadgroup,
        output_shapes=[(1, n_q, t, d)],
        output_dtypes=[q.dtype],
    )
    return out


def _self_check(make: KernelFactory, _kernel=tree_attention_metal) -> None:
    """On-device self-check (kernels/self_check.py): the fwd kernel in float16 and, through
    the split path and the merge kernel, float32, against the reference. `_kernel` is bound
    here, so wrappers that tests put on the module attribute do not see the check's calls."""
    rng = np.random.default_rng(0)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3], dtype=np.int32)
    t = len(parents)
    for prefix, splits, dtype, d in ((37, None, mx.float16, 128), (300, 2, mx.float32, 64)):
        q = mx.array(rng.standard_normal((1, 4, t, d))).astype(dtype)
        k = mx.array(rng.standard_normal((1, 2, prefix + t, d))).astype(dtype)
        v = mx.array(rng.standard_normal((1, 2, prefix + t, d))).astype(dtype)
        scale = d**-0.5
        got = _kernel(q, k, v, parents, scale, n_splits=splits, kernel_factory=make)
        want = tree_attention_reference(q, k, v, parents, scale)
        tol = 1e-2 if dtype == mx.float16 else 1e-4
        self_check.assert_close(f"tree attention ({dtype}, D={d})", got, want, tol, tol)


self_check.register(
    "tree_attention", _self_check, lambda: kernel_sources(), lambda: mx.fast.metal_kernel
)


def metal_supported(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether the kernel takes these shapes and dtypes (it does not check for Metal)."""
    return (
        q.ndim == 4
        and k.ndim == 4
        and v.ndim == 4
        and q.shape[0] == 1
        and q.dtype in SUPPORTED_DTYPES
        and q.shape[-1] in SUPPORTED_HEAD_DIMS
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
    )


def tree_attention(
    q: mx.array, k: mx.array, v: mx.array, parents: Any, scale: float, masks: dict | None = None
) -> mx.array:
    """Attention of the T tree tokens over the S-row prefix plus each token's ancestors.

    q: (1, Hq, T, D); k, v: (1, Hkv, S + T, D), prefix rows then tree rows in q's order;
    parents: (T,) int, -1 for the root and parents[i] < i otherwise (a chain i - 1 is plain
    causal attention). Returns (1, Hq, T, D) in q's dtype, on the backend DFLASH_ATTENTION picks.
    `masks`: see `tree_attention_reference` (the kernel needs no mask).
    """
    if metal_kernels.use_kernel(
        SETTING,
        metal_supported(q, k, v),
        lambda: f"head dim {q.shape[-1]} / {q.dtype}",
        f"head dims {SUPPORTED_HEAD_DIMS}, float16/bfloat16/float32",
        sources=kernel_sources,
        family="tree_attention",
    ):
        return tree_attention_metal(q, k, v, parents, scale)
    return tree_attention_reference(q, k, v, parents, scale, masks)


def attention_backend() -> str:
    """One line for `dflash-mlx doctor`: which tree-attention path runs, and why."""
    return metal_kernels.describe_backend(
        SETTING,
        "reference (the CPU attention with an ancestor mask)"
        if use_cpu_attention()
        else "reference (mx.fast.scaled_dot_product_attention with an ancestor mask)",
        "tree attention",
        "metal tree-attention kernel",
        f"head dims {'/'.join(str(d) for d in SUPPORTED_HEAD_DIMS)}",
        sources=kernel_sources,
        family="tree_attention",
    )
