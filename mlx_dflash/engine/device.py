"""Metal hygiene, as mlx-lm does it: generation runs with the weights wired and on a stream of
its own. Both are Apple-GPU matters; on any other device both are no-ops.

- `wired(model)`: mlx-lm's `wired_limit`, which raises the wired-memory limit to fit the model
  for as long as generation runs, so macOS does not page the weights out between rounds, and
  waits for the generation stream before restoring the limit.
- `compute()`: the context a round's graph is built in: mlx-lm's `generation_stream`, so that
  work another thread queues on the default stream (the server's HTTP side, a progress bar)
  never sits between a round's kernels. It is entered round by round, never across a
  `yield`, so the caller's own MLX work stays on its default stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx


def on_metal() -> bool:
    return mx.metal.is_available()


@contextlib.contextmanager
def wired(model) -> Iterator[None]:
    if not on_metal():
        yield
        return
    from mlx_lm.generate import generation_stream, wired_limit

    # mlx-lm passes its own generation stream the same way (its annotation says Stream).
    with wired_limit(model, [generation_stream]):  # type: ignore[list-item]
        yield


def compute() -> contextlib.AbstractContextManager:
    if not on_metal():
        return contextlib.nullcontext()
    from mlx_lm.generate import generation_stream

    return mx.stream(generation_stream)
