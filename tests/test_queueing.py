"""Whether a verify is queued layer by layer (models/queueing.py): the CPU backend's choice,
and on a GPU the faster way measured at the target's first load, cached, and shown by doctor.
The timing logic runs here with a simulated GPU and fake timings; the measurement itself runs
for real on this CPU and must leave the target as it found it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_engine import mlx_lm_greedy

from mlx_dflash.cli.doctor import queueing_line
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine import device as engine_device
from mlx_dflash.models import queueing
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target

PROMPT = [5, 17, 3, 88, 41, 9, 120, 64, 33, 7, 200, 150, 12, 99, 45, 6]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(write_tiny_target(tmp_path_factory.mktemp("qwen3"), "qwen3"))


def test_the_cpu_queues_by_layer_without_timing(target):
    assert target.queue_layers is True and target.queue_timings is None
    assert queueing.choose(target, timer=lambda t: pytest.fail("timed on the CPU"))


@pytest.mark.parametrize(
    "timings, by_layer",
    [
        ({"whole": 0.010, "by_layer": 0.008}, True),
        ({"whole": 0.008, "by_layer": 0.010}, False),
        ({"whole": 0.009, "by_layer": 0.009}, False),  # a tie keeps stock MLX's way
    ],
)
def test_a_gpu_keeps_the_faster_way_measured_once(target, monkeypatch, timings, by_layer):
    monkeypatch.setattr(engine_device, "device_class", lambda: "metal")
    calls = []
    fake = lambda t: (calls.append(t), dict(timings))[1]  # noqa: E731
    monkeypatch.setattr(target, "queue_layers", False)
    # each case its own cache entry: the timings are part of the model's identity here
    monkeypatch.setitem(target.config, "queue_case", str(timings))
    assert queueing.choose(target, timer=fake) is by_layer
    assert queueing.choose(target, timer=fake) is by_layer  # read back from the cache
    assert len(calls) == 1 and target.queue_timings == timings
    monkeypatch.setattr(target, "queue_layers", by_layer)
    line = queueing_line(target)
    assert line.startswith("layer by layer" if by_layer else "whole")
    assert f"{1e3 * timings['by_layer']:.2f} ms by layer" in line


def test_the_measurement_leaves_the_target_as_it_was(target):
    """measure() runs both ways for real (here on the CPU): two positive times, the target's
    choice restored, and generation afterwards still the target's own greedy decoding."""
    before = target.queue_layers
    times = queueing.measure(target, repeats=1)
    assert set(times) == {"whole", "by_layer"} and min(times.values()) > 0
    assert target.queue_layers is before
    ref = mlx_lm_greedy(target, PROMPT, 12)
    out = [
        t
        for r in generate_rounds(
            Session(target), PROMPT, GenerationConfig(max_tokens=12, mode="ar")
        )
        for t in r.tokens
    ]
    assert out == ref


def test_by_layer_and_whole_verify_alike(target):
    """The same verify queued both ways gives the same logits, bit for bit (the same
    operations, evaluated earlier)."""
    from mlx_dflash.engine.contract import Pass

    kept = target.tap_ids
    target.set_taps([0, target.num_layers - 1])
    outs = []
    for queue in (False, True):
        target.queue_layers = queue
        session = Session(target)
        ids = mx.array(PROMPT, dtype=mx.int32)
        logits, taps = target.forward([Pass(ids, session.cache, 0, taps=True)])[0]
        outs.append((logits, taps))
    target.queue_layers = True
    target.set_taps(kept)
    assert mx.array_equal(outs[0][0], outs[1][0]) and mx.array_equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize(
    "timings, threads",
    [
        ({"2": 0.025, "1": 0.021}, 1),  # a host-bound target: a core left to Python
        ({"2": 0.400, "1": 0.640}, 2),  # a compute-bound one keeps both BLAS threads
        ({"2": 0.020, "1": 0.020}, 2),  # a tie keeps OpenBLAS's own count
    ],
)
def test_the_cpu_keeps_the_faster_blas_thread_count(target, monkeypatch, timings, threads):
    """On the CPU backend a float32 target times two block rounds with OpenBLAS's threads as
    loaded and with one fewer, keeps the faster (measured once, then cached), sets it, and
    doctor shows both times."""
    from mlx_dflash import _blas
    from mlx_dflash.cli.doctor import threads_line

    monkeypatch.setattr(_blas, "LOADED_THREADS", 2)
    now = [2]
    monkeypatch.setattr(_blas, "set_threads", lambda n: now.__setitem__(0, n))
    monkeypatch.setattr(_blas, "threads", lambda: now[0])
    monkeypatch.setitem(target.config, "threads_case", str(timings))
    calls = []
    fake = lambda t, counts: (calls.append(counts), dict(timings))[1]  # noqa: E731
    assert queueing.choose_threads(target, fake) == threads and now[0] == threads
    assert queueing.choose_threads(target, fake) == threads  # read back from the cache
    assert calls == [(2, 1)] and target.blas_timings == timings
    assert threads_line(target).startswith(f"{threads}: two block rounds")


def test_blas_threads_are_not_timed_where_they_cannot_matter(target, monkeypatch):
    """One OpenBLAS thread, or weights that are not float32 matmuls (quantized): nothing
    timed, OpenBLAS left as loaded."""
    from mlx_dflash import _blas

    set_to = []
    monkeypatch.setattr(_blas, "set_threads", set_to.append)
    never = lambda t, counts: pytest.fail("timed")  # noqa: E731
    monkeypatch.setattr(_blas, "LOADED_THREADS", 1)
    assert queueing.choose_threads(target, never) == 1
    monkeypatch.setattr(_blas, "LOADED_THREADS", 2)
    monkeypatch.setattr(queueing, "blas_weights", lambda t: False)
    assert queueing.choose_threads(target, never) == 2
    assert set_to == [1, 2] and target.blas_timings is None


def test_timing_blas_threads_leaves_everything_as_it_was(target):
    """measure_threads runs both counts for real: two positive times, and OpenBLAS's thread
    count and the target's queueing restored."""
    from mlx_dflash import _blas

    before, queue = _blas.threads(), target.queue_layers
    times = queueing.measure_threads(target, (2, 1), repeats=1)
    assert set(times) == {"2", "1"} and min(times.values()) > 0
    assert _blas.threads() == before and target.queue_layers is queue
