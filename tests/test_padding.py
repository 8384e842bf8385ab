"""Row padding (models/padding.py): a forward's dense layers run at a row count BLAS does faster,
and nothing a row computes changes: logits, taps and caches equal an unpadded forward's, in
every attention family, alone and packed."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from families import attention_target
from test_packed import KINDS, PROMPTS, passes, sessions

from mlx_dflash.engine.contract import Pass
from mlx_dflash.models.padding import MAX_ROWS, RowPadding
from mlx_dflash.settings import SETTINGS


def test_a_count_is_padded_only_to_a_clearly_cheaper_one():
    # OpenBLAS on the CI machine, all of SmolLM2's dense weights (ms): 12 rows cost more
    # than 16; 17 costs about what 32 does; 5 is not worth 8 at 3% cheaper.
    seconds = {1: 61, 4: 100, 5: 98, 8: 95, 12: 146, 16: 82, 17: 98, 32: 97, 33: 116}
    padding = RowPadding.from_costs({k: float(v) for k, v in seconds.items()})
    assert [padding(n) for n in (1, 4, 5, 8, 12, 16, 17, 32, 33)] == [
        1, 16, 16, 16, 16, 16, 17, 32, 33
    ]  # fmt: skip
    assert padding(200) == 200  # past the table: as it is
    fixed = RowPadding.multiple(16)
    assert [fixed(n) for n in (1, 2, 16, 17, MAX_ROWS, MAX_ROWS + 5)] == [
        1, 16, 16, 32, MAX_ROWS, MAX_ROWS + 5
    ]  # fmt: skip


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory):
    t = attention_target(request.param, tmp_path_factory.mktemp(request.param))
    t.padding = None
    return t


def _close(a, b):
    """Equal up to float32 summation order, which scales with the values' size (a matmul over
    16 rows may run another BLAS kernel than over 7); a padding row leaking in is O(1)."""
    assert (a is None) == (b is None)
    if a is not None:
        assert a.shape == b.shape
        a, b = np.array(a), np.array(b)
        np.testing.assert_allclose(a, b, atol=2e-4 + 2e-5 * np.abs(b).max(), rtol=1e-4)


def _run_both(target, run):
    """run(target) unpadded, then with every count padded to a multiple of 16."""
    target.padding = None
    plain = run(target)
    target.padding = RowPadding.multiple(16)
    try:
        return plain, run(target)
    finally:
        target.padding = None


def test_a_padded_forward_gives_each_token_what_an_unpadded_one_does(target):
    """A block, a tree, a plain step and a prefill chunk, each alone; then one more step on
    the caches they left (a padding row written to a cache would show there)."""

    def run(t):
        caches = sessions(t)
        outs = [t.forward([p])[0] for p in passes(caches)]
        ends = [len(p) + n for p, n in zip(PROMPTS + [[]], (5, 7, 1, 12), strict=True)]
        nxt = [
            t.forward([Pass(mx.array([90]), c, e)])[0][0] for c, e in zip(caches, ends, strict=True)
        ]
        return outs, nxt, [[getattr(x, "offset", None) for x in c] for c in caches]

    (plain, plain_next, plain_offsets), (padded, padded_next, padded_offsets) = _run_both(
        target, run
    )
    for (l1, t1), (l2, t2) in zip(plain, padded, strict=True):
        _close(l1, l2)
        _close(t1, t2)
    for a, b in zip(plain_next, padded_next, strict=True):
        _close(a, b)
    assert plain_offsets == padded_offsets


def test_a_padded_packed_forward_gives_each_row_what_an_unpadded_one_does(target):
    def run(t):
        return t.forward(passes(sessions(t)))

    plain, padded = _run_both(target, run)
    for (l1, t1), (l2, t2) in zip(plain, padded, strict=True):
        _close(l1, l2)
        _close(t1, t2)


def test_load_target_measures_the_table_once_and_keeps_it(tmp_path, monkeypatch):
    """Measured (unless turned off or fixed) on the first load, read back on the next."""
    from mlx_dflash.models.target import load_target
    from mlx_dflash.models.tiny import write_tiny_target
    from mlx_dflash.paths import cache_root

    folder = write_tiny_target(tmp_path / "t", "llama")
    monkeypatch.setattr(SETTINGS, "row_padding", "0")
    assert load_target(folder).padding is None
    monkeypatch.setattr(SETTINGS, "row_padding", "16")
    assert load_target(folder).padding.table == RowPadding.multiple(16).table
    monkeypatch.setattr(SETTINGS, "row_padding", "auto")
    measured = []
    real_measure = RowPadding.measure.__func__

    def counted(cls, t, repeats=3):
        measured.append(t)
        return real_measure(cls, t, repeats=1)

    monkeypatch.setattr(RowPadding, "measure", classmethod(counted))
    first = load_target(folder).padding
    second = load_target(folder).padding
    assert len(measured) == 1 and first.table == second.table
    assert len(first.table) == MAX_ROWS + 1
    assert all(m >= n for n, m in enumerate(first.table))
    saved = list((cache_root() / "profiles").glob("*-rows.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["table"] == first.table
    saved[0].write_text("{damaged")  # a damaged file is measured again, not an error
    assert load_target(folder).padding.table and len(measured) == 2


def test_quantized_and_half_precision_targets_are_never_padded(monkeypatch):
    """Their matmuls are MLX's own kernels, which cost more with every row."""
    import mlx.nn as nn

    from mlx_dflash.models.target import Target
    from mlx_dflash.models.tiny import load_module, tiny_target_config

    monkeypatch.setattr(SETTINGS, "row_padding", "16")
    cfg = tiny_target_config("llama")
    mod = load_module("llama")

    def build():
        return mod.Model(mod.ModelArgs.from_dict(cfg))

    assert RowPadding.for_target(Target(build(), None, cfg)) is not None
    half = build()
    half.set_dtype(mx.bfloat16)
    assert RowPadding.for_target(Target(half, None, cfg)) is None
    quantized = build()
    nn.quantize(quantized, group_size=32, bits=4)
    assert RowPadding.for_target(Target(quantized, None, cfg)) is None


def test_profiles_are_cached_whole_and_a_damaged_one_is_measured_again(tmp_path, monkeypatch):
    """paths.read_profile / write_profile, the one cache of the verify profile, the padding
    table and the kernel calibration: a damaged or foreign file reads as absent, and a cache
    that cannot be written costs nothing but measuring again."""
    from mlx_dflash.paths import read_profile, write_profile

    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path))
    write_profile("m-rows", {"table": [0, 1, 2]})
    assert read_profile("m-rows", lambda d: d["table"]) == [0, 1, 2]
    assert not list((tmp_path / "profiles").glob("*.tmp"))
    (tmp_path / "profiles" / "m-rows.json").write_text('{"table": [0, 1')
    assert read_profile("m-rows", lambda d: d["table"]) is None
    (tmp_path / "profiles" / "m-rows.json").write_text('{"sizes": []}')
    assert read_profile("m-rows", lambda d: d["table"]) is None
    assert read_profile("absent", lambda d: d) is None
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path / "file"))  # not a folder
    write_profile("m-rows", {"table": [1]})
    assert read_profile("m-rows", lambda d: d["table"]) is None
