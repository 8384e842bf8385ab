"""Gated DeltaNet verify kernels: the MLX-ops reference against a float64 walk, the Metal
kernels' exact source run through the CPU harness (metal/harness) against the reference, and
the DFLASH_GDN dispatch in mlx_dflash/kernels/gated_delta.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from harness_util import (
    chain,
    check_generated_source,
    check_sources_in_wheel_layout,
    random_tree,
    star,
)

from mlx_dflash.engine.contract import Pass
from mlx_dflash.errors import DFlashError
from mlx_dflash.kernels import gated_delta as gk
from mlx_dflash.models import gated_deltanet as hybrid
from mlx_dflash.settings import SETTINGS

# Kernel and reference see the same rounded inputs and both accumulate in float32, so one
# tolerance fits every input dtype; only the summation order differs.
ATOL, RTOL = 3e-5, 1e-4


# ---------------------------------------------------------------------------------------------
# Helpers


def bfs_tree(rng: np.random.Generator, t: int, depth: int) -> np.ndarray:
    """DDTree-like: nodes numbered level by level (best-first), at most `depth` levels."""
    parents, level, nxt = [-1], [0], []
    while len(parents) < t:
        for p in level:
            for _ in range(int(rng.integers(1, 4))):
                if len(parents) < t:
                    nxt.append(len(parents))
                    parents.append(p)
        if len(nxt) == 0 or depth <= 1:
            break
        level, nxt, depth = nxt, [], depth - 1
    parents += [0] * (t - len(parents))
    return np.array(parents, dtype=np.int32)


def make_inputs(rng, t, n_hv, n_hk, dk, dv, dtype):
    """Inputs shaped like the model's: unit-norm k, q scaled by Dk**-0.5, g and beta in (0, 1)."""
    q = rng.standard_normal((t, n_hk, dk)).astype(np.float32)
    k = rng.standard_normal((t, n_hk, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((t, n_hv, dv)).astype(np.float32)
    g = rng.uniform(0.3, 1.0, (t, n_hv)).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (t, n_hv)).astype(np.float32)
    state0 = 0.3 * rng.standard_normal((n_hv, dv, dk)).astype(np.float32)
    q, k, v = (mx.array(x).astype(dtype) for x in (q, k, v))
    return q, k, v, mx.array(g), mx.array(beta), mx.array(state0)


def numpy_tree(q, k, v, g, beta, state0, parents):
    """Float64 truth: every node's full state, computed from its parent's by walking."""
    q, k, v, g, beta, s0 = (
        np.asarray(x.astype(mx.float32), np.float64) for x in (q, k, v, g, beta, state0)
    )
    rep = v.shape[1] // k.shape[1]
    q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    states, ys, deltas = [], [], []
    for i, p in enumerate(parents):
        s = (s0 if p < 0 else states[p]) * g[i][:, None, None]
        delta = (v[i] - np.einsum("hvd,hd->hv", s, k[i])) * beta[i][:, None]
        s = s + k[i][:, None, :] * delta[..., None]
        states.append(s)
        ys.append(np.einsum("hvd,hd->hv", s, q[i]))
        deltas.append(delta)
    return np.stack(ys), np.stack(deltas), states


def close(got: mx.array, want, atol=ATOL, rtol=RTOL) -> None:
    got = np.asarray(got.astype(mx.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(want, dtype=np.float64), atol=atol, rtol=rtol)


def root_path(parents: np.ndarray, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(int(node))
        node = parents[node]
    return path[::-1]


def run_tree_case(harness, rng, t, n_hv, n_hk, dk, dv, dtype, parents):
    q, k, v, g, beta, s0 = make_inputs(rng, t, n_hv, n_hk, dk, dv, dtype)
    y, delta = gk.gdn_tree_verify(
        q, k, v, g, beta, s0, parents, kernel_factory=harness.metal_kernel
    )
    assert y.shape == delta.shape == (t, n_hv, dv)
    assert y.dtype == delta.dtype == mx.float32
    y_ref, d_ref = gk.tree_recurrence_reference(q, k, v, g, beta, s0, parents)
    close(y, y_ref)
    close(delta, d_ref)
    return (q, k, v, g, beta, s0), delta


# ---------------------------------------------------------------------------------------------
# (a) the reference


@pytest.mark.parametrize("tree", ["random", "chain", "star", "bfs"])
def test_reference_matches_float64_walk(tree):
    rng = np.random.default_rng(len(tree))
    parents = {
        "random": random_tree(rng, 14),
        "chain": chain(9),
        "star": star(7),
        "bfs": bfs_tree(rng, 20, 4),
    }[tree]
    args = make_inputs(rng, len(parents), 4, 2, 16, 8, mx.float32)
    y, delta = gk.tree_recurrence_reference(*args, parents)
    y64, d64, states = numpy_tree(*args, parents)
    close(y, y64)
    close(delta, d64)
    # Replaying a root-to-leaf path of the tape gives that leaf's state.
    leaf = int(np.setdiff1d(np.arange(len(parents)), parents)[-1])
    path = root_path(parents, leaf)
    _, k, _, g, _, s0 = args
    close(gk.replay_reference(s0, k, g, delta, path), states[leaf])


def test_tree_plan_layout():
    rng = np.random.default_rng(4)
    for parents in (random_tree(rng, 30), bfs_tree(rng, 40, 5), chain(6), star(5), chain(1)):
        t = len(parents)
        plan = gk.tree_plan(parents)
        order, offsets = plan[:t].tolist(), plan[t : 2 * t + 1]
        assert sorted(order) == list(range(t)) and order[0] == 0
        assert offsets[0] == 2 * t + 1 and np.all(np.diff(offsets) >= 0)
        assert len(plan) == offsets[-1] + 1  # one pad element
        seen, prev, steps = set(), -1, 0
        for j, n in enumerate(order):
            assert n == 0 or parents[n] in seen  # parents first
            replay = plan[offsets[j] : offsets[j + 1]].tolist()
            if n and parents[n] != prev:
                assert replay == root_path(parents, parents[n])
            else:
                assert replay == []
            seen.add(n)
            prev, steps = n, steps + len(replay)
        # cost: every later child of a node replays that node's root path once
        kids = np.bincount(parents[1:], minlength=t)
        depth = np.array([len(root_path(parents, i)) for i in range(t)])
        assert steps == int(np.sum(np.maximum(kids - 1, 0) * depth))


# ---------------------------------------------------------------------------------------------
# (b) gdn_tree_verify through the CPU harness


@pytest.mark.parametrize(
    "name,t,n_hv,n_hk,dk,dv,dtype,tree",
    [
        ("one_node", 1, 2, 2, 64, 64, mx.float32, "random"),
        ("chain", 12, 4, 2, 128, 16, mx.bfloat16, "chain"),
        ("star_odd_dv", 33, 2, 1, 64, 6, mx.float16, "star"),
        ("random", 40, 4, 4, 16, 16, mx.float32, "random"),
        ("deep_16_levels", 17, 2, 2, 256, 8, mx.bfloat16, "chain"),
        ("deep_random", 60, 2, 1, 64, 4, mx.float16, "window"),
        ("wide_128_bfs", 128, 2, 1, 128, 8, mx.float16, "bfs"),
        ("wide_128_random", 128, 1, 1, 64, 5, mx.float32, "random"),
        ("chain_128", 128, 1, 1, 128, 4, mx.bfloat16, "chain"),
    ],
)
def test_tree_kernel_shapes(harness, name, t, n_hv, n_hk, dk, dv, dtype, tree):
    rng = np.random.default_rng(len(name) * 31 + t)
    parents = {
        "random": lambda: random_tree(rng, t),
        "window": lambda: random_tree(rng, t, window=3),
        "chain": lambda: chain(t),
        "star": lambda: star(t),
        "bfs": lambda: bfs_tree(rng, t, 6),
    }[tree]()
    run_tree_case(harness, rng, t, n_hv, n_hk, dk, dv, dtype, parents)


@pytest.mark.parametrize("dk", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_tree_kernel_key_dims_and_dtypes(harness, dk, dtype):
    rng = np.random.default_rng(dk)
    run_tree_case(harness, rng, 11, 2, 1, dk, 8, dtype, random_tree(rng, 11))


@pytest.mark.parametrize("dv", [16, 64, 128, 256])
def test_tree_kernel_value_dims(harness, dv):
    rng = np.random.default_rng(dv + 1)
    run_tree_case(harness, rng, 9, 1, 1, 64, dv, mx.float16, random_tree(rng, 9))


def test_tree_kernel_gqa_equals_repeated_heads_and_mixed_dtypes(harness):
    """Hk < Hv inside the kernel reads what mx.repeat would; mixed dtypes go in as float32."""
    rng = np.random.default_rng(8)
    parents = random_tree(rng, 10)
    q, k, v, g, beta, s0 = make_inputs(rng, 10, 6, 2, 64, 8, mx.bfloat16)
    run = gk.gdn_tree_verify
    y, d = run(q, k, v, g, beta, s0, parents, kernel_factory=harness.metal_kernel)
    qr, kr = mx.repeat(q, 3, axis=1), mx.repeat(k, 3, axis=1)
    y_rep, d_rep = run(qr, kr, v, g, beta, s0, parents, kernel_factory=harness.metal_kernel)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_rep))
    np.testing.assert_array_equal(np.asarray(d), np.asarray(d_rep))
    k32 = k.astype(mx.float32)  # bf16 -> f32 is exact, so the result cannot change
    y_mix, _ = run(q, k32, v, g, beta, s0, parents, kernel_factory=harness.metal_kernel)
    close(y_mix, np.asarray(y), atol=1e-6, rtol=1e-6)


def test_tree_kernel_rejects_what_it_cannot_take():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, s0 = make_inputs(rng, 4, 2, 2, 320, 4, mx.float32)
    assert not gk.tree_supported(q, k, v, s0)
    with pytest.raises(ValueError):
        gk.gdn_tree_verify(q, k, v, g, beta, s0, chain(4))
    q, k, v, g, beta, s0 = make_inputs(rng, 4, 3, 2, 16, 4, mx.float32)
    assert not gk.tree_supported(q, k, v, s0)  # 3 value heads cannot share 2 key heads
    q, k, v, g, beta, s0 = make_inputs(rng, 4, 2, 2, 16, 4, mx.float32)
    assert gk.tree_supported(q, k, v, s0)
    assert not gk.tree_supported(q.astype(mx.int32), k, v, s0)
    big = mx.zeros((gk.MAX_TREE + 1, 1, 16))
    assert not gk.tree_supported(big, big, mx.zeros((gk.MAX_TREE + 1, 1, 4)), mx.zeros((1, 4, 16)))
    with pytest.raises(ValueError, match="nodes"):
        gk.gdn_tree_verify(q, k, v, g, beta, s0, chain(5))
    with pytest.raises(DFlashError):
        gk.gdn_tree_verify(q, k, v, g, beta, s0, [-1, 2, 0, 1])


# ---------------------------------------------------------------------------------------------
# (c) gdn_tape_replay through the CPU harness


@pytest.mark.parametrize(
    "dk,dv,n_hv,n_hk,dtype",
    [
        (16, 16, 4, 2, mx.float32),
        (64, 8, 2, 2, mx.bfloat16),
        (128, 4, 3, 1, mx.float16),
        (256, 3, 2, 1, mx.bfloat16),
    ],
)
def test_replay_kernel_matches_reference(harness, dk, dv, n_hv, n_hk, dtype):
    rng = np.random.default_rng(dk + dv)
    parents = bfs_tree(rng, 24, 6)
    _, k, _, g, _, s0 = make_inputs(rng, 24, n_hv, n_hk, dk, dv, dtype)
    delta = mx.array(rng.standard_normal((24, n_hv, dv)).astype(np.float32))
    leaf = int(np.setdiff1d(np.arange(24), parents)[-1])
    for path in ([0], root_path(parents, leaf), [0, 1, 5, 5, 23]):
        got = gk.gdn_tape_replay(s0, k, g, delta, path, kernel_factory=harness.metal_kernel)
        assert got.shape == s0.shape and got.dtype == mx.float32
        close(got, np.asarray(gk.replay_reference(s0, k, g, delta, path)), 1e-6, 1e-6)
    same = gk.gdn_tape_replay(s0, k, g, delta, [], kernel_factory=harness.metal_kernel)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(s0))
    with pytest.raises(ValueError, match="path"):
        gk.gdn_tape_replay(s0, k, g, delta, [0, 24], kernel_factory=harness.metal_kernel)


def test_tree_then_replay_kernels_give_each_nodes_state(harness):
    """The tape the tree kernel writes, replayed by the replay kernel, is the node's state."""
    rng = np.random.default_rng(12)
    parents = bfs_tree(rng, 30, 5)
    args, delta = run_tree_case(harness, rng, 30, 2, 1, 64, 8, mx.float16, parents)
    _, _, states = numpy_tree(*args, parents)
    _, k, _, g, _, s0 = args
    for node in (0, 7, 29):
        path = root_path(parents, node)
        close(
            gk.gdn_tape_replay(s0, k, g, delta, path, kernel_factory=harness.metal_kernel),
            states[node],
        )


# ---------------------------------------------------------------------------------------------
# (d) dispatch


@pytest.fixture
def small():
    rng = np.random.default_rng(0)
    parents = random_tree(rng, 6)
    return make_inputs(rng, 6, 4, 2, 16, 8, mx.float32), parents


@pytest.fixture
def simulated_metal(monkeypatch, harness):
    """Metal as gdn_kernels sees it, with the harness as mx.fast.metal_kernel; counts calls."""
    from mlx_dflash.kernels import self_check as kernel_check

    monkeypatch.setattr(kernel_check, "kernel_ok", lambda family: True)  # see test_kernel_check
    monkeypatch.setattr(gk, "_metal_available", lambda: True)
    monkeypatch.setattr(gk, "_kernel_factory", lambda: harness.metal_kernel)
    calls = []
    for fn in ("gdn_tree_verify", "gdn_tape_replay"):
        real = getattr(gk, fn)
        monkeypatch.setattr(
            gk, fn, lambda *a, _f=real, _n=fn, **kw: calls.append(_n) or _f(*a, **kw)
        )
    return calls


def pending_cache(args, parents) -> hybrid.RecurrentCache:
    """A RecurrentCache holding the tape of one verify, as gdn_forward leaves it."""
    q, k, v, g, beta, s0 = args
    _, delta = gk.tree_recurrence_reference(q, k, v, g, beta, s0, parents)
    cache = hybrid.RecurrentCache()
    t = len(parents)
    cache.pending = dict(
        start=0,
        chain=False,
        state0=s0,
        conv0=mx.zeros((1, 3, 5)),
        inputs=mx.zeros((t, 5)),
        k=k,
        g=g,
        delta=delta,
    )
    cache.offset = t
    return cache


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the machine without Metal")
def test_dispatch_without_metal(monkeypatch, small):
    args, parents = small
    want = gk.tree_recurrence_reference(*args, parents)
    for mode in (None, "auto", "reference", " Reference "):
        if mode is None:
            monkeypatch.setattr(SETTINGS, gk.SETTING, "")
        else:
            monkeypatch.setattr(SETTINGS, gk.SETTING, mode)
        for got, ref in zip(gk.tree_recurrence(*args, parents), want, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        cache = pending_cache(args, parents)
        cache.compact(0, [0, 1])
        assert cache.state.shape == (1, 4, 8, 16)
        assert gk.gdn_backend().startswith("reference")
    monkeypatch.setattr(SETTINGS, gk.SETTING, "metal")
    with pytest.raises(DFlashError, match="Metal"):
        gk.tree_recurrence(*args, parents)
    with pytest.raises(DFlashError, match="Metal"):
        pending_cache(args, parents).commit([0])
    assert "no Metal" in gk.gdn_backend()


def test_dispatch_rejects_unknown_mode(monkeypatch, small):
    args, parents = small
    monkeypatch.setattr(SETTINGS, gk.SETTING, "cuda")
    with pytest.raises(DFlashError, match=gk.ENV_VAR):
        gk.tree_recurrence(*args, parents)
    assert gk.gdn_backend().startswith("invalid")


def test_dispatch_picks_kernels_when_metal_is_present(monkeypatch, simulated_metal, small):
    args, parents = small
    want_y, want_d = gk.tree_recurrence_reference(*args, parents)
    path = root_path(parents, 5)
    want_state = gk.replay_reference(args[5], args[1], args[3], want_d, path)
    for mode in ("auto", "metal"):
        monkeypatch.setattr(SETTINGS, gk.SETTING, mode)
        y, d = gk.tree_recurrence(*args, parents)
        close(y, want_y)
        close(d, want_d)
        cache = pending_cache(args, parents)
        cache.compact(0, path)
        close(cache.state[0], want_state)
        assert gk.gdn_backend().startswith("metal")
    assert simulated_metal == ["gdn_tree_verify", "gdn_tape_replay"] * 2
    monkeypatch.setattr(SETTINGS, gk.SETTING, "reference")
    gk.tree_recurrence(*args, parents)
    assert len(simulated_metal) == 4 and "reference" in gk.gdn_backend()
    # shapes the kernels do not take: reference under auto, an error under metal. The replay
    # kernel (one thread per state element) has no Dk limit; it refuses integer keys.
    rng = np.random.default_rng(1)
    wide = make_inputs(rng, 6, 2, 2, 320, 4, mx.float32)
    monkeypatch.setattr(SETTINGS, gk.SETTING, "auto")
    gk.tree_recurrence(*wide, parents)
    assert len(simulated_metal) == 4
    pending_cache(wide, parents).commit(path)
    assert simulated_metal[4:] == ["gdn_tape_replay"]
    int_k = mx.round(args[1] * 8).astype(mx.int32)
    int_keys = pending_cache(args, parents)
    int_keys.pending["k"] = int_k
    int_keys.commit(path)
    assert len(simulated_metal) == 5
    monkeypatch.setattr(SETTINGS, gk.SETTING, "metal")
    with pytest.raises(DFlashError, match="cannot run"):
        gk.tree_recurrence(*wide, parents)
    int_keys = pending_cache(args, parents)
    int_keys.pending["k"] = int_k
    with pytest.raises(DFlashError, match="cannot run"):
        int_keys.commit(path)


def test_hybrid_target_verify_through_kernels(monkeypatch, simulated_metal):
    """A tiny Qwen3-Next tree verify + commit: kernels (GQA in-kernel) == reference path."""
    from mlx_dflash.models.target import Target
    from mlx_dflash.models.tiny import load_module, tiny_target_config

    cfg = tiny_target_config("qwen3_next")
    mod = load_module("qwen3_next")
    mx.random.seed(0)
    target = Target(mod.Model(mod.ModelArgs.from_dict(cfg)), None, cfg)
    prompt, tokens = [5, 9, 13, 2, 7], [7, 21, 40, 11, 99, 5, 17]
    parents = np.array([-1, 0, 0, 1, 1, 2, 3])
    results = {}
    for mode in ("reference", "metal"):
        monkeypatch.setattr(SETTINGS, gk.SETTING, mode)
        cache = target.make_cache()
        target.forward(
            [Pass(mx.array(prompt), cache, 0, logits="none", taps=False, rewindable=False)]
        )[0]
        logits, _ = target.forward([Pass(mx.array(tokens), cache, len(prompt), parents=parents)])[0]
        for c in cache:
            c.compact(len(prompt), [0, 1, 3, 6])
        states = [np.asarray(c.state) for c in cache if isinstance(c, hybrid.RecurrentCache)]
        results[mode] = (np.asarray(logits), states)
    assert simulated_metal.count("gdn_tree_verify") == len(results["metal"][1])
    np.testing.assert_allclose(results["metal"][0], results["reference"][0], atol=1e-4, rtol=1e-4)
    for got, want in zip(results["metal"][1], results["reference"][1], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_doctor_reports_gdn_backend(monkeypatch):
    from mlx_dflash.cli import doctor

    monkeypatch.setattr(doctor, "matmul_gflops", lambda: 1.0)
    monkeypatch.setattr(SETTINGS, gk.SETTING, "reference")
    assert doctor.report()["gated deltanet"] == gk.gdn_backend()


def test_kernel_sources_found_in_wheel_layout(monkeypatch, tmp_path):
    check_sources_in_wheel_layout(
        monkeypatch, tmp_path, gk, "gated_delta.metal", ["gdn_tree_verify", "gdn_tape_replay"]
    )


def test_generated_source_is_what_installed_mlx_generates(harness, tmp_path):
    """Trace the real mx.fast.metal_kernel (export needs no GPU) and find the harness's
    rendering of both launches, byte for byte, in the exported graph."""
    rng = np.random.default_rng(3)
    parents = random_tree(rng, 5)
    q, k, v, g, beta, s0 = make_inputs(rng, 5, 4, 2, 64, 8, mx.bfloat16)

    def fn(q, k, v, g, beta, s0, kernel_factory):
        y, delta = gk.gdn_tree_verify(q, k, v, g, beta, s0, parents, kernel_factory=kernel_factory)
        state = gk.gdn_tape_replay(s0, k, g, delta, [0, 1], kernel_factory=kernel_factory)
        return y, state

    names = check_generated_source(harness, tmp_path / "gdn.mlxfn", fn, q, k, v, g, beta, s0)
    assert names == ["dflash_gdn_tree_verify", "dflash_gdn_tape_replay"]
