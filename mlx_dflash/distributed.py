"""Targets sharded over several processes (several Macs) with MLX's own `mx.distributed`.

Launched by `mlx.launch` (ring backend over TCP or Thunderbolt; JACCL or MPI where MLX has
them), every rank loads the target lazily, keeps its tensor-parallel shard through mlx-lm's own
`model.shard(group)`, and runs the same engine loop: the sharded projections all-reduce inside
each forward, so hidden states, taps and logits are the same on every rank, and the small
drafter simply runs replicated (cheaper than gathering taps to one rank and sending drafts back).

Every decision taken on the host is taken on rank 0 and broadcast (`World.agree`); only rank 0
prints. Which decisions, collective order, and what a dead or hung rank does: docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .errors import DFlashError
from .settings import SETTINGS

LAUNCH_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MLX_JACCL_COORDINATOR")
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class World:
    group: mx.distributed.Group
    rank: int
    size: int
    timeout: float = DEFAULT_TIMEOUT_S
    waiting: bool = False  # in `idle()`: the watchdog lets it be
    collectives: int = 0  # host decisions broadcast
    bytes_agreed: int = 0
    _beat: float = field(default_factory=time.monotonic)
    sharded = True  # (a class attribute, not a field)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, values) -> np.ndarray:
        """Rank 0's values (an int array of the same shape everywhere), on every rank."""
        a = np.asarray(values, dtype=np.int64)
        x = mx.array(a.astype(np.int32) if self.is_main else np.zeros(a.shape, np.int32))
        out = np.array(mx.distributed.all_sum(x, group=self.group)).astype(np.int64)
        self.collectives += 1
        self.bytes_agreed += 4 * a.size
        self.heartbeat()
        return out

    def all_min(self, value: int) -> int:
        """The smallest of the ranks' values (how far every rank's caches can rewind)."""
        every = mx.distributed.all_gather(mx.array([int(value)], dtype=mx.int32), group=self.group)
        return int(np.array(mx.min(every)))

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (a choice all ranks must make alike)."""
        n = mx.distributed.all_sum(mx.array([int(bool(flag))], dtype=mx.int32), group=self.group)
        return int(np.array(n)[0]) == self.size

    def agree_seq(self, values) -> np.ndarray:
        """Rank 0's variable-length int sequence, on every rank (its length first)."""
        n = int(self.agree([len(values)])[0])
        mine = np.asarray(values, dtype=np.int64)
        return self.agree(mine if self.is_main else np.zeros(n, np.int64))

    def agree_device(self, x: mx.array) -> mx.array:
        """Rank 0's copy of a device array (lazy: it joins the graph, no extra sync)."""
        self.collectives += 1
        self.bytes_agreed += x.nbytes
        # x * 0, not zeros_like(x): the zeros must depend on x, so that every rank's graph
        # runs the forward's own all-reduces before this one, in the same order.
        mine = x if self.is_main else x * 0
        return mx.distributed.all_sum(mine, group=self.group)

    def heartbeat(self) -> None:
        self._beat = time.monotonic()

    @contextlib.contextmanager
    def idle(self):
        """Waiting for a person (chat input): the watchdog does not count this time."""
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False
            self.heartbeat()

    def send_text(self, text: str | None) -> str | None:
        """Rank 0's line of text (None: end of input) on every rank."""
        data = [0] if text is None else [1, *text.encode()]
        vals = self.agree_seq(data if self.is_main else [])
        return None if not vals[0] else bytes(int(b) for b in vals[1:]).decode()


