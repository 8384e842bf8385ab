"""Tree attention: reference vs an explicit ancestor walk, the Metal kernel's exact source run
through the CPU harness (metal/harness), the harness's own honesty, and backend dispatch."""

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

from mlx_dflash.errors import DFlashError
from mlx_dflash.kernels import tree_attention as ta
from mlx_dflash.settings import SETTINGS

TOL = {  # (atol, rtol) against a float64 truth computed from the same rounded inputs
    mx.float32: (2e-5, 1e-4),
    mx.float16: (2e-3, 4e-3),
    mx.bfloat16: (1.6e-2, 3e-2),
}


# ---------------------------------------------------------------------------------------------
# Helpers


def walk_mask(parents: np.ndarray, prefix: int) -> np.ndarray:
    """The contract spelled out: prefix always visible, then self and ancestors by walking."""
    t = len(parents)
    mask = np.zeros((t, prefix + t), dtype=bool)
    mask[:, :prefix] = True
    for i in range(t):
        a = i
        while a >= 0:
            mask[i, prefix + a] = True
            a = parents[a]
    return mask


def numpy_tree_attention(q, k, v, parents, scale) -> np.ndarray:
    """Float64 attention with the walked mask; GQA by repeating KV heads."""
    q, k, v = (np.asarray(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    n_q, n_kv = q.shape[1], k.shape[1]
    k = np.repeat(k, n_q // n_kv, axis=1)
    v = np.repeat(v, n_q // n_kv, axis=1)
    prefix = k.shape[2] - q.shape[2]
    scores = np.einsum("bhtd,bhsd->bhts", q, k) * scale
    scores = np.where(walk_mask(np.asarray(parents), prefix), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bhsd->bhtd", p, v)


def make_qkv(rng, n_q, n_kv, t, prefix, d, dtype):
    q = mx.array(rng.standard_normal((1, n_q, t, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((1, n_kv, prefix + t, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, n_kv, prefix + t, d)).astype(np.float32)).astype(dtype)
    return q, k, v


def assert_close(out: mx.array, want: np.ndarray, dtype) -> None:
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype
    got = np.asarray(out.astype(mx.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# (a) reference path


@pytest.mark.parametrize("t", [1, 2, 3, 8, 17, 64])
@pytest.mark.parametrize("prefix", [0, 5])
def test_ancestor_mask_matches_walk(t, prefix):
    rng = np.random.default_rng(t * 10 + prefix)
    for parents in (random_tree(rng, t), chain(t), star(t)):
        got = np.asarray(ta.ancestor_mask(mx.array(parents), prefix))
        np.testing.assert_array_equal(got, walk_mask(parents, prefix))
        # numpy / list input goes through validation and gives the same mask
        np.testing.assert_array_equal(np.asarray(ta.ancestor_mask(parents.tolist(), prefix)), got)


def test_chain_mask_is_causal():
    got = np.asarray(ta.ancestor_mask(chain(9), 4))
    want = np.concatenate([np.ones((9, 4), bool), np.tril(np.ones((9, 9), bool))], axis=1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "parents", [[0], [-1, 1], [-1, 0, 3, 1], [-1, -1], [[-1, 0]], [-1.0, 0.0], []]
)
def test_validate_parents_rejects_bad_trees(parents):
    with pytest.raises(DFlashError):
        ta.validate_parents(np.array(parents))


@pytest.mark.parametrize(
    "n_q,n_kv,t,prefix,d,dtype",
    [
        (4, 4, 9, 0, 64, mx.float32),
        (8, 2, 13, 21, 128, mx.float32),
        (6, 1, 1, 7, 80, mx.float16),
        (4, 2, 30, 50, 96, mx.bfloat16),
    ],
)
def test_reference_matches_numpy(n_q, n_kv, t, prefix, d, dtype):
    rng = np.random.default_rng(t + prefix)
    parents = random_tree(rng, t)
    q, k, v = make_qkv(rng, n_q, n_kv, t, prefix, d, dtype)
    out = ta.tree_attention_reference(q, k, v, mx.array(parents), d**-0.5)
    assert_close(out, numpy_tree_attention(q, k, v, parents, d**-0.5), dtype)


# ---------------------------------------------------------------------------------------------
# (b) the Metal kernel, run through the CPU harness


def run_kernel_case(harness, rng, n_q, n_kv, t, prefix, d, dtype, parents, **plan):
    q, k, v = make_qkv(rng, n_q, n_kv, t, prefix, d, dtype)
    scale = 1.0 / np.sqrt(d) * 1.3
    out = ta.tree_attention_metal(
        q, k, v, mx.array(parents), scale, kernel_factory=harness.metal_kernel, **plan
    )
    assert out.shape == q.shape
    assert_close(out, numpy_tree_attention(q, k, v, parents, scale), dtype)


@pytest.mark.parametrize("d", ta.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_head_dims_and_dtypes(harness, d, dtype):
    rng = np.random.default_rng(d)
    run_kernel_case(harness, rng, 4, 2, 6, 21, d, dtype, random_tree(rng, 6))


@pytest.mark.parametrize("gqa", range(1, 9))
def test_kernel_every_gqa_ratio(harness, gqa):
    rng = np.random.default_rng(100 + gqa)
    n_kv = 2 if gqa <= 4 else 1
    dtype = (mx.float32, mx.float16, mx.bfloat16)[gqa % 3]
    run_kernel_case(harness, rng, gqa * n_kv, n_kv, 7, 19, 64, dtype, random_tree(rng, 7))


@pytest.mark.parametrize(
    "name,n_q,n_kv,t,prefix,d,dtype,tree",
    [
        ("one_node_no_prefix", 2, 1, 1, 0, 64, mx.float32, "random"),
        ("one_node_decode", 8, 2, 1, 37, 128, mx.float16, "random"),
        ("empty_prefix", 4, 4, 12, 0, 80, mx.bfloat16, "random"),
        ("odd_prefix", 3, 1, 9, 133, 96, mx.float32, "random"),
        ("deep_chain", 2, 1, 300, 40, 64, mx.float16, "chain"),
        ("wide_tree", 4, 2, 200, 17, 128, mx.bfloat16, "star"),
    ],
)
def test_kernel_shapes(harness, name, n_q, n_kv, t, prefix, d, dtype, tree):
    rng = np.random.default_rng(len(name))
    parents = {"random": random_tree(rng, t), "chain": chain(t), "star": star(t)}[tree]
    run_kernel_case(harness, rng, n_q, n_kv, t, prefix, d, dtype, parents)


def test_kernel_long_prefix_takes_split_path(harness):
    plan = ta.plan_tree_attention(4, 2, 5, 1531, 128)
    assert plan.n_splits > 1 and 1531 % plan.n_splits  # last chunk is shorter
    rng = np.random.default_rng(7)
    run_kernel_case(harness, rng, 4, 2, 5, 1531, 128, mx.float16, random_tree(rng, 5))


@pytest.mark.parametrize("prefix,n_splits", [(2, 5), (5, 4), (10, 3), (0, 2)])
def test_kernel_forced_splits_with_tiny_or_empty_chunks(harness, prefix, n_splits):
    rng = np.random.default_rng(prefix * 7 + n_splits)
    run_kernel_case(
        harness, rng, 2, 1, 6, prefix, 64, mx.float32, random_tree(rng, 6), n_splits=n_splits
    )


def test_kernel_token_blocks(harness):
    # Chosen automatically once there are plenty of threadgroups ...
    plan = ta.plan_tree_attention(8, 8, 130, 30, 64)
    assert plan.tokens_per_group > 1 and plan.n_splits == 1
    rng = np.random.default_rng(11)
    run_kernel_case(harness, rng, 8, 8, 130, 30, 64, mx.float16, random_tree(rng, 130))
    # ... and forced, with a partial last block and a split.
    run_kernel_case(
        harness,
        rng,
        4,
        2,
        10,
        9,
        80,
        mx.bfloat16,
        random_tree(rng, 10),
        tokens_per_group=3,
        n_splits=2,
    )


def test_kernel_reads_strided_kv_cache_and_mixed_dtypes(harness):
    """KV-cache slices and transposed q go in uncopied (through *_strides)."""
    rng = np.random.default_rng(3)
    n_q, n_kv, t, prefix, d = 4, 2, 5, 11, 64
    k_buf = mx.array(rng.standard_normal((1, n_kv, 48, d)).astype(np.float32))
    v_buf = mx.array(rng.standard_normal((1, n_kv, 48, d)).astype(np.float32))
    k = k_buf[:, :, : prefix + t, :]
    v = v_buf[:, :, : prefix + t, :]
    q = mx.array(rng.standard_normal((1, t, n_q, d)).astype(np.float32)).astype(mx.float16)
    q = q.transpose(0, 2, 1, 3)
    parents = random_tree(rng, t)
    out = ta.tree_attention_metal(q, k, v, parents, 0.125, kernel_factory=harness.metal_kernel)
    assert_close(
        out,
        numpy_tree_attention(q, k.astype(q.dtype), v.astype(q.dtype), parents, 0.125),
        mx.float16,
    )


def test_kernel_survives_malformed_parents(harness):
    """A cycle or forward edge must not hang the GPU: the walk requires parents[i] < i."""
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 2, 1, 4, 3, 64, mx.float32)
    bad = mx.array(np.array([-1, 1, 3, 2], dtype=np.int32))  # self loop and a 2-cycle
    out = ta.tree_attention_metal(q, k, v, bad, 0.125, kernel_factory=harness.metal_kernel)
    assert np.isfinite(np.asarray(out)).all()


def test_plan_rules():
    # the grid counts threads: 128 per threadgroup along x
    plan = ta.plan_tree_attention(32, 8, 16, 100, 128)
    assert plan.threadgroup == (128, 1, 1)
    assert plan.grid == (128 * plan.head_blocks, 16, 1)
    assert plan.heads_per_group == 4 and plan.head_blocks == 8
    assert ta.plan_tree_attention(16, 2, 8, 100, 256).heads_per_group == 2
    # short prefix: single pass; long prefix with a small tree: split, chunks >= SPLIT_MIN_KEYS
    assert ta.plan_tree_attention(32, 8, 16, 300, 128).n_splits == 1
    long = ta.plan_tree_attention(32, 8, 1, 4096, 128)
    assert 1 < long.n_splits <= 4096 // ta.SPLIT_MIN_KEYS
    # a big tree already fills the GPU
    assert ta.plan_tree_attention(32, 8, 256, 4096, 128).n_splits == 1


# ---------------------------------------------------------------------------------------------
# (c) the harness: MLX's signature layout, real collectives, and refusing what it cannot model


def test_generated_signature_matches_mlx_layout(harness):
    src = "uint i = thread_position_in_grid.x; out[i] = a[i] * b[0] + float(a_shape[0]);"
    text = harness.generate_source(
        name="demo",
        input_names=["a", "b"],
        output_names=["out"],
        source=src,
        header="// hdr\n",
        inputs=[np.zeros(16, np.float16), np.zeros(1, np.float32)],
        template=[("T", mx.float16), ("N", 4), ("F", True)],
        output_dtypes=[mx.float32],
    )
    name = "custom_kernel_demo__float16_t_4_1_float16_t_floatc_float"
    assert text == (
        "// hdr\n"
        "template <typename T, int N, bool F>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float16_t* a [[buffer(0)]],\n"
        "  const constant int* a_shape [[buffer(1)]],\n"
        "  const constant float* b [[buffer(2)]],\n"
        "  device float* out [[buffer(3)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        f"{src}\n}}\n\n"
        f'template [[host_name("{name}")]] [[kernel]] decltype({name}<float16_t, 4, 1>) '
        f"{name}<float16_t, 4, 1>;\n"
    )


def test_generated_source_is_what_installed_mlx_generates(harness, tmp_path):
    """Trace the real mx.fast.metal_kernel (export needs no GPU) and find the harness's
    rendering of each launch, byte for byte, in the exported graph."""
    rng = np.random.default_rng(2)
    q, k, v = make_qkv(rng, 6, 2, 3, 1000, 80, mx.bfloat16)  # long prefix: fwd + merge
    parents = mx.array(random_tree(rng, 3))

    def fn(q, k, v, parents, kernel_factory):
        return ta.tree_attention_metal(q, k, v, parents, 0.1, kernel_factory=kernel_factory)

    path = tmp_path / "tree_attention.mlxfn"
    assert check_generated_source(harness, path, fn, q, k, v, parents) == [
        "dflash_tree_attention_fwd",
        "dflash_tree_attention_merge",
    ]


def run_small(harness, source, inputs, n_out, grid, tg, header="", dtype=mx.float32, **kw):
    (out,) = harness.run_kernel(
        name="probe",
        input_names=[f"in{i}" for i in range(len(inputs))],
        output_names=["out"],
        source=source,
        header=header,
        inputs=inputs,
        grid=grid,
        threadgroup=tg,
        output_shapes=[(n_out,)],
        output_dtypes=[dtype],
        **kw,
    )
    return out


def test_harness_collectives_exchange_values(harness):
    x = np.arange(96, dtype=np.float32) * 0.5
    src = """
    const uint i = thread_position_in_grid.x;
    float v = in0[i];
    float tree = v;
    for (ushort m = 16; m > 0; m /= 2) { tree += simd_shuffle_xor(tree, m); }
    threadgroup float shared[96];
    shared[thread_index_in_threadgroup] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float other = shared[threads_per_threadgroup.x - 1 - thread_index_in_threadgroup];
    out[i] = simd_sum(v) - tree + simd_max(v) * 1000.0f + other * 1e6f
             + simd_shuffle(v, 3) * 1e-3f;
    """
    out = run_small(harness, src, [x], 96, (96, 1, 1), (96, 1, 1))
    lanes = x.reshape(3, 32)
    want = np.repeat(lanes.max(1), 32) * 1000.0 + x[::-1] * 1e6 + np.repeat(lanes[:, 3], 32) * 1e-3
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_harness_partial_threadgroups_and_positions(harness):
    src = """
    const uint i = thread_position_in_grid.x + thread_position_in_grid.y * threads_per_grid.x;
    out[i] = float(threadgroup_position_in_grid.x * 1000 + threads_per_threadgroup.x * 10
                   + simd_sum(1u));
    """
    out = run_small(harness, src, [np.zeros(8, np.float32)], 2 * 40, (40, 2, 1), (16, 1, 1))
    want = []
    for _row in range(2):
        for x in range(40):
            g = x // 16
            width = min(16, 40 - 16 * g)
            want.append(g * 1000 + width * 10 + width)
    np.testing.assert_array_equal(out, np.array(want, np.float32))


def test_harness_bfloat16_rounds_to_nearest_even(harness):
    vals = np.array(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8) - 2**-20, 3.3, 1e-3, 65504.0, np.inf, 0.0],
        dtype=np.float32,
    )
    src = (
        "out[thread_position_in_grid.x] = static_cast<bfloat16_t>(in0[thread_position_in_grid.x]);"
    )
    out = run_small(harness, src, [vals], 8, (8, 1, 1), (8, 1, 1), dtype=mx.bfloat16)
    want = np.asarray(mx.array(vals).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize(
    "source,feature",
    [
        (
            "atomic_fetch_add_explicit((device atomic_float*)out, 1.0f, memory_order_relaxed);",
            "atomic",
        ),
        ("double x = in0[0]; out[0] = x;", "double"),
        ("thread float* p = &out[0]; *p = 1.0f;", "thread"),
        ("out[0] = quad_sum(in0[0]);", "quad_sum"),
        ("simdgroup_matrix<float, 4, 4> m; out[0] = 0.0f;", "8x8 simdgroup matrices only"),
        ("float4 v = float4(1.0f); out[0] = v.xy.x;", "xy"),
        ("[[clang::always_inline]] float x = in0[0]; out[0] = x;", "attribute"),
        ("out[0] = Limits<float>::max;", "Limits"),
    ],
)
def test_harness_refuses_unmodelled_metal(harness, source, feature):
    with pytest.raises(harness.KernelCompileError) as err:
        run_small(harness, source, [np.zeros(8, np.float32)], 8, (1, 1, 1), (1, 1, 1))
    message = str(err.value)
    assert "metal_shim.h" in message and feature in message


@pytest.mark.parametrize(
    "source,expect",
    [
        (
            "out[thread_position_in_grid.x] = in0[thread_position_in_grid.x + 1];",
            "out-of-bounds read on buffer 'in0'",
        ),
        (
            "if (thread_position_in_grid.x < 5) return;"
            " threadgroup_barrier(mem_flags::mem_threadgroup); out[0] = 1.0f;",
            "threadgroup_barrier",
        ),
        (
            "out[thread_position_in_grid.x] = thread_position_in_grid.x % 2"
            " ? simd_sum(in0[0]) : simd_max(in0[0]);",
            "diverging collective",
        ),
        (
            "if (thread_index_in_simdgroup == 0) return; out[0] = simd_sum(in0[0]);",
            "inactive lanes",
        ),
    ],
)
def test_harness_reports_kernel_bugs(harness, source, expect):
    with pytest.raises(harness.KernelRuntimeError, match=expect):
        run_small(harness, source, [np.zeros(64, np.float32)], 64, (64, 1, 1), (64, 1, 1))


def test_harness_exposes_a_missing_barrier(harness):
    """Threads of odd threadgroups run in reverse, so skipping the barrier gives stale data."""
    body = """
    threadgroup float shared[32];
    const uint t = thread_index_in_threadgroup;
    shared[t] = in0[thread_position_in_grid.x];
    {barrier}
    out[thread_position_in_grid.x] = shared[31 - t];
    """
    x = np.arange(64, dtype=np.float32) + 1
    want = np.concatenate([x[:32][::-1], x[32:][::-1]])
    ok = body.replace("{barrier}", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    np.testing.assert_array_equal(run_small(harness, ok, [x], 64, (64, 1, 1), (32, 1, 1)), want)
    racy = body.replace("{barrier}", "")
    assert not np.array_equal(run_small(harness, racy, [x], 64, (64, 1, 1), (32, 1, 1)), want)


def test_harness_poisons_unwritten_outputs(harness):
    src = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;"
    out = run_small(harness, src, [np.zeros(8, np.float32)], 8, (8, 1, 1), (8, 1, 1))
    assert np.isnan(out[1::2]).all() and (out[::2] == 1).all()


# ---------------------------------------------------------------------------------------------
# (d) dispatch


@pytest.fixture
def qkv_small():
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, 4, 2, 5, 6, 64, mx.float32)
    return q, k, v, random_tree(rng, 5)


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the machine without Metal")
def test_dispatch_without_metal(monkeypatch, qkv_small):
    q, k, v, parents = qkv_small
    ref = ta.tree_attention_reference(q, k, v, parents, 0.3)
    for mode in (None, "auto", "reference", "REFERENCE"):
        if mode is None:
            monkeypatch.setattr(SETTINGS, ta.SETTING, "")
        else:
            monkeypatch.setattr(SETTINGS, ta.SETTING, mode)
        np.testing.assert_array_equal(
            np.asarray(ta.tree_attention(q, k, v, parents, 0.3)), np.asarray(ref)
        )
        assert ta.attention_backend().startswith("reference")
    monkeypatch.setattr(SETTINGS, ta.SETTING, "metal")
    with pytest.raises(DFlashError, match="Metal"):
        ta.tree_attention(q, k, v, parents, 0.3)
    assert "no Metal" in ta.attention_backend()


def test_dispatch_rejects_unknown_mode(monkeypatch, qkv_small):
    monkeypatch.setattr(SETTINGS, ta.SETTING, "cuda")
    with pytest.raises(DFlashError, match=ta.ENV_VAR):
        ta.tree_attention(*qkv_small, 0.3)
    assert ta.attention_backend().startswith("invalid")


def test_dispatch_picks_kernel_when_metal_is_present(monkeypatch, harness, qkv_small):
    """With Metal (simulated by the harness) auto and metal modes run the kernel path."""
    from mlx_dflash.kernels import self_check as kernel_check

    q, k, v, parents = qkv_small
    monkeypatch.setattr(kernel_check, "kernel_ok", lambda family: True)  # see test_kernel_check
    monkeypatch.setattr(ta.mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(ta.mx.fast, "metal_kernel", harness.metal_kernel)
    calls = []
    real = ta.tree_attention_metal
    monkeypatch.setattr(
        ta, "tree_attention_metal", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    want = numpy_tree_attention(q, k, v, parents, 0.3)
    for mode in ("auto", "metal"):
        monkeypatch.setattr(SETTINGS, ta.SETTING, mode)
        assert_close(ta.tree_attention(q, k, v, parents, 0.3), want, mx.float32)
    assert len(calls) == 2
    assert ta.attention_backend().startswith("metal")
    # shapes the kernel does not take: reference under auto, an error under metal
    q48, k48, v48 = make_qkv(np.random.default_rng(1), 2, 1, 5, 3, 48, mx.float32)
    monkeypatch.setattr(SETTINGS, ta.SETTING, "auto")
    ta.tree_attention(q48, k48, v48, parents, 0.3)
    assert len(calls) == 2
    monkeypatch.setattr(SETTINGS, ta.SETTING, "metal")
    with pytest.raises(DFlashError, match="head dim 48"):
        ta.tree_attention(q48, k48, v48, parents, 0.3)


def test_kernel_sources_found_in_wheel_layout(monkeypatch, tmp_path):
    check_sources_in_wheel_layout(
        monkeypatch,
        tmp_path,
        ta,
        "tree_attention.metal",
        ["tree_attention_fwd", "tree_attention_merge"],
    )
