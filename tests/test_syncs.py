"""Host syncs per round, for every round kind (issue 50): a sync is a wait for the device, so
on a Mac each one costs the device's idle time while the host reads and the host's while the
device waits for its next graph. Counted here: every mx.eval, every numpy conversion of a device
array in the engine (a wait each), .item() and .tolist() on one. engine/device.read reads
several arrays after one wait, and a block round's result comes back in one transfer
(rounds.to_host).

Greedy rounds: a DFlash block or DFlash 2 chain waits once; a tree round twice (the drafter's
candidates, which the tree is built from on the host, then the verify with the target's
choices); a plain step once. On every device the drafter's pass is queued while the host
builds the verify's graph (block) or looks for lookup branches (tree), which adds no wait.
"""

from __future__ import annotations

import importlib
import pkgutil

import mlx.core as mx
import numpy as np
import pytest
from oracle import LatticeOracle, OracleDrafter
from test_engine import mlx_lm_greedy, random_drafter

import mlx_dflash.engine as engine_pkg
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine import device as engine_device
from mlx_dflash.engine.batch import run_rows
from mlx_dflash.models.drafter import DrafterRunner
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target
from mlx_dflash.settings import SETTINGS

PROMPT = [5, 17, 3, 88, 41, 9, 120, 64, 33, 7, 200, 150, 12, 99, 45, 6]
N = 32


class _CountingNumpy:
    """numpy, with array / asarray of a device array counted as a wait."""

    def __init__(self, counts: dict):
        self._counts = counts

    def __getattr__(self, name):
        real = getattr(np, name)
        if name not in ("array", "asarray"):
            return real

        def convert(x, *args, **kwargs):
            if isinstance(x, mx.array):
                self._counts["waits"] += 1
            return real(x, *args, **kwargs)

        return convert


@pytest.fixture
def waits(monkeypatch):
    """{"waits": n}: the engine's syncs from now on (see the module doc)."""
    counts = {"waits": 0}
    real_eval, item, tolist = mx.eval, mx.array.item, mx.array.tolist

    def counted(real):
        def call(*args, **kwargs):
            counts["waits"] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(mx, "eval", counted(real_eval))
    monkeypatch.setattr(mx.array, "item", counted(item))
    monkeypatch.setattr(mx.array, "tolist", counted(tolist))
    for info in pkgutil.iter_modules(engine_pkg.__path__):
        module = importlib.import_module(f"mlx_dflash.engine.{info.name}")
        if info.name != "device" and hasattr(module, "np"):
            monkeypatch.setattr(module, "np", _CountingNumpy(counts))
    return counts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target = load_target(write_tiny_target(tmp_path_factory.mktemp("llama"), "llama"))
    # Tapped as random_drafter taps it, so that an oracle drafter (which sets no taps) is fed
    # its context whichever test of this module runs first.
    target.set_taps([0, target.num_layers - 2])
    return target


@pytest.fixture(scope="module")
def truth(target):
    return mlx_lm_greedy(target, PROMPT, N)


def drafter_of(kind: str, target, truth):
    if kind == "dflash":
        return DrafterRunner(random_drafter(target).drafter, target)
    oracle = LatticeOracle if kind == "lattice" else OracleDrafter
    return oracle(PROMPT + truth, target.vocab_size, block_size=8, corrupt=0.3, seed=1)


