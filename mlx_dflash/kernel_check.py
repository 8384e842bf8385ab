"""Self-checks of the custom Metal kernels before the engine trusts them.

The kernels are tested in CI through the CPU harness, never on the GPU that runs them: an Apple
compiler that rejects a construct, or a GPU that computes something else, would otherwise break
decoding or, worse, silently change its output. So on first use per machine, MLX version and
kernel source, each kernel family runs once on a small case against its MLX-ops reference. A
compile error or a mismatch switches that family to the reference path with one warning line;
the verdict is cached beside the verify profiles (`dflash-mlx doctor` shows it) so later runs
pay nothing.

Test hooks: `factory` (how kernels are built: `mx.fast.metal_kernel`, or the CPU harness's
drop-in in tests) and the sources each kernel module reads can be replaced.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import gdn_kernels, hybrid
from . import tree_attention as ta
from .metal_kernels import KernelFactory

CACHE_FILE = "kernel-checks.json"
# The kernel entry points as this module first saw them (wrappers that tests put on the module
# attributes to count the engine's calls do not count the check's).
_TREE_ATTENTION = ta.tree_attention_metal
_GDN_VERIFY, _GDN_REPLAY = gdn_kernels.gdn_tree_verify, gdn_kernels.gdn_tape_replay
FAMILIES = ("tree_attention", "gated_deltanet")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # "passed", or what went wrong
    cached: bool = False  # read from the verdict cache rather than measured now

    def describe(self) -> str:
        how = "cached" if self.cached else "this run"
        return f"self-check passed ({how})" if self.ok else f"self-check FAILED: {self.reason}"


def factory(family: str) -> KernelFactory:
    """How `family`'s kernels are built: as the engine will build them (mx.fast.metal_kernel;
    tests put the CPU harness in its place)."""
    return gdn_kernels._kernel_factory() if family == "gated_deltanet" else mx.fast.metal_kernel


# ---------------------------------------------------------------------------------------------
# The checks: small cases that reach every kernel of a family, against the MLX-ops references


def _close(name: str, got: mx.array, want: mx.array, atol: float, rtol: float) -> None:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    if got.shape != want.shape:
        raise AssertionError(f"{name} returned shape {got.shape}, expected {want.shape}")
    if not np.all(np.isfinite(got)):
        raise AssertionError(f"{name} returned non-finite values")
    err = np.abs(got - want) - rtol * np.abs(want)
    if err.max() > atol:
        raise AssertionError(f"{name} differs from the reference by {err.max() + atol:.2e}")


def _check_tree_attention(make: KernelFactory) -> None:
    rng = np.random.default_rng(0)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3], dtype=np.int32)
    t = len(parents)
    for prefix, splits, dtype, d in ((37, None, mx.float16, 128), (300, 2, mx.float32, 64)):
        q = mx.array(rng.standard_normal((1, 4, t, d))).astype(dtype)
        k = mx.array(rng.standard_normal((1, 2, prefix + t, d))).astype(dtype)
        v = mx.array(rng.standard_normal((1, 2, prefix + t, d))).astype(dtype)
        scale = d**-0.5
        got = _TREE_ATTENTION(q, k, v, parents, scale, n_splits=splits, kernel_factory=make)
        want = ta.tree_attention_reference(q, k, v, parents, scale)
        tol = 1e-2 if dtype == mx.float16 else 1e-4
        _close(f"tree attention ({dtype}, D={d})", got, want, tol, tol)


def _check_gated_deltanet(make: KernelFactory) -> None:
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
    y, delta = _GDN_VERIFY(q, k, v, g, beta, state0, parents, kernel_factory=make)
    y_ref, delta_ref = hybrid.tree_recurrence_reference(q, k, v, g, beta, state0, parents)
    _close("gdn_tree_verify output", y, y_ref, 1e-4, 1e-3)
    _close("gdn_tree_verify delta", delta, delta_ref, 1e-4, 1e-3)
    path = [0, 1, 3]
    state = _GDN_REPLAY(state0, k, g, delta_ref, path, kernel_factory=make)
    want = hybrid.replay_reference(state0, k, g, delta_ref, path)
    _close("gdn_tape_replay", state, want, 1e-4, 1e-3)


CHECKS: dict[str, Callable[[KernelFactory], None]] = {
    "tree_attention": _check_tree_attention,
    "gated_deltanet": _check_gated_deltanet,
}


def _sources(family: str) -> dict[str, str]:
    module = gdn_kernels if family == "gated_deltanet" else ta
    return module.kernel_sources()


def run_check(family: str, make: KernelFactory | None = None) -> Verdict:
    """Run one family's check now: a Verdict, never an exception."""
    try:
        CHECKS[family](make or factory(family))
    except Exception as e:  # compile errors surface as RuntimeError/ValueError from MLX
        msg = " ".join(str(e).split()) or type(e).__name__
        return Verdict(False, msg[:300])
    return Verdict(True, "passed")


# ---------------------------------------------------------------------------------------------
# Verdicts, cached per machine, MLX version and kernel source


def cache_path() -> Path:
    from .resolve import cache_root

    return cache_root() / CACHE_FILE


def verdict_key(family: str) -> str:
    try:
        device = (
            mx.metal.device_info().get("device_name", "gpu") if mx.metal.is_available() else "cpu"
        )
    except Exception:  # older MLX without device_info
        device = "gpu"
    source = hashlib.sha1(json.dumps(_sources(family), sort_keys=True).encode()).hexdigest()[:12]
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only means the check runs again next time


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
