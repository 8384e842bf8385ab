"""Self-checks of the custom Metal kernels before the engine trusts them.

The kernels are tested in CI through the CPU harness, never on the GPU that runs them: an Apple
compiler that rejects a construct, or a GPU that computes something else, would otherwise break
decoding or, worse, silently change its output. So on first use per machine, MLX version and
kernel source, each kernel family runs once on a small case against its MLX-ops reference. A
compile error or a mismatch switches that family to the reference path with one warning line;
the verdict is cached beside the verify profiles (`dflash-mlx doctor` shows it) so later runs
pay nothing.

Each kernel module registers its family here (`register`): the check (its kernels against its
references on a small case), its sources (whose hash keys the verdict) and how its kernels are
built (`mx.fast.metal_kernel`; tests put the CPU harness in its place, and inject broken sources
or kernels through the same hooks).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..atomic import atomic_file
from ..paths import cache_root

CACHE_FILE = "kernel-checks.json"
FAMILIES = ("tree_attention", "gated_deltanet", "quantized_matmul")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # "passed", or what went wrong
    cached: bool = False  # read from the verdict cache rather than measured now

    def describe(self) -> str:
        how = "cached" if self.cached else "this run"
        return f"self-check passed ({how})" if self.ok else f"self-check FAILED: {self.reason}"


KernelFactory = Callable[..., Any]


@dataclass(frozen=True)
class Family:
    check: Callable[[KernelFactory], None]  # raises when a kernel disagrees with its reference
    sources: Callable[[], dict[str, str]]
    factory: Callable[[], KernelFactory]  # how the engine builds this family's kernels


_families: dict[str, Family] = {}


def register(name: str, check, sources, factory) -> None:
    """Called by each kernel module when it is imported."""
    _families[name] = Family(check, sources, factory)


def assert_close(name: str, got: mx.array, want: mx.array, atol: float, rtol: float) -> None:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    if got.shape != want.shape:
        raise AssertionError(f"{name} returned shape {got.shape}, expected {want.shape}")
    if not np.all(np.isfinite(got)):
        raise AssertionError(f"{name} returned non-finite values")
    err = np.abs(got - want) - rtol * np.abs(want)
    if err.max() > atol:
        raise AssertionError(f"{name} differs from the reference by {err.max() + atol:.2e}")


def run_check(family: str, make: KernelFactory | None = None) -> Verdict:
    """Run one family's check now: a Verdict, never an exception."""
    fam = _families[family]
    try:
        fam.check(make or fam.factory())
    except Exception as e:  # compile errors surface as RuntimeError/ValueError from MLX
        msg = " ".join(str(e).split()) or type(e).__name__
        return Verdict(False, msg[:300])
    return Verdict(True, "passed")


def cache_path() -> Path:
    return cache_root() / CACHE_FILE


def verdict_key(family: str) -> str:
    try:
        device = (
            mx.metal.device_info().get("device_name", "gpu") if mx.metal.is_available() else "cpu"
        )
    except Exception:  # older MLX without device_info
        device = "gpu"
    source = hashlib.sha1(
        json.dumps(_families[family].sources(), sort_keys=True).encode()
    ).hexdigest()[:12]
    return f"{family}|mlx {mx.__version__}|{platform.machine()} {device}|{source}"


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, v: Verdict) -> None:
    data = _read_cache()
    data[key] = {"ok": v.ok, "reason": v.reason}
    path = cache_path()
    text = json.dumps(data, indent=1, sort_keys=True)
    with contextlib.suppress(OSError):  # unwritable: the check only runs again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_file(path, lambda tmp: Path(tmp).write_text(text))


_verdicts: dict[str, Verdict] = {}


def cached_verdict(family: str) -> Verdict | None:
    """The verdict already known for this machine, MLX version and source, if any."""
    key = verdict_key(family)
    if key in _verdicts:
        return _verdicts[key]
    entry = _read_cache().get(key)
    if isinstance(entry, dict) and "ok" in entry:
        v = Verdict(bool(entry["ok"]), str(entry.get("reason", "")), cached=True)
        _verdicts[key] = v
        return v
    return None


def kernel_ok(family: str) -> bool:
    """Whether `family`'s kernels may run: checked once (then cached); a failure prints one
    warning line and the caller falls back to the MLX-ops reference."""
    v = cached_verdict(family)
    if v is None:
        v = run_check(family)
        key = verdict_key(family)
        _verdicts[key] = v
        _write_cache(key, v)
        if not v.ok:
            print(
                f"warning: the Metal {family.replace('_', ' ')} kernel failed its self-check "
                f"({v.reason}); using the MLX-ops path instead (verdict cached in "
                f"{cache_path()}).",
                file=sys.stderr,
            )
    return v.ok


def forget() -> None:
    """Drop the in-memory verdicts (tests; the file cache is per $DFLASH_MLX_CACHE)."""
    _verdicts.clear()
