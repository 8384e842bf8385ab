"""Exponentials on MLX's CPU backend, through numpy where MLX computes them one at a time.

On x86, MLX's CPU backend evaluates exp, sigmoid and power in scalar code (its vectorised
paths are ARM's): 30-75M values/s on the 2-core machine CI runs on, against ~750M/s for
numpy's SIMD exp. The exponentials of a verify grow with its tokens while its matmuls barely
do: a 16-token forward of SmolLM2-135M computes ~2M of them (SwiGLU's sigmoid over 16 x 1536
values and a softmax over 9 heads x 16 x ~300 scores, per layer), ~45 ms of a ~150 ms
forward, where a one-token step computes 16x fewer. So from MIN_VALUES values on, float32
only, the graph is evaluated up to that point (one sync, ~30 us, which costs little on a CPU:
nothing else would have run meanwhile) and numpy computes the exponentials; MLX does the rest.

Results equal MLX's up to float32 rounding (tests/test_cpu_math.py), the same tolerance the
base-2 softmax of kernels/cpu_attention.py and row padding already live with. Metal and ARM
CPUs keep MLX's ops. `DFLASH_MLX_NUMPY_MATH=0` turns it off; `=1` takes it at every size on
any CPU (the test suite runs that way, so every exactness test goes through it). Never inside
a traced function (training's gradients): only the inference forwards call it.
"""

from __future__ import annotations

import platform

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.device import on_cpu
from ..settings import SETTINGS

ENV_VAR = "DFLASH_MLX_NUMPY_MATH"
# The measured break-even on the 2-core x86 machine: attention over 300 keys costs 209 us a
# layer in MLX and 280 through numpy at 4 queries (10.8K scores), 517 and 414 at 8 (21.6K);
# below ~16K values the sync and the copies cost more than MLX's scalar exp saves.
MIN_VALUES = 16384
# MLX's vectorised exponentials are ARM's (module doc): on x86 its CPU exp is scalar.
X86 = platform.machine().lower() not in ("arm64", "aarch64")


def setting() -> str:
    """DFLASH_MLX_NUMPY_MATH as "auto", "0" or "1"; anything else is refused in one sentence."""
    return SETTINGS.choice("numpy_math", ("auto", "0", "1"))


def enabled(value: str | None = None) -> bool:
    """Whether this process computes large exponentials through numpy (see the module doc)."""
    value = setting() if value is None else value
    if value == "0" or not on_cpu():  # a CPU trick (engine/device.py)
        return False
    return value == "1" or X86


def applies(values: int, dtype: mx.Dtype) -> bool:
    """Whether `values` exponentials in `dtype` go through numpy here (asked several times a
    layer, so the setting is read once)."""
    if dtype != mx.float32:
        return False
    value = setting()
    return enabled(value) and (values >= MIN_VALUES or value == "1")


def describe() -> str:
    """One line for `dflash-mlx doctor`: where a forward's large exponentials are computed."""
    if enabled():
        return f"numpy from {MIN_VALUES} values on (MLX's CPU exp is scalar here); {ENV_VAR}=0: off"
    if setting() == "0":
        return f"MLX ({ENV_VAR}=0)"
    return "MLX"


def _host(x: mx.array) -> np.ndarray:
    return np.asarray(x)  # evaluates x; a view of MLX's buffer, no copy


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, SwiGLU's product (mlx-lm's `swiglu`), in MLX or numpy per `applies`."""
    if not applies(gate.size, gate.dtype) or up.dtype != gate.dtype:
        return nn.silu(gate) * up
    mx.eval(gate, up)
    g, u = _host(gate), _host(up)
    with np.errstate(over="ignore", invalid="ignore"):  # g < -88: exp(-g) = inf, silu(g) = -0
        e = np.exp(-g)
        e += 1.0
        out = g / e
        out *= u
    return mx.array(out)


def softmax(scores: mx.array, mask: mx.array | np.ndarray | None, groups: int) -> mx.array:
    """softmax over the last axis of float32 scores (B, H, groups * T, S) through numpy, with
    an optional boolean (T, S) mask (True where attention is allowed) shared by the `groups`
    query heads of each K/V head. Rows must keep at least one allowed score."""
    s = _host(scores)
    if mask is not None:
        b, h, rows, n = s.shape
        view = s.reshape(b, h, groups, rows // groups, n)
        s = np.where(np.asarray(mask), view, np.float32(-np.inf)).reshape(b, h, rows, n)
    p = s - s.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    return mx.array(p)
