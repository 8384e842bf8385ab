"""Hybrid targets (Gated DeltaNet + gated attention): exact DFlash / DDTree, tree-aware state."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from oracle import OracleDrafter, diversify
from test_engine import PROMPT, mlx_lm_greedy, run

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.contract import Pass
from mlx_dflash.models.gated_deltanet import RecurrentCache, conv_window_index
from mlx_dflash.models.target import Target
from mlx_dflash.models.tiny import HYBRID_TYPES, load_module, tiny_target_config

N = 60


@pytest.fixture(scope="module", params=HYBRID_TYPES)
def target(request):
    cfg = tiny_target_config(request.param)
    mod = load_module(request.param)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    diversify(model, gain=2.0)
    t = Target(model, None, cfg)
    assert any(isinstance(c, RecurrentCache) for c in t.make_cache())
    return t


def test_conv_window_follows_ancestors():
    #      0
    #     / \\
    #    1   2
    #    |
    #    3
    parents = np.array([-1, 0, 0, 1])
    idx = conv_window_index(parents, kernel=4)  # rows: 3 conv-state rows, then nodes at 3..6
    assert idx[0].tolist() == [0, 1, 2, 3]  # root: the three previous inputs, then itself
    assert idx[1].tolist() == [1, 2, 3, 4]
    assert idx[2].tolist() == [1, 2, 3, 5]  # sibling of 1: does not see node 1
    assert idx[3].tolist() == [2, 3, 4, 6]  # root, node 1, itself


def test_ar_matches_mlx_lm(target):
    ref = mlx_lm_greedy(target, PROMPT, N)
    out, _ = run(Session(target), PROMPT, max_tokens=N, mode="ar")
    assert out == ref


@pytest.mark.parametrize(
    "mode,budget", [("dflash", 0), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]
)
def test_speculative_greedy_exact(target, mode, budget):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    budget = None if mode == "dflash" else budget  # (the chain: the drafter's whole block)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=N, mode=mode, budget=budget)
    assert out == ref
    assert np.mean(taus) > (3 if budget != 4 else 2)  # real partial acceptance happened


@pytest.mark.parametrize("pattern", ["TFFTFTTFFF", "FFFFFFFFFT"])
def test_auto_budget_pauses_between_drafts_stay_exact(target, tmp_path, monkeypatch, pattern):
    """Plain steps between tree verifies (the pacer's pauses) leave recurrent state exact."""
    from test_ddtree import run_with_scripted_pauses

    out, ref, taus = run_with_scripted_pauses(target, [1, 3], pattern, monkeypatch, tmp_path)
    assert out == ref
    assert taus.count(1) < len(taus)  # some tree rounds accepted drafts


def _prefilled(target, tokens):
    cache = target.make_cache()
    target.forward([Pass(mx.array(tokens), cache, 0, logits="none", taps=False, rewindable=False)])[
        0
    ]
    return cache


def _assert_same_state(cache_a, cache_b):
    """Equal up to float32 summation order: a state gathered along the accepted path and one
    rebuilt by a fresh prefill add the same terms in a different order (~5e-5 on O(1) values,
    depending on the BLAS and MLX build); a wrong commit differs by O(1)."""
    for a, b in zip(cache_a, cache_b, strict=True):
        if isinstance(a, RecurrentCache):
            assert a.offset == b.offset
            np.testing.assert_allclose(np.array(a.state), np.array(b.state), atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(np.array(a.conv), np.array(b.conv), atol=2e-4, rtol=1e-4)
        else:
            assert a.offset == b.offset
            np.testing.assert_allclose(
                np.array(a.keys[..., : a.offset, :]),
                np.array(b.keys[..., : b.offset, :]),
                atol=5e-5,
                rtol=1e-4,
            )


@pytest.mark.parametrize("accepted", [0, 3, 7])
def test_linear_verify_restores_accepted_prefix_state(target, accepted):
    block = [7, 21, 40, 11, 99, 5, 17, 3]
    cache = _prefilled(target, PROMPT)
    target.forward([Pass(mx.array(block), cache, len(PROMPT))])[0]
    for c in cache:
        c.trim(len(PROMPT) + accepted + 1)
    _assert_same_state(cache, _prefilled(target, PROMPT + block[: accepted + 1]))


def test_tree_verify_commits_the_accepted_path(target):
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 6, 0])
    tokens = [7, 21, 40, 11, 99, 5, 17, 3, 8, 60]
    start = len(PROMPT)
    cache = _prefilled(target, PROMPT)
    logits, _ = target.forward([Pass(mx.array(tokens), cache, start, parents=parents)])[0]
    path = [0, 1, 3, 6, 8]
    for c in cache:
        c.compact(start, path)
    _assert_same_state(cache, _prefilled(target, PROMPT + [tokens[i] for i in path]))
    # And every node's logits equal its own root-to-node sequence run causally.
    for i in range(len(tokens)):
        chain = [i]
        while parents[chain[-1]] >= 0:
            chain.append(parents[chain[-1]])
        seq = PROMPT + [tokens[j] for j in reversed(chain)]
        ref, _ = target.forward(
            [Pass(mx.array(seq), target.make_cache(), 0, taps=False, rewindable=False)]
        )[0]
        np.testing.assert_allclose(np.array(logits[i]), np.array(ref[-1]), atol=2e-4, rtol=1e-4)


def test_session_reuse_and_reset(target):
    """Extending the prompt reuses the recurrent state, a prompt that diverges in the answer
    rewinds to the last prompt's snapshot, one that diverges earlier starts over."""
    ref1 = mlx_lm_greedy(target, PROMPT, 12)
    target.set_taps([1, 3])
    longer = PROMPT + ref1 + [4, 5]
    other = PROMPT[:10] + [9, 9, 9]
    refs = {tuple(p): mlx_lm_greedy(target, p, 12) for p in (longer, other)}
    oracle = OracleDrafter(longer + refs[tuple(longer)], target.vocab_size, block_size=8)
    session = Session(target, oracle)
    assert run(session, PROMPT, max_tokens=12)[0] == ref1
    rounds = list(generate_rounds(session, longer, GenerationConfig(max_tokens=12)))
    assert rounds[0].prefill_tokens <= 3
    assert [t for r in rounds for t in r.tokens] == refs[tuple(longer)]
    # A prompt that diverges inside the last answer: back to the snapshot after the last
    # prompt (chat's case), not to zero.
    branch = longer + [7, 8]
    refs[tuple(branch)] = mlx_lm_greedy(target, branch, 12)
    oracle.truth = branch + refs[tuple(branch)]
    rounds = list(generate_rounds(session, branch, GenerationConfig(max_tokens=12)))
    assert rounds[0].prefill_tokens == 2
    assert [t for r in rounds for t in r.tokens] == refs[tuple(branch)]
    # Diverging before any snapshot: a full prefill.
    oracle.truth = other + refs[tuple(other)]
    rounds = list(generate_rounds(session, other, GenerationConfig(max_tokens=12)))
    assert rounds[0].prefill_tokens == len(other)
    assert [t for r in rounds for t in r.tokens] == refs[tuple(other)]
