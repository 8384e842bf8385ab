"""A decoder layer's two fixed-shape halves through `mx.compile`, where a pass's shape repeats.

Most passes repeat a shape round after round: a plain step (1 token), a DFlash block's verify
(the block size), a tree of a given budget. Python spends most of a small target's verify
building its graph, about 30 MLX operations a layer, each a Python call and several
`nn.Module` lookups. `mx.compile` traces a function once per input shape, then replays it
without Python. So each layer runs as
- before the cache, compiled: the input norm, the q/k/v projections, the q/k norms and RoPE
  (its offset, or a tree's per-token positions, an array input, so the trace does not depend on
  where the pass is);
- over the cache, as always (models/attention.py attend_cached): the K/V append, and causal or
  tree attention over a key count that grows every round;
- after it, compiled: the output gate, o_proj, the residual, the post norm, the MLP or MoE and
  the second residual.
The functions are the ones the plain layer calls (attention.py `_qkv`, `_output`;
families.py `mlp_half`), so the arithmetic is the same, operation for operation. The layer's
weights are the compiled functions' inputs, not constants, so weights changed in place
(nn.quantize, training) are never stale.

Where: the pre-norm families' standard-attention layers (most targets; Gated DeltaNet and MLA
layers run as before), a lone pass (not batched rows) without row padding, an unsharded target,
a width where no numpy exponential applies (kernels/cpu_math.py: it syncs, a CPU trick), and a
token count this target has run before (`SEEN`): a new shape costs a trace, a few builds'
worth, which a shape seen once (a prompt's odd-sized last chunk, a rare tree size) never pays
back.

Which device (engine/device.py), chosen once per target at its first load (`choose`):
- A GPU (Metal, CUDA): the compiled forward is first checked against the plain one on this
  device, bit for bit, on a plain step, a verify and a tree (`agrees`); then both are timed (models/queueing.py
  time_ways) and compiled layers are kept only where faster. Cached per model and machine;
  `dflash-mlx doctor -m MODEL` prints it. So it can never make a verify wrong or slower.
- The CPU backend: off. Its compiled kernels are C++ that MLX builds with the system's compiler
  at first use (about 3 s a kernel), and float32 targets take numpy's exponentials there.
- The drafter's layers and DFlash 2's candidate selector follow the target's choice, unchecked:
  a draft decides only what is proposed, never what is kept (the target verifies every token,
  and sampling accepts against the q the draft was drawn from), so their bits move tau, never
  the greedy output nor the sampled distribution.
- DFLASH_MLX_COMPILE=1 turns it on anywhere, 0 off (docs/settings.md). scripts/host_time.py
  sets 1 to show the host time a GPU's rounds have.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..engine import device
from ..settings import SETTINGS
from .attention import _output, _qkv, attend_cached
from .families import ffn_of, mlp_half, numpy_mlp, prenorm_block

REPEATS = 5
SEEN = 2  # a token count is compiled from the pass that runs it for the SEEN-th time on


def applies(target, spans, h: mx.array) -> bool:
    """Whether this forward's layers may run compiled (then `layer_applies` says which)."""
    if not target.compiled or len(spans) != 1 or target.world.sharded:
        return False
    T = spans[0].b
    if h.shape[1] != T:  # row padding (models/padding.py)
        return False
    seen = target.compiled_shapes[T] = target.compiled_shapes.get(T, 0) + 1
    return seen >= SEEN


def layer_applies(target, i: int, h: mx.array, numpy: bool = True) -> bool:
    """Whether layer i runs compiled over h: a pre-norm standard-attention layer whose MLP
    takes no numpy exponentials at this width (`numpy`: whether this forward may take them at
    all, cpu_math.enabled())."""
    if target.mixers[i] != "attention" or target.family.block is not prenorm_block:
        return False
    return not (numpy and numpy_mlp(ffn_of(target.layers[i]), h.shape[1], h.dtype))


def traced_at(span) -> mx.array:
    """What the halves trace their RoPE over, once a forward: a tree's positions (T,), else
    the pass's start (0-d)."""
    return span.positions if span.positions is not None else mx.array(span.p.start, mx.int32)


