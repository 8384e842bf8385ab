"""Packed forwards (models/forward.py): several sessions' passes (a causal block, a tree, a
plain step, a prefill chunk) run as one forward give each row what its own forward gives,
and leave every cache as its own forward would, in every attention family."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import attention_target

from mlx_dflash.engine.contract import Pass

PROMPTS = [list(range(3, 3 + n)) for n in (14, 23, 9)]
TREE = np.array([-1, 0, 0, 1, 1, 2, 3], dtype=np.int32)


# Causal attention, Gated DeltaNet rows, MLA, windows past their width, sinks.
KINDS = ["llama", "qwen3_5", "deepseek_v3", "gemma4-31b", "gpt-oss-20b"]


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory):
    return attention_target(request.param, tmp_path_factory.mktemp(request.param))


def close(a, b) -> bool:
    """Equal up to float32 rounding: BLAS sums a 5-row and a 36-row matmul in different
    orders, and the taps (hidden states up to ~150 in these models) round at ~1e-6 of their
    scale; a wrong mask or row would be off by O(1)."""
    a, b = np.array(a), np.array(b)
    return np.allclose(a, b, atol=2e-4 + 1e-5 * float(np.abs(b).max(initial=0.0)), rtol=1e-4)


def sessions(target):
    """Three caches after their prompts, and a fresh one."""
    caches = []
    for prompt in PROMPTS:
        cache = target.make_cache()
        target.forward(
            [Pass(mx.array(prompt), cache, 0, logits="none", taps=False, rewindable=False)]
        )[0]
        caches.append(cache)
    return caches + [target.make_cache()]


def passes(caches) -> list[Pass]:
    return [
        Pass(mx.array([40, 41, 42, 43, 44]), caches[0], len(PROMPTS[0])),  # a DFlash block
        Pass(mx.array([50, 51, 52, 53, 54, 55, 56]), caches[1], len(PROMPTS[1]), TREE),
        Pass(mx.array([60]), caches[2], len(PROMPTS[2]), logits="last", taps=False,
             rewindable=False),  # a plain step
        Pass(mx.array(list(range(70, 82))), caches[3], 0, logits="last", rewindable=False),
    ]  # fmt: skip


def test_each_row_gets_its_own_forward(target):
    alone = [target.forward([p])[0] for p in passes(sessions(target))]
    packed_caches = sessions(target)
    packed = target.forward(passes(packed_caches))
    for (l1, t1), (l2, t2) in zip(alone, packed, strict=True):
        assert (l1 is None) == (l2 is None) and (t1 is None) == (t2 is None)
        if l1 is not None:
            assert l1.shape == l2.shape
            assert close(l1, l2)
            assert (mx.argmax(l1, -1) == mx.argmax(l2, -1)).all().item()
        if t1 is not None:
            assert close(t1, t2)
    # The caches hold what each row's own forward wrote: the next step agrees too.
    steps = [Pass(mx.array([90]), c, len(p) + n, logits="last", taps=False)
             for c, p, n in zip(packed_caches, PROMPTS + [[]], (5, 7, 1, 12), strict=True)]  # fmt: skip
    ref_caches = sessions(target)
    for p in passes(ref_caches):
        target.forward([p])[0]
    for step, ref_cache in zip(steps, ref_caches, strict=True):
        got, _ = target.forward(
            [Pass(step.tokens, step.cache, step.start, logits="last", taps=False)]
        )[0]
        want, _ = target.forward(
            [Pass(step.tokens, ref_cache, step.start, logits="last", taps=False)]
        )[0]
        assert close(got, want)


def test_rows_sharing_a_kv_arena_get_their_own_forward(target):
    """Rows whose caches live in one KVArena (models/arena.py; several one-token steps then
    attend as one, in slots out of packed order, with a free slot between them, beside a row
    with its own cache) get what their own forwards give, through a tree's compaction and a block's trim, and leave the
    arena with exactly their own caches."""
    from mlx_dflash.models.arena import SlotCache

    def caches_of(t):
        extra = []
        for prompt in (PROMPTS[1][:5], PROMPTS[0][2:]):
            cache = t.make_cache()
            t.forward([Pass(mx.array(prompt), cache, 0, logits="none", taps=False)])[0]
            extra.append(cache)
        return sessions(t) + extra

    def first(c):
        return passes(c[:4]) + [
            Pass(mx.array([61]), c[4], 5, logits="last", taps=False),
            Pass(mx.array([62]), c[5], len(PROMPTS[0]) - 2, logits="last", taps=False),
        ]

    def second(c):  # after the commits below: every row a one-token step
        ends = (len(PROMPTS[0]) + 2, len(PROMPTS[1]) + 3, len(PROMPTS[2]) + 1, 12, 6)
        ends += (len(PROMPTS[0]) - 1,)
        return [Pass(mx.array([91 + i]), x, e, logits="last", taps=False)
                for i, (x, e) in enumerate(zip(c, ends, strict=True))]  # fmt: skip

    def commit(c):
        for layer in c[0]:
            layer.trim(len(PROMPTS[0]) + 2)
        for layer in c[1]:
            layer.compact(len(PROMPTS[1]), [0, 1, 3])

    ref = caches_of(target)
    want = [target.forward([p])[0]
            for p in first(ref)]  # fmt: skip
    commit(ref)
    want2 = [target.forward([Pass(p.tokens, p.cache, p.start, logits="last", taps=False)])[0][0]
             for p in second(ref)]  # fmt: skip

    arena, got_caches = target.new_arena(), caches_of(target)
    spare = target.make_cache()
    target.forward([Pass(mx.array([3, 4]), spare, 0, logits="none", taps=False)])[0]
    # Slot 1 is free (the rows' slots are not in packed order), and row 3 keeps its own
    # cache (as a row too long for the arena does) among the arena's rows.
    adopted = [arena.adopt(c) for c in [got_caches[5], spare, *got_caches[:3], got_caches[4]]]
    arena.release(spare)
    got = target.forward(first(got_caches))
    commit(got_caches)
    got2 = [lg for lg, _ in target.forward(second(got_caches))]
    for (l1, t1), (l2, t2) in zip(want, got, strict=True):
        assert (l1 is None) == (l2 is None)
        if l1 is not None:
            assert close(l1, l2)
        if t1 is not None:
            assert close(t1, t2)
    for l1, l2 in zip(want2, got2, strict=True):
        assert close(l1, l2)
        assert (mx.argmax(l1, -1) == mx.argmax(l2, -1)).all().item()
    if not any(adopted):  # no plain KV layer: nothing moved
        return
    assert any(isinstance(x, SlotCache) for x in got_caches[0])
    for c in got_caches:
        arena.release(c)
    for c, r in zip(got_caches, ref, strict=True):
        for x, y in zip(c, r, strict=True):
            assert type(x) is type(y) and x.offset == y.offset
            for a, b in zip(x.state_arrays, y.state_arrays, strict=True):
                n = x.offset  # rows past the offset are free space
                assert np.allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=2e-4)
    assert not arena.keys and not arena._slots, "an empty arena holds no memory"
