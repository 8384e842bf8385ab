"""Log-probabilities of the emitted tokens, read from the verify pass: equal to plain mlx-lm
decoding's (to 1e-4), with the same top alternatives, in every round kind, and the output
itself unchanged by asking for them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from oracle import OracleDrafter, diversify

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target

PROMPT = list(range(3, 23))
N = 30
K = 5


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t = load_target(write_tiny_target(tmp_path_factory.mktemp("lp") / "t", "qwen3"))
    diversify(t.model)
    return t


def plain(target):
    """mlx-lm's greedy tokens and each step's log-probability vector."""
    steps = generate_step(mx.array(PROMPT), target.model, max_tokens=N,
                          sampler=lambda x: mx.argmax(x, axis=-1))  # fmt: skip
    out = [(int(t), np.array(lp)) for t, lp in steps]
    return [t for t, _ in out], [lp for _, lp in out]


@pytest.mark.parametrize(
    "mode, budget, lookup",
    [("ar", 16, 0), ("dflash", 16, 0), ("ddtree", 8, 0), ("ddtree", "auto", 4), ("lookup", 16, 4)],
)
def test_logprobs_equal_plain_decoding(target, mode, budget, lookup):
    want, vectors = plain(target)
    oracle = OracleDrafter(PROMPT + want, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    target.set_taps([1, 3])
    cfg = GenerationConfig(max_tokens=N, mode=mode, budget=budget, lookup=lookup, logprobs=K)
    tokens, lps, taus = [], [], []
    for r in generate_rounds(Session(target, oracle if mode != "ar" else None), PROMPT, cfg):
        tokens += r.tokens
        lps += r.logprobs or []
        taus += [] if r.prefill else [r.accepted]
    assert tokens == want and len(lps) == N
    if mode in ("dflash", "ddtree"):
        assert max(taus) > 1  # verify passes with several rows were read
    for (chosen, top), t, vec in zip(lps, want, vectors, strict=True):
        assert abs(chosen - float(vec[t])) < 1e-4
        ids = [i for i, _ in top]
        assert len(ids) == K and ids[0] == t  # greedy: the pick is the best
        np.testing.assert_allclose([v for _, v in top], vec[ids], atol=1e-4)
        assert set(ids) == set(np.argsort(-vec)[:K].tolist())


def test_logprobs_off_by_default_and_bounded(target):
    rounds = list(
        generate_rounds(Session(target), PROMPT, GenerationConfig(max_tokens=3, mode="ar"))
    )
    assert all(r.logprobs is None for r in rounds)
    with pytest.raises(DFlashError, match="logprobs"):
        GenerationConfig(logprobs=21)