CASES = {
    "DFlash block": ("dflash", {"mode": "dflash"}, 1),
    "DFlash 2 chain": ("lattice", {"mode": "dflash"}, 1),
    "DDTree 16": ("dflash", {"mode": "ddtree", "budget": 16}, 2),
    "DDTree 16 + lookup": ("oracle", {"mode": "ddtree", "budget": 16, "lookup": 6}, 2),
    "lattice tree 16": ("lattice", {"mode": "ddtree", "budget": 16}, 2),
    "plain steps": ("dflash", {"mode": "ar"}, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_round_kind_waits_for_the_device_as_documented(case, target, truth, waits,
                                                             monkeypatch):  # fmt: skip
    kind, settings, per_round = CASES[case]
    monkeypatch.setattr(SETTINGS, "numpy_math", "0")  # (numpy's exp syncs inside a forward)
    session = Session(target, drafter_of(kind, target, truth))
    rounds = generate_rounds(session, PROMPT, GenerationConfig(max_tokens=N, **settings))
    out = list(next(rounds).tokens)  # the prefill's waits are not a round's
    waits["waits"] = 0
    counted = 0
    for r in rounds:  # each round runs inside the generator's next()
        out += r.tokens
        if r.drafted or settings["mode"] == "ar":
            assert waits["waits"] == per_round, (case, r.drafted, r.accepted)
            counted += 1
        waits["waits"] = 0
    assert counted > 3 and out == truth


def queued_reads(monkeypatch, device: str) -> list[bool]:
    """On a simulated `device` from now on, one entry a tree's device read (engine/tree.py,
    engine/lattice.py): whether every array it read had been queued (mx.async_eval) before."""
    from mlx_dflash.engine import lattice, tree

    monkeypatch.setattr(engine_device, "device_class", lambda: device)
    queued: set[int] = set()
    kept: list[mx.array] = []  # (alive, so that no later array takes a queued one's id)
    found: list[bool] = []
    real_async, real_read = mx.async_eval, engine_device.read

    def async_eval(*arrays):
        kept.extend(arrays)
        queued.update(id(a) for a in arrays)
        return real_async(*arrays)

    def read(*arrays, **kw):
        found.append(all(id(a) in queued for a in arrays))
        return real_read(*arrays, **kw)

    monkeypatch.setattr(mx, "async_eval", async_eval)
    for module in (tree, lattice):
        monkeypatch.setattr(module, "read", read)
    return found


@pytest.mark.parametrize("kind", ["dflash", "lattice"])
@pytest.mark.parametrize("device", ["metal", "gpu"])
def test_a_tree_reads_what_was_queued_with_the_drafters_pass(device, kind, target, truth,
                                                             monkeypatch):  # fmt: skip
    """On a GPU a tree round queues, with the drafter's pass, what its tree reads from the
    device (DFlash: each depth's top candidates; DFlash 2: the lattice's scores), so the
    device computes them while the host looks for lookup branches, and the round's first
    wait is for arrays already queued, not for a graph submitted only then. Same output.
    (Under a grammar: tests/test_grammar.py.)"""
    monkeypatch.setattr(target, "queue_layers", False)
    found = queued_reads(monkeypatch, device)
    session = Session(target, drafter_of(kind, target, truth))
    cfg = GenerationConfig(max_tokens=N, mode="ddtree", budget=16, lookup=6)
    out = [t for r in generate_rounds(session, PROMPT, cfg) for t in r.tokens]
    assert out == truth
    assert len(found) > 3 and all(found), (found, device)


def test_batched_rows_wait_once_a_row_round(target, truth, waits, monkeypatch):
    """A batch's rows each read their own result once a round: the first read evaluates the
    packed forward, the others read what it left."""
    monkeypatch.setattr(SETTINGS, "numpy_math", "0")
    log: list[tuple[bool, int]] = []  # (a drafted round, waits so far) at each round's end

    def row(i):
        def generate(shared):
            runner = DrafterRunner(random_drafter(target).drafter, shared)
            cfg = GenerationConfig(max_tokens=N, mode="dflash")
            for r in generate_rounds(Session(shared, runner), PROMPT, cfg):
                outs[i] += r.tokens
                log.append((not r.prefill and r.drafted > 1, waits["waits"]))

        return generate

    for _ in range(2):  # the second time with every cache and profile warm
        outs: list[list[int]] = [[], []]
        log.clear()
        run_rows(target, [row(0), row(1)])
        assert outs == [truth, truth]
    steps = [b[1] - a[1] for a, b in zip(log, log[1:], strict=False) if b[0] and a[0]]
    assert len(steps) > 20 and set(steps) == {1}


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_the_drafter_computes_while_the_host_works(mode, target, truth, monkeypatch):
    """Every drafting round queues its drafter's pass (mx.async_eval) before its host work: a
    block round before building the verify, a tree round before looking for lookup branches,
    on every device class (engine/device.py: measured never slower on the CPU either). Where
    the target queues its layers (models/queueing.py: the CPU's choice, and a GPU's where it
    measured faster) the verify also queues each layer as it is built: a block round queues
    1 + layers times, else once. Output is the same as without the queueing."""
    queued: list[int] = []
    real = mx.async_eval
    settings = {"mode": mode, "budget": 16, "lookup": 6} if mode == "ddtree" else {"mode": mode}
    cfg = GenerationConfig(max_tokens=N, **settings)
    outs = []
    for device in ("cpu", "metal", "gpu", None):
        monkeypatch.setattr(engine_device, "device_class", lambda d=device: d or "cpu")
        # as loaded there: by layer on the CPU, whole on a GPU that measured it slower
        monkeypatch.setattr(target, "queue_layers", device == "cpu")
        # None: async_eval made a no-op, so nothing is evaluated ahead of its wait
        monkeypatch.setattr(
            mx,
            "async_eval",
            (lambda *a: (queued.append(1), real(*a))[1]) if device else (lambda *a: None),
        )
        queued.clear()
        session = Session(target, drafter_of("oracle", target, truth))
        out, drafted = [], 0
        for r in generate_rounds(session, PROMPT, cfg):
            out += r.tokens
            drafted += r.drafted > 0
        outs.append(out)
        assert device is None or len(queued) >= drafted > 3, device
        if mode == "dflash" and device:  # (the oracle drafter has no layers of its own)
            per_round = 1 + (target.num_layers if device == "cpu" else 0)
            assert len(queued) == drafted * per_round, device
    assert outs == [truth] * 4
