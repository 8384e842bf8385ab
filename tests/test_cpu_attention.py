"""The CPU attention (grouped matmuls, base-2 softmax, key-blocked for long prefill chunks)
against MLX's own scaled_dot_product_attention, for every mask the target uses."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.kernels import cpu_attention as ca


def qkv(t, s, n_q=6, n_kv=2, d=16, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((1, n_q, t, d))
    k = mx.random.normal((1, n_kv, s, d)) * 2
    v = mx.random.normal((1, n_kv, s, d))
    return q, k, v


def reference(q, k, v, scale, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("t,s", [(1, 1), (1, 37), (17, 40), (5, 5)])
@pytest.mark.parametrize("mask", [None, "causal", "array"])
def test_matches_sdpa(t, s, mask):
    q, k, v = qkv(t, s)
    if mask == "array":
        rng = np.random.default_rng(t * 100 + s)
        allowed = rng.random((t, s)) < 0.6
        allowed[:, 0] = True  # every query sees at least one key
        mask = mx.array(allowed)
    got = ca.cpu_attention(q, k, v, 0.25, mask)
    want = reference(q, k, v, 0.25, mask)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-5


def test_long_prefill_chunks_go_key_block_by_key_block(monkeypatch):
    """A prefill chunk over a long cache is merged block by block (online softmax) and still
    equals plain attention; fewer queries (verify, decoding) never take that path."""
    monkeypatch.setattr(ca, "KEY_BLOCK", 16)
    calls = []
    real = ca._blocked_causal
    monkeypatch.setattr(ca, "_blocked_causal", lambda *a: calls.append(1) or real(*a))
    for t, s, blocked in [(64, 200, True), (64, 64, True), (80, 200, True), (17, 200, False)]:
        q, k, v = qkv(t, s, seed=t + s)
        got = ca.cpu_attention(q, k, v, 0.25, "causal")
        want = reference(q, k, v, 0.25, "causal")
        assert mx.abs(got - want).max().item() < 1e-5, (t, s)
        assert bool(calls) == blocked, (t, s)
        calls.clear()
