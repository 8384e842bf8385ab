"""A layer's halves through mx.compile (models/compiled.py): where they apply, bit-equal logits
and the target's own greedy decoding in every family, and the choice (off on the CPU, checked
and then timed on a GPU, cached, shown by doctor), with a simulated GPU and fake timings.

mx.compile on MLX's CPU backend builds its fused kernels with the system's C++ compiler; where
there is none, the tests that run compiled layers skip, saying so."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import FIXTURES
from oracle import OracleDrafter
from test_engine import mlx_lm_greedy, run

from mlx_dflash.cli.doctor import compile_line
from mlx_dflash.engine import Session
from mlx_dflash.engine import device as engine_device
from mlx_dflash.engine.contract import Pass
from mlx_dflash.models import compiled
from mlx_dflash.models.target import load_target

PROMPT = [5, 17, 3, 88, 41, 9, 120, 64, 33, 7, 200, 150, 12, 99, 45, 6, 71, 18, 230, 4]
N = 40
# Families whose layers are all pre-norm standard attention (the rest: some or none compiled)
ALL_COMPILED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")
TREE = np.array([-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7])


@pytest.fixture(scope="module")
def can_compile():
    try:
        mx.eval(mx.compile(lambda a: mx.exp(a) * a + 1)(mx.ones((4,))))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"mx.compile does not run on this machine's MLX backend ({e})")


@pytest.fixture
def no_numpy(monkeypatch):
    """numpy's exponentials (a CPU trick that syncs) off, as on a GPU."""
    from mlx_dflash.settings import SETTINGS

    monkeypatch.setattr(SETTINGS, "numpy_math", "0")


def _target(tmp_path, name="qwen3"):
    target = load_target(FIXTURES[name](tmp_path))
    target.set_taps([1, target.num_layers - 1])
    return target


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_compiled_layers_decode_as_mlx_lm_in_every_family(name, tmp_path, can_compile, no_numpy):
    """With compiled layers on, a plain step's, a 16-token verify's and a 16-node tree's logits
    and taps are the plain layers' bit for bit, and greedy DFlash and DDTree (an oracle
    drafter) and plain decoding give mlx-lm's own continuation; the families of pre-norm
    attention layers did run compiled."""
    target = _target(tmp_path, name)
    ref = mlx_lm_greedy(target, PROMPT, N)
    outs = []
    for on in (False, True):
        compiled._set(target, on)
        session = Session(target)
        prefill = Pass(mx.array(PROMPT), session.cache, 0, taps=True, rewindable=False)
        target.forward([prefill])  # (a prefill: run once, so not compiled)
        session.commit(PROMPT)
        session.mark_prompt_end()
        for n, parents in ((1, None), (16, None), (16, TREE)):
            for _ in range(compiled.SEEN):  # (a token count runs compiled once seen before)
                p = Pass(mx.array(ref[:n]), session.cache, len(PROMPT), taps=True, parents=parents)
                logits, taps = target.forward([p])[0]
                mx.eval(logits, taps)
                session.commit([])
            outs.append((np.array(logits), np.array(taps)))
    for (a, ta), (b, tb) in zip(outs[:3], outs[3:], strict=True):
        assert np.array_equal(a, b) and np.array_equal(ta, tb), name
    if name in ALL_COMPILED:
        assert len(target.compiled_layers) == target.num_layers, name
    assert compiled.agrees(target), name  # (the GPU's check, over its own passes)
    compiled._set(target, True)
    for mode, budget in (("dflash", 1), ("ddtree", 8), ("ar", 1)):
        oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=1)
        out, _ = run(Session(target, oracle), PROMPT, max_tokens=N, mode=mode, budget=budget)
        assert out == ref, (name, mode)


def test_where_the_halves_apply(tmp_path, can_compile, no_numpy, monkeypatch):
    """A lone pass (causal or a tree) without row padding, from the SEEN-th pass of its token
    count on; not packed rows, row padding, a sharded target, or (per layer) a layer whose MLP
    takes numpy's exponentials."""
    from mlx_dflash.models.forward import place

    target = _target(tmp_path)
    compiled._set(target, True)
    cache = target.make_cache()
    block = place(Pass(mx.array(PROMPT[:16]), cache, 0))
    h = mx.zeros((1, 16, target.hidden_size))
    assert [compiled.applies(target, [block], h) for _ in range(3)] == [False, True, True]
    tree = place(Pass(mx.array(PROMPT[:4]), cache, 0, parents=np.array([-1, 0, 0, 1])))
    assert [compiled.applies(target, [tree], h[:, :4]) for _ in range(2)] == [False, True]
    packed = [block, place(block.p, 16)]
    assert not compiled.applies(target, packed, mx.zeros((1, 32, target.hidden_size)))
    assert not compiled.applies(target, [block], mx.zeros((1, 24, target.hidden_size)))
    assert compiled.layer_applies(target, 0, h)
    monkeypatch.setattr(compiled, "numpy_mlp", lambda *a: True)
    assert not compiled.layer_applies(target, 0, h)
    compiled._set(target, False)
    assert not compiled.applies(target, [block], h)


def test_the_cpu_does_not_compile_unless_asked(tmp_path, monkeypatch):
    from mlx_dflash.settings import SETTINGS

    target = _target(tmp_path)
    assert target.compiled is False and target.compile_timings is None
    assert compiled.choose(target, timer=lambda t: pytest.fail("timed on the CPU")) is False
    assert "off" in compile_line(target)
    monkeypatch.setattr(SETTINGS, "compile", "1")
    assert compiled.choose(target, timer=lambda t: pytest.fail("timed when forced")) is True
    monkeypatch.setattr(SETTINGS, "compile", "maybe")
    with pytest.raises(Exception, match="DFLASH_MLX_COMPILE must be one of"):
        compiled.choose(target)


