"""The device class every speed trick names, and Metal hygiene.

`device_class()` is the one place that tells the three regimes ("metal", "gpu", "cpu") apart;
docs/kernels.md lists what runs in each. A CPU trick asks `device_class() == "cpu"`, never
"not Metal", so it never runs on a GPU.

Queueing a pass whole is not a per-class choice: every device queues the drafter's pass
(`mx.async_eval`) and does its host work meanwhile (docs/host-time.md). A tree round queues
with the pass what its tree reads (Proposal.queue: on a GPU each depth's top candidates, and a
DFlash 2 lattice's scores), so its wait finds them computed.

Metal hygiene, as mlx-lm does it: generation runs with the weights wired (`wired`) and on a
stream of its own (`compute`). Both are Apple-GPU matters; on any other device both are no-ops.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import mlx.core as mx
import numpy as np


def device_class() -> str:
    """ "metal", "gpu" (MLX's CUDA backend) or "cpu": where this process's arrays compute."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    try:
        return "gpu" if mx.cuda.is_available() else "cpu"
    except AttributeError:  # an MLX built without the CUDA module
        return "cpu"


def on_metal() -> bool:
    return device_class() == "metal"


def on_cpu() -> bool:
    """Whether CPU tricks apply (numpy math, BLAS row padding, host-side reductions)."""
    return device_class() == "cpu"


def queues_layers() -> bool:
    """Whether a verify forward and the drafter's pass queue each layer (mx.async_eval) as its
    graph is built, by device class: yes on the CPU backend, measured below; a GPU's answer is
    timed per target at its first load instead (models/queueing.py), so this says no there.

    MLX's CPU backend counts a task per 10 dispatched operations and makes the host wait while
    more than 10 tasks are in flight (mlx/backend/cpu/encoder.h, transforms.cpp
    MAX_ACTIVE_TASKS), and a pass queued whole starts computing only once its graph is built.
    Queued layer by layer, the evaluation thread starts on the first layer while Python builds
    the rest. Measured paired on this bench (docs/host-time.md), a generation's time with it
    over without: a DFlash block round 0.88-0.93 on the planted case (host-bound); the default
    configuration and DDTree 64 unchanged (their CPU forwards sync inside for numpy's
    exponentials); a random Qwen3 of hidden 1024 x 12 layers (compute-bound) unchanged, except
    plain steps, 2% slower, so plain steps and prefill chunks (not rewindable) are queued whole
    as before."""
    return on_cpu()


def read(*arrays: mx.array, also: tuple | list = ()) -> list[np.ndarray]:
    """Device arrays on the host after one wait: one mx.eval for all of them (and for `also`,
    evaluated but left on the device), where a numpy conversion each would wait once each.
    The engine's host reads go through it or rounds.to_host (tests count them)."""
    mx.eval(*arrays, *also)
    return [np.array(a) for a in arrays]


# Nested `wired` blocks per thread (a batch's rows are greenlets sharing their thread's): only
# the outermost sets and restores the limit. Per thread, so a server's worker thread, parked
# inside its block while it waits for requests, does not turn another thread's block off.
class _Depth(threading.local):
    depth = 0


_wired = _Depth()


@contextlib.contextmanager
def wired(model) -> Iterator[None]:
    """mlx-lm's `wired_limit`: raises the wired-memory limit to fit the model for as long as
    generation runs, so macOS does not page the weights out between rounds, and waits for the
    generation stream before restoring the limit. Re-entrant: batched rows (engine/batch.py) run
    their generations inside the server's own block, and their enters and exits interleave, so
    only the outermost one acts."""
    depth = _wired.depth
    _wired.depth = depth + 1
    try:
        if not on_metal() or depth:
            yield
            return
        from mlx_lm.generate import generation_stream, wired_limit

        # mlx-lm passes its own generation stream the same way (its annotation says Stream).
        with wired_limit(model, [generation_stream]):  # type: ignore[list-item]
            yield
    finally:
        _wired.depth -= 1


def compute() -> contextlib.AbstractContextManager:
    """The context a round's graph is built in: mlx-lm's `generation_stream`, so that work
    another thread queues on the default stream (the server's HTTP side, a progress bar) never
    sits between a round's kernels. Entered round by round, never across a `yield`, so the
    caller's own MLX work stays on its default stream."""
    if not on_metal():
        return contextlib.nullcontext()
    from mlx_lm.generate import generation_stream

    return mx.stream(generation_stream)
