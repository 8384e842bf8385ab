"""Quantized targets on Apple GPUs: each linear layer sends a verify's 2..32 rows to the small-M
kernel (kernels/quantized.py) wherever a calibration on this Mac found the kernel right and
faster than stock MLX for that layer's shape and that row count. Device class: Metal only.

At load (`install`) every affine `nn.QuantizedLinear` of the target, the LM head included, is
replaced as an instance by a `VerifyLinear` (a tied head gets a `TiedHead`); the calibration
(`calibrate`: checked against stock MLX per shape, then timed at each of ROW_COUNTS) runs once
per model and machine; docs/kernels.md, "Chosen per Mac, per model, by measurement". So the
kernel can make a verify neither wrong nor slower than stock MLX.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..kernels import quantized as qk
from ..paths import measured, profile_key

ROW_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # timed; a count between two takes the next one up
REPEATS = 5


def layer_shape(layer) -> str:
    """'N x K, 4-bit g64, float16': what a layer's verify cost depends on."""
    n = int(layer.weight.shape[0])
    k = int(layer.weight.shape[1]) * 32 // int(layer.bits)
    return f"{n}x{k} {layer.bits}-bit g{layer.group_size} {str(layer.scales.dtype).split('.')[-1]}"


def _around(m: int) -> tuple[int, int] | None:
    """The timed row counts either side of m (both m when it was timed); None outside them."""
    if not ROW_COUNTS[0] <= m <= ROW_COUNTS[-1]:
        return None
    return max(r for r in ROW_COUNTS if r <= m), min(r for r in ROW_COUNTS if r >= m)


@dataclass
class Calibration:
    """What this machine measured for one model: whether the kernel agreed with stock MLX on
    every shape (and why not), and per shape and row count (stock seconds, kernel seconds),
    with the one-row step of each shape to express them in steps."""

    device: str
    agreed: bool
    reason: str = "passed"
    timings: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    one_row: dict[str, float] = field(default_factory=dict)

    def uses_kernel(self, shape: str, m: int) -> bool:
        # Between two timed counts, the kernel runs only if its time at the count above beats
        # stock's at the count below: both grow with the rows, so it cannot be the slower path.
        around, t = _around(m), self.timings.get(shape, {})
        if not self.agreed or around is None or around[0] not in t or around[1] not in t:
            return False
        return t[around[1]][1] < t[around[0]][0]

    @property
    def key(self) -> str:
        """Which paths run, in a few characters (the verify profile's cache key takes it)."""
        chosen = sorted((s, m) for s in self.timings for m in ROW_COUNTS if self.uses_kernel(s, m))
        if not chosen:
            return ""
        return "-qmm" + hashlib.sha1(json.dumps(chosen).encode()).hexdigest()[:8]

    def rows(self) -> list[dict[str, Any]]:
        """Per row count, the whole model's stock and kernel time in one-row steps (each shape
        weighted once), and the path its layers take."""
        out = []
        step = sum(self.one_row.values()) or 1.0
        for m in ROW_COUNTS:
            stock = sum(t[m][0] for t in self.timings.values() if m in t)
            kernel = sum(t[m][1] for t in self.timings.values() if m in t)
            used = sum(self.uses_kernel(s, m) for s in self.timings)
            out.append({"rows": m, "stock_steps": stock / step, "kernel_steps": kernel / step,
                        "kernel_layers": used, "shapes": len(self.timings)})  # fmt: skip
        return out

    def to_json(self) -> dict:
        return {"device": self.device, "agreed": self.agreed, "reason": self.reason,
                "timings": {s: {str(m): list(v) for m, v in t.items()}
                            for s, t in self.timings.items()},
                "one_row": self.one_row}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Calibration:
        timings = {s: {int(m): (float(v[0]), float(v[1])) for m, v in t.items()}
                   for s, t in d["timings"].items()}  # fmt: skip
        return cls(d["device"], bool(d["agreed"]), d.get("reason", ""), timings,
                   {s: float(v) for s, v in d.get("one_row", {}).items()})  # fmt: skip


class VerifyLinear(nn.QuantizedLinear):
    """An nn.QuantizedLinear whose verify-sized calls take the small-M kernel where the
    calibration chose it; every other call (one row: plain steps; prefill chunks) is stock."""

    calibration: Calibration
    shape: str
    kernel: Callable[..., mx.array]

    @classmethod
    def of(cls, layer, calibration: Calibration, kernel=None) -> VerifyLinear:
        """The same arrays and settings as `layer` (nothing is copied or re-quantized)."""
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        dict.update(new, layer)
        new.calibration, new.shape = calibration, layer_shape(layer)
        new.kernel = kernel or qk.quantized_matmul_metal
        return new

    def __call__(self, x: mx.array) -> mx.array:
        m = math.prod(x.shape[:-1])
        if not self.calibration.uses_kernel(self.shape, m):
            return super().__call__(x)
        y = self.kernel(x, self["weight"], self["scales"], self["biases"], self.group_size,
                        self.bits)  # fmt: skip
        return y + self["bias"] if "bias" in self else y


