"""Row padding: run a forward's dense layers at a row count the matmul library does well.

On the CPU backend MLX hands float32 matmuls to BLAS, whose cost is far from monotone in the
row count M. Measured with OpenBLAS on the 2-core x86 machine the project runs CI on, matrices
of SmolLM2-135M's dense weight shapes (30 layers and the LM head) take 61 ms at M=1, 100 at
M=4, 146 at M=12 and 82 at M=16: a 12-token verify cost 213 ms where a 16-token one cost 137.
Zero rows appended to the hidden states make the feed-forward layers, attention's projections
(models/attention.py) and the LM head run at the cheaper M; what reads a cache (attention
itself, Gated DeltaNet, MLA) sees only the real rows, so caches, positions and masks are
untouched, and a real row's values are what they would be without padding up to the
summation order of another matmul kernel (the rounding a verify of T tokens already has
against decoding one at a time). Quantized and half-precision weights run MLX's own kernels,
whose cost grows with every row: they are never padded.

The table (for each row count up to MAX_ROWS, the count to run at) is measured once per model
and machine and cached beside the verify profile; Metal needs none (its kernels do not fall off
like this). `DFLASH_MLX_ROW_PADDING=0` turns it off, `=16` pads to multiples of 16 (the
test suite runs that way, so every exactness test runs padded).
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from ..engine.device import on_cpu
from ..paths import measured, profile_key
from ..progress import progress
from ..settings import SETTINGS

MAX_ROWS = 64  # past a verify's largest tree, rows cost what they cost
SIZES = range(1, MAX_ROWS + 1)
GAIN = 0.95  # pad only to a count at least 5% cheaper: measurement noise must not decide it


class RowPadding:
    """`rows(n)`: the row count to run n tokens' dense layers at (n itself past MAX_ROWS)."""

    def __init__(self, table: list[int]):
        self.table = [int(m) for m in table]

    def __call__(self, n: int) -> int:
        return self.table[n] if n < len(self.table) else n

    @classmethod
    def from_costs(cls, seconds: dict[int, float]) -> RowPadding:
        """Each n to the cheapest measured count m >= n, if at least 1/GAIN times cheaper."""
        sizes = sorted(seconds)
        table = list(range(sizes[-1] + 1))
        for n in sizes:
            best = min((m for m in sizes if m >= n), key=lambda m: (seconds[m], m))
            if seconds[best] < GAIN * seconds[n]:
                table[n] = best
        return cls(table)

    @classmethod
    def measure(cls, target, repeats: int = 3) -> RowPadding:
        """Times the target's dense layers (every decoder layer around an identity token mixer,
        from its first and last layers scaled to all of them: within a few percent of all
        of them) and its LM head at each row count; the best of `repeats` sweeps, so that a
        slow moment of the machine costs one sweep's sample, not one size's verdict."""
        layers = sorted({0, target.num_layers - 1})
        scale = target.num_layers / len(layers)
        dtype = target.inner.embed_tokens.weight.dtype
        inputs = {m: mx.random.normal((1, m, target.hidden_size)).astype(dtype) for m in SIZES}
        mx.eval(list(inputs.values()))
        seconds = dict.fromkeys(SIZES, float("inf"))
        with progress() as bar:
            task = bar.add_task(
                "Timing this model's matmuls by row count (once per machine)",
                total=repeats * len(SIZES),
            )
            for _ in range(repeats):
                for m, h in inputs.items():
                    t0 = time.perf_counter()
                    mx.eval([target.dense_layer(i, h) for i in layers])
                    t1 = time.perf_counter()
                    mx.eval(target.output_logits(h))
                    seconds[m] = min(seconds[m], scale * (t1 - t0) + time.perf_counter() - t1)
                    bar.advance(task)
        return cls.from_costs(seconds)

    @classmethod
    def multiple(cls, k: int) -> RowPadding:
        """Every count from 2 up to the next multiple of k (one row stays one: a single token
        is a matrix-vector product, which BLAS does best)."""
        return cls([n if n < 2 else -(-n // k) * k for n in range(MAX_ROWS + 1)])

    @classmethod
    def for_target(cls, target) -> RowPadding | None:
        """The target's padding (the module doc): none on Metal or for a target sharded over
        machines, else as DFLASH_MLX_ROW_PADDING says."""
        if not on_cpu() or target.stage is not None or not blas_weights(target):
            return None
        setting = SETTINGS.row_padding or "auto"
        if setting == "0":
            return None
        if setting.isdigit():
            return cls.multiple(int(setting))
        return measured(f"{profile_key(target)}-rows", lambda d: cls(d["table"]),
                        lambda: cls.measure(target), lambda p: {"table": p.table})  # fmt: skip


def blas_weights(target) -> bool:
    """Whether the dense layers are float32 matmuls, the ones MLX hands to BLAS. Quantized and
    half-precision weights run MLX's own CPU kernels, whose cost grows with every row (4-bit,
    576x1536 x 30: 30 ms at 1 row, 119 at 4, 552 at 16): padding would only add rows."""
    if any(isinstance(m, nn.QuantizedLinear) for _, m in target.model.named_modules()):
        return False
    return target.inner.embed_tokens.weight.dtype == mx.float32


def pad_rows(h: mx.array, m: int) -> mx.array:
    """(1, n, H) hidden states with zero rows appended up to m."""
    n = h.shape[1]
    if m <= n:
        return h
    return mx.concatenate([h, mx.zeros((1, m - n, h.shape[2]), dtype=h.dtype)], axis=1)


def on_real_rows(fn, x: mx.array, n: int) -> mx.array:
    """fn (a token mixer: GDN, MLA) over the first n (real) rows of a padded sequence, its
    output padded back with zero rows: no cache, position or mask ever sees a padding row."""
    if x.shape[1] == n:
        return fn(x)
    return pad_rows(fn(x[:, :n]), x.shape[1])
