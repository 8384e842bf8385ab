"""The small-M quantized verify matmul (metal/quantized_matmul.metal): its real source run on the
CPU harness against stock MLX for every bit width, group size and dtype, M = 1..32 and ragged
shapes; a wrong scale, bias or row failing the same check; and the per-machine choice of path
(models/quantized.py) on a simulated device: never a slower path, never a kernel that
disagrees, and greedy decoding unchanged with every layer on the kernel."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dflash.kernels import quantized as qk
from mlx_dflash.kernels import self_check
from mlx_dflash.models import quantized as q
from mlx_dflash.settings import SETTINGS


def run(harness, x, w, s, b, group, bits, splits=None):
    return qk.quantized_matmul_metal(
        x, w, s, b, group, bits, splits=splits, kernel_factory=harness.metal_kernel
    )


def within(got, x, w, s, b, group, bits) -> float:
    """The largest error against stock MLX (at float32), in units of the tolerance."""
    want = qk.float32_reference(x, w, s, b, group, bits)
    err = mx.abs(got.astype(mx.float32) - want) / qk.tolerance(x, w, s, b, group, bits)
    return float(err.max().item())


@pytest.mark.parametrize("bits", qk.SUPPORTED_BITS)
@pytest.mark.parametrize("group", qk.SUPPORTED_GROUPS)
def test_every_width_and_group(harness, bits, group):
    """Every packing MLX's affine mode has, each group size, the three activation dtypes in
    turn; N ragged (not a multiple of the 32-column tile) and K a multiple of the group only."""
    dtype = qk.SUPPORTED_DTYPES[(bits + group // 32) % 3]
    x, w, s, b = qk.random_case(7, 45, 3 * group, bits, group, dtype, seed=bits)
    assert within(run(harness, x, w, s, b, group, bits), x, w, s, b, group, bits) <= 1.0


@pytest.mark.parametrize("dtype", qk.SUPPORTED_DTYPES)
def test_every_row_count_and_dtype(harness, dtype):
    """M = 1..32 (the four accumulator blocks), 4-bit g64, one pass and a K split."""
    x, w, s, b = qk.random_case(32, 70, 512, 4, 64, dtype, seed=1)
    for m in range(1, 33):
        xm = x[:m]
        got = run(harness, xm, w, s, b, 64, 4, splits=1 + m % 3)
        assert got.shape == (m, 70) and got.dtype == dtype
        assert within(got, xm, w, s, b, 64, 4) <= 1.0, m


def test_batched_leading_axes_and_a_bias(harness):
    """(1, T, K) activations as a verify passes them come back as (1, T, N)."""
    x, w, s, b = qk.random_case(12, 33, 256, 8, 128, mx.float32, seed=2)
    got = run(harness, x[None], w, s, b, 128, 8)
    assert got.shape == (1, 12, 33)
    assert within(got[0], x, w, s, b, 128, 8) <= 1.0


def test_a_wrong_scale_bias_or_row_fails(harness):
    """The tolerance is tight enough to see one scale or bias off by 1%, or two rows swapped."""
    x, w, s, b = qk.random_case(9, 40, 256, 4, 32, mx.float32, seed=3)
    ok = run(harness, x, w, s, b, 32, 4)
    assert within(ok, x, w, s, b, 32, 4) <= 1.0
    s_bad = mx.array(np.array(s)).at[5, 2].multiply(1.01)
    assert within(run(harness, x, w, s_bad, b, 32, 4), x, w, s, b, 32, 4) > 1.0
    b_bad = mx.array(np.array(b)).at[7, 0].add(0.01 * float(mx.abs(b).mean().item()))
    assert within(run(harness, x, w, s, b_bad, 32, 4), x, w, s, b, 32, 4) > 1.0
    swapped = mx.concatenate([x[1:2], x[0:1], x[2:]])
    assert within(run(harness, swapped, w, s, b, 32, 4), x, w, s, b, 32, 4) > 1.0


def test_stock_mlx_on_this_cpu_rounds_half_inputs_more_than_the_kernel(harness):
    """Why the check compares at float32: MLX's CPU quantized matmul accumulates float16 in
    float16, so it sits further from the exact product than the kernel's float accumulation."""
    x, w, s, b = qk.random_case(8, 64, 1024, 4, 64, mx.float16, seed=4)
    exact = np.array(qk.float32_reference(x, w, s, b, 64, 4))
    kernel = np.array(run(harness, x, w, s, b, 64, 4).astype(mx.float32))
    stock = np.array(qk.quantized_matmul_reference(x, w, s, b, 64, 4).astype(mx.float32))
    assert np.abs(kernel - exact).max() < np.abs(stock - exact).max()


def test_splits_cover_narrow_layers():
    assert qk.choose_splits(151936, 896) == 1  # an LM head fills the GPU by itself
    assert qk.choose_splits(896, 4864) > 1  # the 0.5B coder's down projection: 28 tiles
    assert qk.choose_splits(64, 128) == 1  # too little K to split


def test_supported_calls():
    x, w, s, b = qk.random_case(4, 32, 128, 4, 64, mx.float16)
    assert qk.supported(x, w, 64, 4)
    assert not qk.supported(mx.zeros((33, 128), dtype=mx.float16), w, 64, 4)  # > 32 rows
    assert not qk.supported(x, w, 64, 4, mode="mxfp4")
    assert not qk.supported(x, w, 16, 4)


def test_the_self_check_passes_on_the_real_source(harness):
    v = self_check.run_check("quantized_matmul", lambda **kw: harness.metal_kernel(**kw))
    assert v.ok, v.reason


