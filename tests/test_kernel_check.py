"""Kernel self-checks: on a machine with Metal, a kernel that does not compile or computes the
wrong thing is caught on first use, the engine falls back to the MLX-ops path with one warning
line, and the verdict is cached and shown by `doctor`.

Metal is simulated with the CPU harness (metal/harness) standing in for mx.fast.metal_kernel, so
the real kernel sources are what passes or fails here; the failures are injected through the
test hooks: a broken source, or a kernel whose outputs are off by one.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from harness_util import random_tree

from mlx_dflash.kernels import gated_delta as gk
from mlx_dflash.kernels import quantized as _quantized  # noqa: F401  (registers its family)
from mlx_dflash.kernels import self_check as kernel_check
from mlx_dflash.kernels import tree_attention as ta
from mlx_dflash.settings import SETTINGS


def fresh(harness):
    """A factory object of its own, so no kernel built by an earlier test is reused."""
    return lambda **kw: harness.metal_kernel(**kw)


def off_by_one(harness):
    """Kernels that compile and run, but return every output plus one."""

    def make(**kw):
        kernel = harness.metal_kernel(**kw)
        return lambda **a: [o + 1.0 for o in kernel(**a)]

    return make


def broken(sources):
    """The same sections with a syntax error in every kernel body."""
    return lambda: {
        k: v if k == "header" else v + "\n  this is not Metal;\n" for k, v in sources().items()
    }


@pytest.fixture
def metal(monkeypatch, tmp_path):
    """Metal 'available' to both kernel modules, a verdict cache of this test's own; returns
    a setter for the kernel factory."""
    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path / "cache"))
    monkeypatch.setattr(ta.mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(gk, "_metal_available", lambda: True)
    monkeypatch.setattr(SETTINGS, ta.SETTING, "")
    monkeypatch.setattr(SETTINGS, gk.SETTING, "")

    def use(make):
        monkeypatch.setattr(ta.mx.fast, "metal_kernel", make)
        monkeypatch.setattr(gk, "_kernel_factory", lambda: make)

    return use


def attention_case():
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 4, 5, 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 11, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 11, 64)).astype(np.float32))
    return q, k, v, random_tree(rng, 5)


def gdn_case():
    rng = np.random.default_rng(1)
    t, hv, hk, dk, dv = 6, 4, 2, 16, 8
    parents = random_tree(rng, t)
    arrays = [
        rng.standard_normal((t, hk, dk)) * 0.1,
        rng.standard_normal((t, hk, dk)) * 0.2,
        rng.standard_normal((t, hv, dv)),
        rng.uniform(0.3, 1.0, (t, hv)),
        rng.uniform(0.1, 0.9, (t, hv)),
        rng.standard_normal((hv, dv, dk)) * 0.3,
    ]
    return [mx.array(a.astype(np.float32)) for a in arrays], parents


def test_real_kernels_pass_their_checks(harness):
    for family in kernel_check.FAMILIES:
        v = kernel_check.run_check(family, fresh(harness))
        assert v.ok, v.reason


@pytest.mark.parametrize("failure", ["bad source", "wrong result"])
def test_failing_attention_kernel_falls_back_once_and_is_cached(
    harness, metal, monkeypatch, capsys, failure
):
    if failure == "bad source":
        metal(fresh(harness))
        monkeypatch.setattr(ta, "kernel_sources", broken(ta.kernel_sources))
    else:
        metal(off_by_one(harness))
    runs = []
    real_run = kernel_check.run_check
    monkeypatch.setattr(
        kernel_check, "run_check", lambda f, m=None: runs.append(f) or real_run(f, m)
    )
    q, k, v, parents = attention_case()
    want = np.asarray(ta.tree_attention_reference(q, k, v, parents, 0.125))
    for _ in range(3):  # every call gets the reference result; the check runs once
        np.testing.assert_array_equal(np.asarray(ta.tree_attention(q, k, v, parents, 0.125)), want)
    assert runs == ["tree_attention"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tree attention kernel failed its self-check" in err[0], err
    assert ("differs from the reference" in err[0]) == (failure == "wrong result")
    assert "MLX-ops path" in err[0]

    # The verdict is on disk: a new process (memory forgotten) neither re-runs nor re-warns.
    saved = json.loads(kernel_check.cache_path().read_text())
    key = kernel_check.verdict_key("tree_attention")
    assert saved[key]["ok"] is False
    kernel_check.forget()
    np.testing.assert_array_equal(np.asarray(ta.tree_attention(q, k, v, parents, 0.125)), want)
    assert runs == ["tree_attention"] and capsys.readouterr().err == ""
    assert kernel_check.cached_verdict("tree_attention").cached

    # doctor says which path runs and why.
    line = ta.attention_backend()
    assert line.startswith("reference") and "self-check FAILED" in line


def test_failing_gdn_kernels_fall_back(harness, metal, capsys):
    metal(off_by_one(harness))
    (q, k, v, g, beta, s0), parents = gdn_case()
    want_y, want_d = gk.tree_recurrence_reference(q, k, v, g, beta, s0, parents)
    y, d = gk.tree_recurrence(q, k, v, g, beta, s0, parents)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    np.testing.assert_array_equal(np.asarray(d), np.asarray(want_d))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gated deltanet kernel failed its self-check" in err
    assert "self-check FAILED" in gk.gdn_backend()


def test_passing_kernels_are_used_and_reported(harness, metal, monkeypatch, capsys):
    metal(fresh(harness))
    calls = []
    real = ta.tree_attention_metal
    monkeypatch.setattr(
        ta, "tree_attention_metal", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, k, v, parents = attention_case()
    got = ta.tree_attention(q, k, v, parents, 0.125)
    want = ta.tree_attention_reference(q, k, v, parents, 0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    assert calls == [1]  # the engine's own call; the check ran on its own references
    assert capsys.readouterr().err == ""
    assert "self-check passed" in ta.attention_backend()


def test_a_changed_kernel_source_is_checked_again(monkeypatch):
    key = kernel_check.verdict_key("tree_attention")
    original = ta.kernel_sources
    changed = lambda: {**original(), "header": "// edited"}  # noqa: E731
    monkeypatch.setattr(ta, "kernel_sources", changed)
    assert kernel_check.verdict_key("tree_attention") != key
    assert mx.__version__ in key


def test_doctor_reports_the_verdicts(harness, metal, monkeypatch):
    from mlx_dflash.cli import doctor

    metal(fresh(harness))
    monkeypatch.setattr(doctor, "matmul_gflops", lambda: 1.0)
    report = doctor.report()
    assert "self-check passed" in report["tree attention"]
    assert "self-check passed" in report["gated deltanet"]