class LocalWorld:
    """One process: every decision is already everyone's.

    The null object of `World`, with the same methods: a target that is not sharded holds it,
    so the engine and the commands call `agree`, `heartbeat` or `idle` alike on one Mac or several,
    and no code outside this module asks whether a world exists.
    """

    rank = 0
    size = 1
    is_main = True
    sharded = False
    collectives = 0
    bytes_agreed = 0

    def agree(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    def all_min(self, value: int) -> int:
        return int(value)

    def all_true(self, flag: bool) -> bool:
        return bool(flag)

    agree_seq = agree

    def agree_device(self, x: mx.array) -> mx.array:
        return x

    def heartbeat(self) -> None:
        pass

    def idle(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def send_text(self, text: str | None) -> str | None:
        return text


LOCAL = LocalWorld()


# How MLX's distributed backends begin the messages of the errors a lost peer raises.
BACKEND_ERRORS = ("[ring]", "[mpi]", "[jaccl]", "[nccl]")


def launched() -> bool:
    return any(os.environ.get(k) is not None for k in LAUNCH_ENV)


def init(timeout: float | None = None) -> World | LocalWorld:
    """The process group when started by mlx.launch (or mpirun) with more than one rank;
    `LOCAL` otherwise."""
    if not launched():
        return LOCAL
    group = mx.distributed.init()
    if group.size() < 2:
        return LOCAL
    world = World(group, group.rank(), group.size(), timeout or _timeout())
    _install_failure_handling(world)
    return world


def _timeout() -> float:
    """DFLASH_MLX_DIST_TIMEOUT's seconds (settings.py), else DEFAULT_TIMEOUT_S."""
    try:
        seconds = float(SETTINGS.dist_timeout or DEFAULT_TIMEOUT_S)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise DFlashError(
            f"DFLASH_MLX_DIST_TIMEOUT must be a number of seconds, not {SETTINGS.dist_timeout!r}."
        )
    return seconds


def _die(world: World, why: str) -> None:
    print(f"error: rank {world.rank} of {world.size}: {why}", file=sys.stderr, flush=True)
    os._exit(1)


def _install_failure_handling(world: World) -> None:
    def on_term(signum, frame):
        _die(world, "another rank stopped, so this one stops too (see the launcher's log).")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)

    # A rank that dies mid-collective can also surface here as an exception from MLX's
    # communication backend ("[ring] connection to a peer was lost") at whichever evaluation
    # happens to wait on it, before mlx.launch's SIGTERM arrives: the same sentence, not a
    # traceback.
    previous_hook = sys.excepthook

    def on_uncaught(kind, exc, tb):
        if issubclass(kind, RuntimeError) and str(exc).startswith(BACKEND_ERRORS):
            _die(world, "another rank stopped, so this one stops too (see the launcher's log).")
        else:
            previous_hook(kind, exc, tb)

    sys.excepthook = on_uncaught

    def watchdog():
        while True:
            time.sleep(min(5.0, world.timeout / 4))
            if not world.waiting and time.monotonic() - world._beat > world.timeout:
                _die(
                    world,
                    f"another rank stopped answering: no progress for {world.timeout:.0f} s "
                    "(DFLASH_MLX_DIST_TIMEOUT sets how long to wait, e.g. for long prefills).",
                )
                return

    threading.Thread(target=watchdog, name="dflash-watchdog", daemon=True).start()


def split(target, world: World | LocalWorld) -> str:
    """Split the target over the ranks: tensor parallelism where mlx-lm can shard it, else (or
    with DFLASH_MLX_PARALLEL=pipeline) a pipeline of layer slices. Returns which ("none" on
    one process)."""
    if not isinstance(world, World):
        return "none"
    how = SETTINGS.choice("parallel", ("auto", "tensor", "pipeline"))
    if how == "pipeline" or (how == "auto" and not hasattr(target.model, "shard")):
        pipeline(target, world)
        return "pipeline"
    shard(target, world)
    return "tensor"


def shard(target, world: World) -> None:
    """Keep this rank's tensor-parallel shard of the target (mlx-lm's `model.shard`)."""
    model = target.model
    if not hasattr(model, "shard"):
        raise DFlashError(
            f"mlx-lm cannot shard '{target.model_type}' targets with tensor parallelism; "
            "use DFLASH_MLX_PARALLEL=pipeline."
        )
    tc = target.text_config
    heads = int(tc.get("num_attention_heads") or 0)
    if heads % world.size:
        raise DFlashError(
            f"{world.size} ranks do not divide the target's {heads} attention heads; "
            "use a rank count that does."
        )
    model.shard(world.group)
    mx.eval(model.parameters())
    target.world = world
    world.heartbeat()


class OtherRankCache:
    """The cache of a layer another pipeline stage runs: never written, never in the way."""

    offset = 0
    state_arrays: list = []

    def rewind_point(self, length: int) -> int:
        return length

    def snapshot(self) -> None:
        pass

    def trim(self, length: int) -> None:
        pass

    def compact(self, start: int, keep) -> None:
        pass


@dataclass
class Stage:
    """This rank's contiguous slice [lo, hi) of the target's layers (pipeline parallelism).

    A forward receives the hidden states from the previous rank, runs its layers and sends
    them on; the last rank's logits and every rank's tapped layers are then summed over the
    ranks (zeros elsewhere), so that all ranks hold the same logits and taps, as with tensor
    parallelism. Each all-reduce's input depends on what came before it on that rank, so every
    rank issues send, receive and the two all-reduces in the same order. Callers evaluate the
    logits or taps a forward returns: they carry the send (evaluating only the caches would
    leave the next rank waiting).
    """

    world: World
    lo: int
    hi: int
    n_layers: int

    def make_cache(self, target) -> list:
        return [
            target.layer_cache(i) if self.lo <= i < self.hi else OtherRankCache()
            for i in range(target.num_layers)
        ]

    def forward(self, target, p):
        """Pass p (engine/contract.py) through my layers; logits and taps summed over ranks."""
        from .models.forward import place, run_layers

        g, rank, last = self.world.group, self.world.rank, self.hi == self.n_layers
        T, H = p.tokens.shape[0], target.hidden_size
        dtype = target.inner.embed_tokens.weight.dtype
        if dtype not in (mx.float32, mx.float16, mx.bfloat16):
            dtype = target.inner.norm.weight.dtype
        if self.lo == 0:
            h = target.embed(p.tokens[None])
        else:
            h = mx.distributed.recv((1, T, H), dtype, rank - 1, group=g)
        h, tapped = run_layers(target, h, range(self.lo, self.hi), [place(p)])
        logits = p.logits
        if not last:
            h = mx.distributed.send(h, rank + 1, group=g)
        dep = h.reshape(-1)[:1].astype(mx.float32) * 0  # orders what follows after the send
        out_logits = None
        if logits != "none":
            rows = T if logits == "all" else 1
            if last:
                mine = target.head(h, logits).astype(mx.float32)
            else:
                mine = mx.zeros((rows, target.vocab_size), mx.float32) + dep
            out_logits = mx.distributed.all_sum(mine, group=g)
            dep = out_logits[:1, :1] * 0
        out_taps = None
        if p.taps and target.tap_ids:
            parts = [
                tapped[t].astype(mx.float32) if t in tapped else mx.zeros((T, H), mx.float32)
                for t in target.tap_ids
            ]
            out_taps = mx.distributed.all_sum(mx.concatenate(parts, axis=-1) + dep, group=g)
            out_taps = out_taps.astype(dtype)
        return out_logits, out_taps


def pipeline(target, world: World) -> None:
    """Keep a contiguous slice of the target's layers on this rank (pipeline parallelism):
    for architectures mlx-lm cannot shard (Qwen3-Next), or set DFLASH_MLX_PARALLEL=pipeline."""
    n = target.num_layers
    if n < world.size:
        raise DFlashError(f"{world.size} ranks cannot share a target of {n} layers.")
    bounds = [round(i * n / world.size) for i in range(world.size + 1)]
    target.stage = Stage(world, bounds[world.rank], bounds[world.rank + 1], n)
    target.world = world
    world.heartbeat()


# mypy checks these against the engine's protocols (engine/contract.py)
if TYPE_CHECKING:
    from .engine import contract

    _conforms_nothere: type[contract.Cache] = OtherRankCache
    _conforms_world: type[contract.World] = World
    _conforms_localworld: type[contract.World] = LocalWorld
