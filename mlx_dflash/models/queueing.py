"""Whether a verify queues its layers one by one as it builds them, on this machine.

A verify forward's graph is built layer by layer in Python; queued whole (one `mx.async_eval`
or `mx.eval` at the end), the device starts on it only once all of it is built. Queued layer by
layer (an `mx.async_eval` of each layer's output), the device computes layer i while Python
builds layer i+1, at the price of one more queueing a layer (on Metal a command buffer each,
which MLX commits every 40-50 operations anyway). The drafter's pass follows the same choice.

- The CPU backend: by layer (engine/device.py queues_layers, measured there).
- A GPU (Metal, CUDA): timed at the target's first load, a 16-token verify after 256 cached
  tokens built and evaluated both ways, interleaved, best of REPEATS each; by layer only where
  it measured faster, so it can never make a verify slower. Cached per model and machine beside
  the verify profile, shown by `dflash-mlx doctor -m MODEL`.

Queued by layer on the CPU backend, Python building the next layer, MLX's evaluation thread
and OpenBLAS's second thread want the cores at once: a tiny target's rounds were slower with
that thread, a compute-bound target's faster (docs/host-time.md, "OpenBLAS's second thread").
So a float32 target (`blas_weights`) times block rounds with OpenBLAS's threads as loaded and
with one fewer, keeping one fewer only where it measured faster; cached and shown the same way.
OpenBLAS's thread count is the process's: the target loaded last sets it (a CPU trick,
engine/device.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial

import mlx.core as mx

from .. import _blas
from ..engine import device
from ..engine.budget import profile_name, session_at
from ..engine.contract import Pass
from ..paths import measured
from .padding import blas_weights

REPEATS = 5
TOKENS, CONTEXT = 16, 256


def time_ways(
    target, ways: Mapping[str, Callable[[], object]], repeats: int, rounds: int = 0
) -> dict[str, float]:
    """Seconds to build and evaluate one verify after each way's setup (the best of each, the
    ways interleaved; the first of them warms up). `rounds`: instead, that many rounds as a
    block round runs them here: a 16-token pass queued whole (where the drafter's pass is)
    while the verify is built, both read on the host."""
    session, ids = session_at(target, CONTEXT)
    beside = session_at(target, CONTEXT)[0] if rounds else None
    best = {way: float("inf") for way in ways}
    for i, way in enumerate(list(ways) * (repeats + 1)):
        ways[way]()
        t0 = time.perf_counter()
        for _ in range(max(rounds, 1)):
            drafted = []  # the pass in the drafter's place, queued while the verify is built
            if beside is not None:
                drafted = [target.forward([Pass(ids[:TOKENS], beside.cache, CONTEXT)])[0][0]]
                mx.async_eval(drafted)
            logits, _ = target.forward([Pass(ids[:TOKENS], session.cache, CONTEXT)])[0]
            device.read(logits, also=drafted)
            for s in [session] + ([beside] if beside is not None else []):
                s.commit([])  # every cache back to the context
        if i >= len(ways):
            best[way] = min(best[way], time.perf_counter() - t0)
    return best


def measure(target, repeats: int = REPEATS) -> dict[str, float]:
    """A verify queued whole and by layer."""
    kept = target.queue_layers
    try:
        return time_ways(target, {"whole": partial(setattr, target, "queue_layers", False),
                                  "by_layer": partial(setattr, target, "queue_layers", True)},
                         repeats)  # fmt: skip
    finally:
        target.queue_layers = kept


def measure_threads(target, counts: tuple[int, ...], repeats: int = 3) -> dict[str, float]:
    """Two block rounds as the CPU runs them (verify queued by layer) with OpenBLAS on each of
    `counts` threads."""
    kept, kept_queue = _blas.threads(), target.queue_layers
    target.queue_layers = True
    ways = {str(n): partial(_blas.set_threads, n) for n in counts}
    try:
        return time_ways(target, ways, repeats, rounds=2)
    finally:
        _blas.set_threads(kept)
        target.queue_layers = kept_queue


def choose(target, timer=measure, thread_timer=measure_threads) -> bool:
    """Whether `target` queues its verify (and its drafter's pass) layer by layer here: the
    device class's choice on the CPU (where OpenBLAS's threads are then chosen), the faster way
    measured once (then cached) on a GPU."""
    if device.on_cpu() and not target.world.sharded:
        choose_threads(target, thread_timer)
    if device.on_cpu() or target.world.sharded:
        return device.queues_layers()
    return faster(target, "-queue", ("whole", "by_layer"), timer, "queue_timings")


def choose_threads(target, timer=measure_threads) -> int:
    """OpenBLAS's threads for `target`'s forwards: as loaded, or one fewer where that measured
    faster (float32 targets on OpenBLAS with several threads; the rest run it as loaded)."""
    n = _blas.LOADED_THREADS
    target.blas_timings = None
    if n > 1 and blas_weights(target):
        ways = (str(n), str(n - 1))
        if faster(target, "-blas-threads", ways, lambda t: timer(t, (n, n - 1)), "blas_timings"):
            n -= 1
    _blas.set_threads(n)
    return n


def faster(target, suffix: str, ways: tuple[str, str], timer, record: str) -> bool:
    """Whether the second way beat the first in timer(target)'s seconds by way, measured once
    per model and machine (cached beside the verify profile); the times go to target.`record`
    for doctor."""
    parse = lambda d: {way: float(d[way]) for way in ways}  # noqa: E731
    times = measured(profile_name(target) + suffix, parse, lambda: timer(target), dict)
    setattr(target, record, times)
    return times[ways[1]] < times[ways[0]]
