"""kernels/cpu_math.py: numpy's exponentials where MLX's CPU backend computes them one at a time
give the same values as MLX's own ops, and are taken exactly when the setting says so."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_dflash.errors import DFlashError
from mlx_dflash.kernels import cpu_math
from mlx_dflash.kernels.cpu_attention import cpu_attention
from mlx_dflash.settings import SETTINGS


@pytest.fixture
def numpy_math(monkeypatch):
    def use(value: str) -> None:
        monkeypatch.setattr(SETTINGS, "numpy_math", value)

    return use


def test_the_setting_decides_where_numpy_computes(numpy_math, monkeypatch):
    numpy_math("0")
    assert not cpu_math.enabled() and not cpu_math.applies(10**6, mx.float32)
    numpy_math("1")
    assert cpu_math.applies(1, mx.float32)
    assert not cpu_math.applies(10**6, mx.float16)  # numpy has no bfloat16; half stays MLX's
    numpy_math("auto")
    monkeypatch.setattr(cpu_math, "X86", True)
    assert cpu_math.applies(cpu_math.MIN_VALUES, mx.float32)
    assert not cpu_math.applies(cpu_math.MIN_VALUES - 1, mx.float32)
    monkeypatch.setattr(cpu_math, "X86", False)  # an ARM CPU: MLX vectorises there
    assert not cpu_math.enabled()
    numpy_math("yes")
    with pytest.raises(DFlashError, match="DFLASH_MLX_NUMPY_MATH must be one of auto, 0, 1"):
        cpu_math.enabled()


def test_doctor_says_where_exponentials_run(numpy_math):
    from mlx_dflash.cli import doctor

    numpy_math("0")
    assert doctor.report()["exponentials"] == "MLX (DFLASH_MLX_NUMPY_MATH=0)"
    numpy_math("1")
    assert doctor.report()["exponentials"].startswith("numpy")


def test_silu_mul_equals_mlx_silu(numpy_math):
    numpy_math("1")
    gate = mx.concatenate(
        [
            mx.random.normal((3, 500), key=mx.random.key(0)) * 6,
            mx.array([[-200.0, -89.0, 0.0]] * 3),
        ],
        axis=1,
    )
    up = mx.random.normal(gate.shape, key=mx.random.key(1))
    got = cpu_math.silu_mul(gate, up)
    assert got.dtype == mx.float32 and got.shape == gate.shape
    want = nn.silu(gate) * up
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=1e-7)
    assert np.all(np.isfinite(np.array(got)))


@pytest.mark.parametrize("t, s", [(1, 37), (5, 40), (16, 300)])
@pytest.mark.parametrize("mask_kind", [None, "causal", "tree"])
def test_attention_through_numpy_equals_mlx_attention(numpy_math, t, s, mask_kind):
    keys = [mx.random.key(i) for i in range(3)]
    q = mx.random.normal((1, 6, t, 32), key=keys[0]) * 2
    k = mx.random.normal((1, 2, s, 32), key=keys[1]) * 2
    v = mx.random.normal((1, 2, s, 32), key=keys[2])
    mask: str | mx.array | None = None
    if mask_kind == "causal" and t > 1:
        mask = "causal"
    elif mask_kind == "tree":  # the prefix plus a random ancestor set that keeps the diagonal
        rng = np.random.default_rng(t + s)
        allowed = rng.random((t, s)) < 0.5
        allowed[np.arange(t), s - t + np.arange(t)] = True
        mask = mx.array(allowed)
    numpy_math("1")
    got = cpu_attention(q, k, v, 0.17, mask)
    numpy_math("0")
    base2 = cpu_attention(q, k, v, 0.17, mask)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(fused), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(got), np.array(base2), rtol=1e-5, atol=1e-5)


def test_feed_forward_takes_numpy_for_mlx_lm_swiglu_mlps_only(numpy_math, monkeypatch):
    """Every family's MLP through `feed_forward` equals mlx-lm's own call; only the SwiGLU
    classes listed take the numpy product."""
    from mlx_lm.models import llama, qwen2, qwen3

    from mlx_dflash.models import families

    numpy_math("1")
    calls = []
    real = cpu_math.silu_mul
    monkeypatch.setattr(cpu_math, "silu_mul", lambda g, u: calls.append(1) or real(g, u))
    x = mx.random.normal((1, 4, 24), key=mx.random.key(3))
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=24,
        num_hidden_layers=1,
        intermediate_size=40,
        num_attention_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=10,
    )
    for mlp in (llama.MLP(args), qwen2.MLP(24, 40), qwen3.MLP(24, 40)):
        np.testing.assert_allclose(
            np.array(families.feed_forward(mlp, x)), np.array(mlp(x)), rtol=1e-5, atol=1e-6
        )
    assert len(calls) == 3

    class Other(nn.Module):  # an MLP of another shape or activation: called as it is
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(24, 40)

        def __call__(self, y):
            return y * 2

    np.testing.assert_array_equal(np.array(families.feed_forward(Other(), x)), np.array(x * 2))
    assert len(calls) == 3


def test_the_drafter_mlp_infers_what_it_trains(numpy_math):
    from mlx_dflash.models.drafter import DrafterMLP

    numpy_math("1")
    mlp = DrafterMLP(16, 48)
    x = mx.random.normal((1, 7, 16), key=mx.random.key(4))
    np.testing.assert_allclose(np.array(mlp.infer(x)), np.array(mlp(x)), rtol=1e-5, atol=1e-6)


def test_profiles_are_kept_apart_with_and_without_numpy(numpy_math):
    """Verify profiles and row-padding tables measure costs that numpy changes."""
    from types import SimpleNamespace

    from mlx_dflash.paths import profile_key

    target = SimpleNamespace(config={"a": 1}, world=SimpleNamespace(size=1), model_type="llama")
    numpy_math("1")
    on = profile_key(target)
    numpy_math("0")
    assert profile_key(target) != on and on.endswith("-np")


@pytest.mark.parametrize("where", ["cpu", "metal"])
def test_a_forward_asks_once_whether_its_mlps_take_numpy(where, numpy_math, tmp_path, monkeypatch):
    """The numpy product is decided once a forward (cpu_math.enabled): on the CPU with it on,
    every SwiGLU layer's MLP takes it; on a GPU each layer calls mlx-lm's MLP itself, never
    asking, and the logits are the same."""
    from families import FIXTURES

    from mlx_dflash.engine import device
    from mlx_dflash.engine.contract import Pass
    from mlx_dflash.models import families
    from mlx_dflash.models.target import load_target

    target = load_target(FIXTURES["qwen3"](tmp_path))
    tokens = mx.array([5, 17, 3, 88, 41, 9, 120, 64])

    def logits():
        return np.array(target.forward([Pass(tokens, target.make_cache(), 0)])[0][0])

    numpy_math("0")
    plain = logits()
    numpy_math("1")
    asked, products = [], []
    real_enabled, real_mul = cpu_math.enabled, cpu_math.silu_mul

    def enabled(*value):  # a forward asks with no value; applies() passes the setting's
        if not value:
            asked.append(1)
        return real_enabled(*value)

    monkeypatch.setattr(cpu_math, "enabled", enabled)
    monkeypatch.setattr(cpu_math, "silu_mul", lambda g, u: products.append(1) or real_mul(g, u))
    if where == "metal":
        monkeypatch.setattr(device, "device_class", lambda: "metal")
        monkeypatch.setattr(families, "feed_forward", lambda *a: pytest.fail("asked per layer"))
    got = logits()
    assert len(asked) == 1
    assert len(products) == (target.num_layers if where == "cpu" else 0)
    np.testing.assert_allclose(got, plain, rtol=1e-4, atol=1e-4)
