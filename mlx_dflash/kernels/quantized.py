"""Small-M quantized matmul for verify forwards (metal/quantized_matmul.metal).

Stock MLX's `mx.quantized_matmul` has kernels for one row and for many, and a 2..32-row verify
falls between them; this one reads and dequantizes each weight tile once for all the rows
(docs/kernels.md, "Quantized verify matmul"). Device class: Metal only. Its reference is
`mx.quantized_matmul` itself; whether it runs for a layer and a row count is measured on the
user's Mac (models/quantized.py). This module holds the kernel, its launch geometry and its
on-device self-check.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import dispatch as metal_kernels
from . import self_check
from .dispatch import KernelFactory

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)  # every width MLX's affine mode packs
SUPPORTED_GROUPS = (32, 64, 128)
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_ROWS = 32  # four blocks of 8 rows: the accumulators of one simdgroup
BN = 32  # output columns per threadgroup
BK = 32  # K per step
THREADS = 128
TARGET_THREADGROUPS = 256  # below this, K is split across threadgroups (float partial sums)
MIN_SPLIT_STEPS = 4  # never give a split fewer than 4 x BK of K

_METAL_FILE = "quantized_matmul.metal"
_SECTIONS = ("header", "qmm_small_m")


def kernel_sources() -> dict[str, str]:
    return metal_kernels.read_sections(_METAL_FILE, _SECTIONS)


def quantized_matmul_reference(x, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """Stock MLX, as nn.QuantizedLinear computes it (without its bias)."""
    return mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits
    )


def float32_reference(x, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """Stock MLX on the same quantized weights with float32 activations and scales: what the
    kernel computes before its one rounding to x's dtype. (MLX's CPU quantized matmul
    accumulates half-precision inputs in half precision, its Metal one in float: comparing at
    float32 holds the kernel to the same bound on both.)"""
    f32 = mx.float32
    return quantized_matmul_reference(
        x.astype(f32), w, scales.astype(f32), biases.astype(f32), group_size, bits
    )


def supported(x: mx.array, w: mx.array, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether the kernel takes this call (it does not check for Metal)."""
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    return (
        mode == "affine"
        and bits in SUPPORTED_BITS
        and group_size in SUPPORTED_GROUPS
        and x.dtype in SUPPORTED_DTYPES
        and 1 <= rows <= MAX_ROWS
        and w.dtype == mx.uint32
        and x.shape[-1] % group_size == 0
        and w.shape[-1] * 32 == x.shape[-1] * bits
    )


def choose_splits(n: int, k: int) -> int:
    """K splits: enough threadgroups to fill a large Apple GPU when N alone gives too few (a
    narrow layer: the 0.5B coder's 896 columns are 28 tiles), each split at least
    MIN_SPLIT_STEPS steps of K."""
    tiles = math.ceil(n / BN)
    steps = k // BK
    if tiles >= TARGET_THREADGROUPS or steps < 2 * MIN_SPLIT_STEPS:
        return 1
    return max(1, min(math.ceil(TARGET_THREADGROUPS / tiles), steps // MIN_SPLIT_STEPS))


def quantized_matmul_metal(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    splits: int | None = None,
    kernel_factory: KernelFactory | None = None,
) -> mx.array:
    """x (..., K) @ dequantize(w)^T -> (..., N), for at most MAX_ROWS rows of x."""
    k = int(x.shape[-1])
    x2 = x.reshape(-1, k)
    m, n = int(x2.shape[0]), int(w.shape[0])
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"quantized_matmul_metal takes 1..{MAX_ROWS} rows, not {m}")
    s = splits or choose_splits(n, k)
    per_split = math.ceil(k // BK / s) * BK
    s = math.ceil(k / per_split)
    out_dtype = x.dtype if s == 1 else mx.float32
    kernel = metal_kernels.cached_kernel(
        kernel_factory or mx.fast.metal_kernel,
        "qmm_small_m",
        kernel_sources,
        ("x", "w", "scales", "biases", "params"),
        ("y",),
    )
    params = mx.array([m, n, k, per_split], dtype=mx.int32)
    (y,) = kernel(
        inputs=[x2, w, scales, biases, params],
        template=[
            ("T", x.dtype),
            ("S", scales.dtype),
            ("O", out_dtype),
            ("BITS", bits),
            ("GROUP", group_size),
            ("RB", math.ceil(m / 8)),
        ],  # fmt: skip
        grid=(math.ceil(n / BN) * THREADS, 1, s),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(s, m, n)],
        output_dtypes=[out_dtype],
    )
    y = y[0] if s == 1 else y.sum(axis=0).astype(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def random_case(m: int, n: int, k: int, bits: int, group: int, dtype, seed: int = 0):
    """(x, w, scales, biases) of a random layer as mx.quantize makes them (tests, checks)."""
    rng = np.random.default_rng(seed)
    weight = mx.array(rng.standard_normal((n, k)).astype(np.float32) / math.sqrt(k))
    w, scales, biases = mx.quantize(weight.astype(dtype), group_size=group, bits=bits)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    return x, w, scales, biases


def tolerance(x: mx.array, w, scales, biases, group: int, bits: int) -> mx.array:
    """Per output, how far the kernel may be from `float32_reference`: K float32 products
    summed in another order move the sum by at most K units of roundoff (2^-24) of the sum of
    their magnitudes, twice (both sides round); a half-precision output adds one rounding."""
    dense = mx.dequantize(w, scales, biases, group_size=group, bits=bits).astype(mx.float32)
    x32 = x.astype(mx.float32)
    mag = mx.abs(x32) @ mx.abs(dense).T
    k = x.shape[-1]
    eps_out = {mx.float32: 0.0, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[x.dtype]
    return mag * (k * 2.0**-23) + mx.abs(x32 @ dense.T) * eps_out + 1e-6


def _self_check(make: KernelFactory, _kernel=quantized_matmul_metal) -> None:
    """On-device check (kernels/self_check.py): 4-bit and 8-bit, float16 and float32, a
    ragged N, one pass and a K split, against stock MLX on this device."""
    cases = ((5, 40, 256, 4, 64, mx.float16, 1), (16, 72, 512, 8, 32, mx.float32, 2))
    for m, n, k, bits, group, dtype, splits in cases:
        x, w, s, b = random_case(m, n, k, bits, group, dtype)
        got = _kernel(x, w, s, b, group, bits, splits=splits, kernel_factory=make)
        want = float32_reference(x, w, s, b, group, bits)
        tol = float(mx.max(tolerance(x, w, s, b, group, bits)).item())
        self_check.assert_close(f"quantized matmul ({bits}-bit, {dtype})", got, want, tol, 0.0)


self_check.register(
    "quantized_matmul", _self_check, lambda: kernel_sources(), lambda: mx.fast.metal_kernel
)
