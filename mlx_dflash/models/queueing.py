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
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..engine import device
from ..engine.budget import profile_name, session_at
from ..engine.contract import Pass
from ..paths import read_profile, write_profile

REPEATS = 5
TOKENS, CONTEXT = 16, 256


def measure(target, repeats: int = REPEATS) -> dict[str, float]:
    """Seconds to build and evaluate one verify queued whole and by layer (the best of each)."""
    session, ids = session_at(target, CONTEXT)
    best = {"whole": float("inf"), "by_layer": float("inf")}
    kept = target.queue_layers
    try:
        for i in range(2 * (repeats + 1)):  # interleaved; the first of each warms up
            way = ("whole", "by_layer")[i % 2]
            target.queue_layers = way == "by_layer"
            t0 = time.perf_counter()
            mx.eval(target.forward([Pass(ids[:TOKENS], session.cache, CONTEXT)])[0])
            if i >= 2:
                best[way] = min(best[way], time.perf_counter() - t0)
            session.commit([])  # every cache back to the context
    finally:
        target.queue_layers = kept
    return best


def choose(target, timer=measure) -> bool:
    """Whether `target` queues its verify (and its drafter's pass) layer by layer here: the
    device class's choice on the CPU, the faster way measured once (then cached) on a GPU."""
    if device.on_cpu() or target.world.sharded:
        return device.queues_layers()
    name = profile_name(target) + "-queue"  # beside the verify profile
    times = read_profile(
        name, lambda d: {"whole": float(d["whole"]), "by_layer": float(d["by_layer"])}
    )
    if times is None:
        times = timer(target)
        write_profile(name, times)
    target.queue_timings = times
    return times["by_layer"] < times["whole"]