@pytest.mark.parametrize(
    "timings, on",
    [
        ({"plain": 0.010, "compiled": 0.008}, True),
        ({"plain": 0.008, "compiled": 0.010}, False),
        ({"plain": 0.009, "compiled": 0.009}, False),  # a tie keeps the plain layers
        ({"plain": 0.010, "compiled": float("inf")}, False),  # it disagreed on the device
    ],
)
def test_a_gpu_keeps_compiled_layers_only_where_faster(tmp_path, monkeypatch, timings, on):
    target = _target(tmp_path)
    monkeypatch.setattr(engine_device, "device_class", lambda: "metal")
    calls = []
    fake = lambda t: (calls.append(t), dict(timings))[1]  # noqa: E731
    monkeypatch.setitem(target.config, "compile_case", str(timings))
    assert compiled.choose(target, timer=fake) is on
    assert compiled.choose(target, timer=fake) is on  # read back from the cache
    assert len(calls) == 1 and target.compile_timings == timings
    target.compiled = on
    line = compile_line(target)
    assert line.startswith("on" if on else "off")
    assert ("disagreed" in line) is (timings["compiled"] == float("inf"))


def test_the_measurement_checks_the_output_first(tmp_path, can_compile, no_numpy, monkeypatch):
    """measure() runs both ways for real (here on the CPU) and leaves the target as it was;
    compiled layers whose output differs are never timed, and read as infinitely slow."""
    target = _target(tmp_path)
    times = compiled.measure(target, repeats=1)
    assert set(times) == {"plain", "compiled"} and min(times.values()) > 0
    assert target.compiled is False and not target.compiled_layers
    assert compiled.agrees(target)
    real = compiled.mlp_half
    monkeypatch.setattr(compiled, "mlp_half", lambda *a: real(*a) * (1 + 2**-10))
    assert not compiled.agrees(target)
    from mlx_dflash.models import queueing

    monkeypatch.setattr(queueing, "time_ways", lambda *a: pytest.fail("timed"))
    assert compiled.measure(target, repeats=1)["compiled"] == float("inf")
    assert target.compiled is False


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_target_compiles_exactly(bits, tmp_path, can_compile, no_numpy):
    """The targets users run: mlx-lm's 4- and 8-bit linear layers, compiled, decode as mlx-lm,
    also where the layers were traced before they were quantized (never a stale weight)."""
    import mlx.nn as nn

    target = _target(tmp_path, "qwen3")
    compiled._set(target, True)
    run(Session(target), PROMPT, max_tokens=4, mode="ar")  # traced over the float weights
    nn.quantize(target.model, group_size=32, bits=bits)  # then quantized in place
    ref = mlx_lm_greedy(target, PROMPT, N)
    for mode in ("dflash", "ar"):
        oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=1)
        out, _ = run(Session(target, oracle), PROMPT, max_tokens=N, mode=mode)
        assert out == ref, (bits, mode)
    assert len(target.compiled_layers) == target.num_layers


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_drafters_compiled_pass_is_its_plain_one(kind, can_compile, no_numpy):
    """The embedded pair's drafter (DFlash; and grown into DFlash 2, its convolutions and
    selector made random): with its target's layers compiled, its block pass's logits are the
    plain pass's bit for bit, and DFlash decodes the target's own greedy text with the same
    acceptance, round for round."""
    import mlx.nn as nn

    from mlx_dflash.models.drafter import DrafterRunner, to_dflash2
    from mlx_dflash.models.pair import load_pair
    from mlx_dflash.paths import DEFAULT_DRAFTER, DEFAULT_TARGET

    target, runner = load_pair(str(DEFAULT_TARGET), str(DEFAULT_DRAFTER))
    if kind == "dflash2":
        drafter = to_dflash2(runner.drafter, rank=8, top_k=4, group_size=8)
        noise = {
            k: mx.random.normal(v.shape, key=mx.random.key(i)) * 0.05
            for i, (k, v) in enumerate(nn.utils.tree_flatten(drafter.parameters()))
            if "conv" in k or "candidate_selector" in k
        }
        drafter.update(nn.utils.tree_unflatten(list(noise.items())))
        runner = DrafterRunner(drafter, target)
    prompt = target.tokenizer.encode("Once upon a time, there was a little")
    results = []
    for on in (False, True):
        compiled._set(target, on)
        out, taus = run(Session(target, runner), prompt, max_tokens=N)
        session = Session(target, runner)
        first, _ = run(session, prompt, max_tokens=1)  # (the prompt's taps in its context)
        props = runner.propose(first[-1], len(session.tokens), runner.block_size - 1)
        lat = getattr(props, "lattice", None)  # DFlash 2's selector: compiled with the layers
        scores = [] if lat is None else [np.array(a) for a in (lat.cand, lat.first, lat.pairs)]
        results.append((out, taus, np.array(props.logits), scores))
    assert results[0][0] == results[1][0] == mlx_lm_greedy(target, prompt, N)
    assert results[0][1] == results[1][1]
    assert np.array_equal(results[0][2], results[1][2])
    assert all(np.array_equal(a, b) for a, b in zip(*(r[3] for r in results), strict=True))
    if kind == "dflash2":
        assert runner.drafter.candidate_selector.__dict__.get("_dflash_compiled") is not None
    assert runner.drafter.layers[0].__dict__.get("_dflash_compiled") is not None