class TiedHead:
    """A tied LM head (the embedding's quantized table as a linear layer) with the same
    choice: mlx-lm computes it with `embed_tokens.as_linear`."""

    def __init__(self, embedding, calibration: Calibration, kernel=None):
        self.embedding, self.calibration = embedding, calibration
        self.shape = layer_shape(embedding)
        self.kernel = kernel or qk.quantized_matmul_metal

    def __call__(self, x: mx.array) -> mx.array:
        e = self.embedding
        if not self.calibration.uses_kernel(self.shape, math.prod(x.shape[:-1])):
            return e.as_linear(x)
        return self.kernel(x, e["weight"], e["scales"], e["biases"], e.group_size, e.bits)


def quantized_layers(model) -> list[tuple[str, Any]]:
    """(path, layer) of every affine nn.QuantizedLinear the kernel takes."""
    return [(p, m) for p, m in model.named_modules()
            if isinstance(m, nn.QuantizedLinear) and _takes(m)]  # fmt: skip


def _takes(layer) -> bool:
    return (
        getattr(layer, "mode", "affine") == "affine"
        and layer.bits in qk.SUPPORTED_BITS
        and layer.group_size in qk.SUPPORTED_GROUPS
        and layer.scales.dtype in qk.SUPPORTED_DTYPES
        and layer.get("biases") is not None
    )


class MetalDevice:
    """How the calibration reaches the GPU: the kernel against stock MLX, and their times. Tests
    put a simulated device in its place."""

    def __init__(self, kernel=None):
        self.kernel = kernel or qk.quantized_matmul_metal

    @property
    def name(self) -> str:
        try:
            return str(mx.metal.device_info().get("device_name", "gpu"))
        except Exception:
            return "gpu"

    def case(self, layer, m: int) -> tuple[mx.array, tuple]:
        x = mx.random.normal((m, int(layer.weight.shape[1]) * 32 // layer.bits))
        args = (layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)
        return x.astype(layer.scales.dtype), args

    def check(self, layer) -> str | None:
        """None when the kernel agrees with stock MLX on this layer (at 3 and 16 rows), else
        what differs."""
        for m in (3, 16):
            x, args = self.case(layer, m)
            try:
                got = self.kernel(x, *args)
                want = qk.float32_reference(x, *args)
                tol = qk.tolerance(x, *args)
                bad = mx.any(mx.abs(got.astype(mx.float32) - want) > tol).item()
            except Exception as e:  # a compile error surfaces from MLX as an exception
                return " ".join(str(e).split())[:200] or type(e).__name__
            if bad or not mx.all(mx.isfinite(got)).item():
                return f"{layer_shape(layer)}: differs from stock MLX at {m} rows"
        return None

    def time(self, layer, m: int, path: str) -> float:
        x, args = self.case(layer, m)
        fn = self.kernel if path == "kernel" else qk.quantized_matmul_reference
        mx.eval(fn(x, *args))
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            mx.eval(fn(x, *args))
            best = min(best, time.perf_counter() - t0)
        return best


def calibrate(layers: list, device, progress: Callable[[str, int], None] | None = None):
    """A Calibration of `layers` (one per distinct shape) on `device`."""
    by_shape: dict[str, Any] = {}
    for layer in layers:
        by_shape.setdefault(layer_shape(layer), layer)
    for layer in by_shape.values():
        problem = device.check(layer)
        if problem is not None:
            return Calibration(device.name, False, problem)
    cal = Calibration(device.name, True)
    for shape, layer in by_shape.items():
        cal.one_row[shape] = device.time(layer, 1, "stock")
        cal.timings[shape] = {}
        for m in ROW_COUNTS:
            cal.timings[shape][m] = (
                device.time(layer, m, "stock"),
                device.time(layer, m, "kernel"),
            )
            if progress:
                progress(shape, 1)
    return cal


def load_or_calibrate(target, device=None) -> Calibration:
    """The target's calibration on this machine: cached, else measured now (a progress bar)."""

    def measure() -> Calibration:
        from ..progress import progress

        layers = [m for _, m in quantized_layers(target.model)] + _tied(target)
        total = len({layer_shape(x) for x in layers}) * len(ROW_COUNTS)
        with progress() as bar:
            task = bar.add_task("calibrating the verify kernel", total=total)
            return calibrate(
                layers, device or MetalDevice(), lambda s, n: bar.update(task, advance=n)
            )

    name = f"{profile_key(target)}-qmm"
    return measured(name, Calibration.from_json, measure, Calibration.to_json)


def _tied(target) -> list:
    if target._untied_head() is not None:
        return []
    emb = target.inner.embed_tokens
    return [emb] if hasattr(emb, "scales") and _takes(emb) else []


def install(target, calibration: Calibration, kernel=None) -> int:
    """Put VerifyLinear instances in place of the target's quantized linear layers (and a
    TiedHead in front of a tied quantized head); returns how many layers can take the kernel."""
    from mlx.utils import tree_unflatten

    layers = quantized_layers(target.model)
    swapped = [(p, VerifyLinear.of(m, calibration, kernel)) for p, m in layers]
    if swapped:
        target.model.update_modules(tree_unflatten(swapped))
    tied = _tied(target)
    target.tied_head = TiedHead(tied[0], calibration, kernel) if tied else None
    target.verify_kernel = calibration
    return len(swapped) + len(tied)
