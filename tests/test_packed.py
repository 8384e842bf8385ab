"""Packed forwards (models/packed.py): several sessions' passes (a causal block, a tree, a
plain step, a prefill chunk) run as one forward give each row what its own forward gives,
and leave every cache as its own forward would, in every attention family."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import attention_target

from mlx_dflash.models.packed import Pass

PROMPTS = [list(range(3, 3 + n)) for n in (14, 23, 9)]
TREE = np.array([-1, 0, 0, 1, 1, 2, 3], dtype=np.int32)


# Causal attention, Gated DeltaNet rows, MLA, windows past their width, sinks.
KINDS = ["llama", "qwen3_5", "deepseek_v3", "gemma4-31b", "gpt-oss-20b"]


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory):
    return attention_target(request.param, tmp_path_factory.mktemp(request.param))


def sessions(target):
    """Three caches after their prompts, and a fresh one."""
    caches = []
    for prompt in PROMPTS:
        cache = target.make_cache()
        target.forward(mx.array(prompt), cache, 0, logits="none", taps=False, rewindable=False)
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
    alone = [
        target.forward(p.tokens, p.cache, p.start, p.parents, p.logits, p.taps, p.rewindable)
        for p in passes(sessions(target))
    ]
    packed_caches = sessions(target)
    packed = target.forward_rows(passes(packed_caches))
    for (l1, t1), (l2, t2) in zip(alone, packed, strict=True):
        assert (l1 is None) == (l2 is None) and (t1 is None) == (t2 is None)
        if l1 is not None:
            assert l1.shape == l2.shape
            assert np.allclose(np.array(l1), np.array(l2), atol=2e-4, rtol=1e-4)
            assert (mx.argmax(l1, -1) == mx.argmax(l2, -1)).all().item()
        if t1 is not None:
            assert np.allclose(np.array(t1), np.array(t2), atol=2e-4, rtol=1e-4)
    # The caches hold what each row's own forward wrote: the next step agrees too.
    steps = [Pass(mx.array([90]), c, len(p) + n, logits="last", taps=False)
             for c, p, n in zip(packed_caches, PROMPTS + [[]], (5, 7, 1, 12), strict=True)]  # fmt: skip
    ref_caches = sessions(target)
    for p in passes(ref_caches):
        target.forward(p.tokens, p.cache, p.start, p.parents, p.logits, p.taps, p.rewindable)
    for step, ref_cache in zip(steps, ref_caches, strict=True):
        got, _ = target.forward(step.tokens, step.cache, step.start, logits="last", taps=False)
        want, _ = target.forward(step.tokens, ref_cache, step.start, logits="last", taps=False)
        assert np.allclose(np.array(got), np.array(want), atol=2e-4, rtol=1e-4)