# --- the choice, on a simulated device --------------------------------------------------------


def quantized_linear(n=40, k=128, bits=4, group=64, bias=False):
    layer = nn.QuantizedLinear(k, n, bias=bias, group_size=group, bits=bits)
    layer.scales = layer.scales.astype(mx.float32)
    layer.biases = layer.biases.astype(mx.float32)
    return layer


class SimulatedDevice:
    """A GPU whose kernel agrees with stock MLX or not, and whose timings the test sets."""

    name = "simulated"

    def __init__(self, agrees=True, kernel_s=None, stock_s=None):
        self.agrees = agrees
        self.kernel_s = kernel_s or (lambda m: 1.0)
        self.stock_s = stock_s or (lambda m: float(m))
        self.checked = 0

    def check(self, layer):
        self.checked += 1
        return None if self.agrees else "differs from stock MLX at 16 rows"

    def time(self, layer, m, path):
        return self.kernel_s(m) if path == "kernel" else self.stock_s(m)


def test_the_calibration_never_keeps_a_slower_path():
    layer = quantized_linear()
    shape = q.layer_shape(layer)
    # The kernel costs 5 everywhere; stock costs m: the kernel wins only from 6 rows on.
    cal = q.calibrate([layer, layer], SimulatedDevice(kernel_s=lambda m: 5.0))
    assert cal.agreed and list(cal.timings) == [shape]  # one shape, measured once
    for m in range(1, 40):
        assert cal.uses_kernel(shape, m) == (6 <= m <= 32), m
    assert not cal.uses_kernel(shape, 5) and cal.uses_kernel(shape, 5 + 1)
    rows = {r["rows"]: r for r in cal.rows()}
    assert rows[16]["kernel_layers"] == 1 and rows[4]["kernel_layers"] == 0
    slower = q.calibrate([layer], SimulatedDevice(kernel_s=lambda m: 100.0))
    assert not any(slower.uses_kernel(shape, m) for m in range(1, 33))
    assert slower.key == "" and cal.key.startswith("-qmm")


def test_a_kernel_that_disagrees_is_never_admitted():
    layer = quantized_linear()
    device = SimulatedDevice(agrees=False, kernel_s=lambda m: 0.001)  # "faster", but wrong
    cal = q.calibrate([layer], device)
    assert not cal.agreed and "differs" in cal.reason and cal.timings == {}
    assert not any(cal.uses_kernel(q.layer_shape(layer), m) for m in range(1, 33))


def test_the_choice_is_cached_per_model_and_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path))
    from mlx_dflash.models.target import load_target
    from mlx_dflash.models.tiny import write_tiny_target

    target = load_target(write_tiny_target(tmp_path / "t", "llama"))
    nn.quantize(target.model, group_size=32, bits=4)
    device = SimulatedDevice(kernel_s=lambda m: 3.0)
    cal = q.load_or_calibrate(target, device)
    assert device.checked > 0 and list((tmp_path / "profiles").glob("*-qmm.json"))
    again = q.load_or_calibrate(target, SimulatedDevice(agrees=False))  # read, not measured
    assert again.to_json() == json.loads(json.dumps(cal.to_json()))


def test_verify_linear_routes_by_the_choice_and_keeps_the_weights():
    layer = quantized_linear(bias=True)
    shape = q.layer_shape(layer)
    cal = q.Calibration("simulated", True, timings={shape: {m: (2.0, 1.0) for m in q.ROW_COUNTS}})
    calls = []

    def kernel(x, *args):
        calls.append(x.shape)
        return qk.quantized_matmul_reference(x, *args)

    v = q.VerifyLinear.of(layer, cal, kernel)
    assert isinstance(v, nn.QuantizedLinear)
    assert [k for k, _ in tree_flatten(v.parameters())] == [
        k for k, _ in tree_flatten(layer.parameters())
    ]
    for m, on_kernel in ((1, False), (2, True), (16, True), (32, True), (33, False)):
        x = mx.random.normal((1, m, 128))
        np.testing.assert_allclose(np.array(v(x)), np.array(layer(x)), rtol=1e-5, atol=1e-5)
        assert bool(calls) == on_kernel, m
        calls.clear()


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_greedy_decoding_is_unchanged_with_every_layer_on_the_kernel(harness, tmp_path, mode):
    """A 4-bit target whose every linear layer (its LM head included) takes the kernel from
    the harness for every verify: token for token mlx-lm's own greedy decoding."""
    from oracle import OracleDrafter, diversify
    from test_engine import PROMPT, mlx_lm_greedy, run

    from mlx_dflash.engine import Session
    from mlx_dflash.models.target import load_target
    from mlx_dflash.models.tiny import write_tiny_target

    target = load_target(write_tiny_target(tmp_path, "qwen3"))
    diversify(target.model)
    nn.quantize(target.model, group_size=32, bits=4)
    ref = mlx_lm_greedy(target, PROMPT, 24)
    layers = [m for _, m in q.quantized_layers(target.model)] + q._tied(target)
    shapes = {q.layer_shape(x) for x in layers}
    every = {s: {m: (2.0, 1.0) for m in q.ROW_COUNTS} for s in shapes}
    calls = []

    def kernel(*args):
        calls.append(1)
        return qk.quantized_matmul_metal(*args, kernel_factory=harness.metal_kernel)

    assert q.install(target, q.Calibration("simulated", True, timings=every), kernel) == len(layers)
    target.set_taps([0, 1])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3)
    budget = None if mode == "dflash" else 8  # (the whole block; a tree of 8 nodes)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=24, mode=mode, budget=budget)
    assert out == ref and max(taus) > 1 and calls
