"""A decoder layer's two fixed-shape halves through `mx.compile`, where a pass's shape repeats.

A lone causal pass builds the same graph every round: a plain step (1 token), a DFlash block's
verify (the block size). Python spends most of a small target's verify building it, about 30
MLX operations a layer, each a Python call and several `nn.Module` lookups. `mx.compile` traces
a function once per input shape and then replays it without Python. So each layer runs as
- before the cache, compiled: the input norm, the q/k/v projections, the q/k norms and RoPE
  (its offset an array, so the trace does not depend on the position);
- over the cache, as always (models/attention.py attend_cached): the K/V append, and attention
  over a key count that grows every round;
- after it, compiled: the output gate, o_proj, the residual, the post norm, the MLP or MoE and
  the second residual.
The functions are the ones the plain layer calls (attention.py `_qkv`, `_output`;
families.py `mlp_half`), so the arithmetic is the same, operation for operation.

Where: the pre-norm families' standard-attention layers (most targets; Gated DeltaNet and MLA
layers run as before), a single causal pass without row padding, an unsharded target, and a
width where no numpy exponential applies (kernels/cpu_math.py: it syncs, a CPU trick).

Which device (engine/device.py), chosen once per target at its first load (`choose`):
- A GPU (Metal, CUDA): the compiled forward is first checked against the plain one on this
  device, bit for bit, on a plain step and a verify; then both are timed (models/queueing.py
  time_ways) and compiled layers are kept only where faster. Cached per model and machine;
  `dflash-mlx doctor -m MODEL` prints it. So it can never make a verify wrong or slower.
- The CPU backend: off. Its compiled kernels are C++ that MLX builds with the system's compiler
  at first use (about 3 s a kernel), and float32 targets take numpy's exponentials there.
- DFLASH_MLX_COMPILE=1 turns it on anywhere, 0 off (docs/settings.md). scripts/host_time.py
  sets 1 to show the host time a GPU's rounds have.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..engine import device
from ..settings import SETTINGS
from .attention import _output, _qkv, attend_cached
from .families import ffn_of, mlp_half, numpy_mlp, prenorm_block

REPEATS = 5


def applies(target, i: int, spans, h: mx.array) -> bool:
    """Whether layer i runs compiled in this forward (the module doc's conditions)."""
    if not target.compiled or len(spans) != 1 or target.world.sharded:
        return False
    r, lay = spans[0], target.layers[i]
    if r.parents is not None or h.shape[1] != r.b or target.mixers[i] != "attention":
        return False
    return target.family.block is prenorm_block and not numpy_mlp(ffn_of(lay), r.b, h.dtype)


def layer(target, i: int, h: mx.array, span) -> mx.array:
    """Layer i over h (1, T, H), a lone causal pass: the compiled halves around the cache."""
    lay = target.layers[i]
    fns = target.compiled_layers.get(i)
    if fns is None or fns[0] is not lay:  # (a module swapped since is traced anew)
        attn, spec = lay.self_attn, target.family.attention

        def before(h, offset):
            q, k, v, gate = _qkv(attn, spec, lay.input_layernorm(h), offset, None)
            return (q, k, v) if gate is None else (q, k, v, gate)

        def after(h, out, *gate):
            return mlp_half(lay, h + _output(attn, out, gate[0] if gate else None))

        # The layer's weights are inputs, not constants: a compiled function reads them each
        # call, so weights updated in place (nn.quantize, training) are never stale.
        fns = (lay, mx.compile(before, inputs=lay.state), mx.compile(after, inputs=lay.state))
        target.compiled_layers[i] = fns
    _, before, after = fns
    p = span.p
    q, k, v, *gate = before(h, mx.array(p.start, dtype=mx.int32))
    out = attend_cached(lay.self_attn, q, k, v, p.cache[i], p.start, None, None, span.masks,
                        target.windows[i])  # fmt: skip
    return after(h, out, *gate)


def setting() -> str:
    """DFLASH_MLX_COMPILE as "auto", "0" or "1"."""
    return SETTINGS.choice("compile", ("auto", "0", "1"))


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
    """Whether a plain step and a 16-token verify give the same logits, bit for bit, with
    compiled layers as with plain ones (a trace that fails counts as disagreeing)."""
    from ..engine.budget import session_at
    from ..engine.contract import Pass

    outs, kept = [], target.compiled
    try:
        for on in (False, True):
            _set(target, on)
            session, ids = session_at(target, 32)
            for n in (1, 16):
                logits, _ = target.forward([Pass(ids[:n], session.cache, 32)])[0]
                outs.append(np.array(logits.astype(mx.float32)))
                session.commit([])
    except Exception:  # noqa: BLE001 (any failure to trace keeps the plain layers)
        return False
    finally:
        _set(target, kept)
    half = len(outs) // 2
    return all(np.array_equal(a, b) for a, b in zip(outs[:half], outs[half:], strict=True))


def _set(target, on: bool) -> None:
    target.compiled = on
    target.compiled_layers.clear()


def choose(target, timer=measure) -> bool:
    """Whether `target`'s layers run compiled here (the module doc): the setting, else off on
    the CPU and on a sharded target, else measured once on a GPU (then cached)."""
    from .queueing import _measured

    target.compile_timings = None
    value = setting()
    if value != "auto":
        return value == "1"
    if device.on_cpu() or target.world.sharded:
        return False
    times = _measured(target, "-compile", ("plain", "compiled"), timer)
    target.compile_timings = times
    return times["compiled"] < times["plain"]