def layer(target, i: int, h: mx.array, span, at: mx.array) -> mx.array:
    """Layer i over h (1, T, H), a lone pass (a causal block or a tree) at `at` (`traced_at`):
    the compiled halves around the cache."""
    lay = target.layers[i]
    fns = target.compiled_layers.get(i)
    if fns is None or fns[0] is not lay:  # (a module swapped since is traced anew)
        attn, spec = lay.self_attn, target.family.attention

        def before(h, at):  # at: the pass's start (0-d), or a tree's positions (T,)
            x = lay.input_layernorm(h)
            tree = at.ndim == 1
            q, k, v, gate = _qkv(attn, spec, x, 0 if tree else at, at if tree else None)
            return (q, k, v) if gate is None else (q, k, v, gate)

        def after(h, out, *gate):
            # (layer_applies: no numpy exponentials at this width, so mlx-lm's MLP itself)
            return mlp_half(lay, h + _output(attn, out, gate[0] if gate else None), ffn_of(lay))

        fns = (lay, mx.compile(before, inputs=lay.state), mx.compile(after, inputs=lay.state))
        target.compiled_layers[i] = fns
    _, before, after = fns
    p = span.p
    q, k, v, *gate = before(h, at)
    out = attend_cached(lay.self_attn, q, k, v, p.cache[i], p.start, span.positions,
                        span.parents, span.masks, target.windows[i])  # fmt: skip
    return after(h, out, *gate)


def compiled_once(module, make: Callable[[], tuple[Callable, ...]]) -> tuple[Callable, ...]:
    """make()'s functions through mx.compile with `module`'s weights as their inputs (so a
    weight changed in place is never stale), compiled at the first call and kept in the
    module's __dict__ (not a child module: off its weights). The drafter's layers and DFlash
    2's selector run this way where the target's layers run compiled."""
    fns = module.__dict__.get("_dflash_compiled")
    if fns is None:
        fns = tuple(mx.compile(f, inputs=module.state) for f in make())
        module.__dict__["_dflash_compiled"] = fns
    return fns


def measure(target, repeats: int = REPEATS) -> dict[str, float]:
    """A verify's seconds with plain and compiled layers (models/queueing.py time_ways); the
    compiled ones +inf where their output differs from the plain layers' on this device."""
    from .queueing import time_ways

    kept = target.compiled
    try:
        if not agrees(target):
            return {"plain": 0.0, "compiled": float("inf")}
        ways = {"plain": lambda: _set(target, False), "compiled": lambda: _set(target, True)}
        return time_ways(target, ways, repeats)
    finally:
        _set(target, kept)


def agrees(target) -> bool:
    """Whether a plain step, a 16-token verify and a 16-node tree give the same logits, bit for
    bit, with compiled layers as with plain ones (each pass run SEEN times, so that the last
    runs compiled; a trace that fails counts as disagreeing)."""
    from ..engine.budget import session_at
    from ..engine.contract import Pass

    tree = np.array([-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7])
    outs, kept = [], target.compiled
    try:
        for on in (False, True):
            _set(target, on)
            session, ids = session_at(target, 32)
            for n, parents in ((1, None), (16, None), (16, tree)):
                for _ in range(SEEN):
                    p = Pass(ids[:n], session.cache, 32, parents=parents)
                    logits, _ = target.forward([p])[0]
                    session.commit([])
                outs.append(np.array(logits.astype(mx.float32)))
    except Exception:  # noqa: BLE001 (any failure to trace keeps the plain layers)
        return False
    finally:
        _set(target, kept)
    half = len(outs) // 2
    return all(np.array_equal(a, b) for a, b in zip(outs[:half], outs[half:], strict=True))


def _set(target, on: bool) -> None:
    target.compiled = on
    target.compiled_layers.clear()
    target.compiled_shapes.clear()


def choose(target, timer=measure) -> bool:
    """Whether `target`'s layers run compiled here (the module doc): the setting, else off on
    the CPU and on a sharded target, else measured once on a GPU (then cached)."""
    from .queueing import faster

    target.compile_timings = None
    value = SETTINGS.choice("compile", ("auto", "0", "1"))  # DFLASH_MLX_COMPILE
    if value != "auto":
        return value == "1"
    if device.on_cpu() or target.world.sharded:
        return False
    return faster(target, "-compile", ("plain", "compiled"), timer, "compile_timings")
