"""DDTree: tree building, tree verification and lossless walks."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from oracle import OracleDrafter, diversify
from test_engine import PROMPT, mlx_lm_greedy, run

from mlx_dflash.engine import Session
from mlx_dflash.engine.contract import Pass
from mlx_dflash.engine.tree import build_tree, expected_tokens, top_candidates
from mlx_dflash.kernels.tree_attention import tree_depths
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import TARGET_TYPES, write_tiny_target
from mlx_dflash.settings import SETTINGS

N = 60


def brute_force_prefixes(lp: np.ndarray, budget: int) -> list[float]:
    """Scores of the `budget` most probable prefixes, by enumerating all of them."""
    depth, k = lp.shape
    scores = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            scores.append(sum(lp[i, r] for i, r in enumerate(ranks)))
    return sorted(scores, reverse=True)[:budget]


@pytest.mark.parametrize("seed", range(6))
def test_heap_returns_the_most_probable_prefixes(seed):
    rng = np.random.default_rng(seed)
    depth, vocab = int(rng.integers(1, 5)), int(rng.integers(2, 6))
    logits = mx.array(rng.normal(size=(depth, vocab)).astype(np.float32) * 2)
    for budget in (1, 3, 7, 20):
        tok, lp = top_candidates(logits, budget)
        tree = build_tree(99, tok, lp, budget)
        n_nodes = len(tree.tokens) - 1
        best = brute_force_prefixes(lp, budget)
        assert n_nodes == len(best)
        np.testing.assert_allclose(sorted(tree.log_probs[1:], reverse=True), best, atol=1e-9)
        assert all(tree.parents[i] < i for i in range(1, len(tree.parents)))
        assert np.all(np.diff(tree.log_probs[1:]) <= 1e-12)  # non-increasing probability
        # each node's score is its parent's plus its own token's log-prob at that depth
        full = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for i in range(1, len(tree.tokens)):
            par = tree.parents[i]
            own = full[tree.depths[i] - 1, tree.tokens[i]]
            assert np.isclose(tree.log_probs[i], tree.log_probs[par] + own, atol=1e-5)
        e = expected_tokens(tree)
        assert e[0] == 1 and np.all(np.diff(e) > 0)


@pytest.mark.parametrize("k", [1, 4, 64, 3000])
def test_top_candidates_host_and_mlx_paths_agree(k):
    """The numpy path (MLX CPU backend) and the MLX path (Metal) pick the same candidates."""
    rng = np.random.default_rng(k)
    logits = mx.array(rng.normal(size=(5, 3000)).astype(np.float32) * 3)
    full = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    host_tok, host_lp = top_candidates(logits, k, on_host=True)
    mlx_tok, mlx_lp = top_candidates(logits, k, on_host=False)
    np.testing.assert_array_equal(host_tok, mlx_tok)
    np.testing.assert_allclose(host_lp, mlx_lp, atol=1e-5)
    np.testing.assert_allclose(host_lp, np.take_along_axis(full, host_tok, axis=-1), atol=1e-5)
    expect = np.argsort(-full, axis=-1, kind="stable")[:, : min(k, 3000)]
    np.testing.assert_array_equal(host_tok, expect)


@pytest.fixture(scope="module", params=TARGET_TYPES)
def target(request, tmp_path_factory):
    target = load_target(write_tiny_target(tmp_path_factory.mktemp(request.param), request.param))
    diversify(target.model)
    return target


def test_tree_logits_equal_per_path_logits(target):
    """One tree forward == running each root-to-node path as its own causal sequence."""
    rng = np.random.default_rng(0)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 5, 0, 9, 10])
    tokens = rng.integers(3, target.vocab_size, size=len(parents))
    target.set_taps([0, 2])
    cache = target.make_cache()
    target.forward([Pass(mx.array(PROMPT), cache, 0, logits="none", taps=False)])[0]
    start = len(PROMPT)
    logits, taps = target.forward([Pass(mx.array(tokens), cache, start, parents=parents)])[0]
    for i in range(len(parents)):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        c = target.make_cache()
        ref_logits, ref_taps = target.forward(
            [Pass(mx.array(PROMPT + tokens[path].tolist()), c, 0)]
        )[0]
        np.testing.assert_allclose(
            np.array(logits[i]), np.array(ref_logits[-1]), atol=2e-4, rtol=1e-4
        )
        np.testing.assert_allclose(np.array(taps[i]), np.array(ref_taps[-1]), atol=2e-4, rtol=1e-4)
    assert list(tree_depths(parents)) == [0, 1, 1, 2, 2, 2, 3, 3, 3, 1, 2, 3]


@pytest.mark.parametrize("budget", [1, 4, 16, 64, 256])
def test_ddtree_greedy_exact(target, budget):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([0, 1])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=N, mode="ddtree", budget=budget)
    assert out == ref
    # The true token is always the drafter's 1st or 2nd choice, so wider trees accept deeper;
    # a chain (DFlash) with this oracle averages about 3.7 of at most 8.
    floor = {1: 1.0, 4: 2.5, 16: 4.2, 64: 5.5, 256: 7.0}[budget]
    assert np.mean(taus) > floor


def test_chain_budget_reproduces_dflash(target):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([0, 1])
    res = {}
    for mode in ("dflash", "ddtree"):
        oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=4)
        res[mode] = run(
            Session(target, oracle), PROMPT, max_tokens=N, mode=mode, budget=7, branching=1
        )
    assert res["dflash"] == res["ddtree"]  # same tokens and the same tau every round
    assert res["dflash"][0] == ref


def test_auto_budget_follows_verify_cost():
    """Flat verify cost -> the whole tree; steep cost -> only the sure nodes."""
    from mlx_dflash.engine.budget import VerifyProfile, choose_budget

    lp = np.log(np.array([[0.9, 0.05], [0.9, 0.05], [0.5, 0.4], [0.3, 0.3]]))
    tree = build_tree(0, np.array([[1, 2]] * 4), lp, 16)
    flat = VerifyProfile([1, 64], [1.0, 1.0])
    steep = VerifyProfile([1, 64], [1.0, 64.0])
    assert choose_budget(tree, flat, overhead=0.1) == len(tree.tokens) - 1
    b = choose_budget(tree, steep, overhead=0.1)
    assert 0 <= b <= 2  # only the two 0.9-probability chain nodes can pay for themselves
    e = expected_tokens(tree)
    rates = e / (0.1 + steep.cost(np.arange(len(e)) + 1))
    assert b == int(np.argmax(rates))


def test_auto_budget_exact_and_profile_cached(target, tmp_path, monkeypatch):
    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path))
    ref = mlx_lm_greedy(target, PROMPT, 40)
    target.set_taps([0, 1])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    out, _ = run(Session(target, oracle), PROMPT, max_tokens=40, mode="ddtree", budget="auto")
    assert out == ref
    # The verify profile, and the probe that first asked whether speculation can pay here
    # (budget.speculation_pays): each measured once per model and machine, then reused.
    profiles = sorted((tmp_path / "profiles").glob("*.json"))
    assert len(profiles) == 2 and sum(p.name.endswith("-probe.json") for p in profiles) == 1
    before = [p.stat().st_mtime_ns for p in profiles]
    run(Session(target, oracle), PROMPT, max_tokens=8, mode="ddtree", budget="auto")
    assert [p.stat().st_mtime_ns for p in profiles] == before


def test_pacer_backs_off_while_drafting_loses_and_resumes_when_it_wins():
    from mlx_dflash.engine.budget import Pacer

    pacer = Pacer(plain_seconds=0.1)  # plain decoding: 10 tokens/s
    waits = []
    for _ in range(8):
        assert pacer.draft_now()
        pacer.record_tree(tokens=1, seconds=0.2)  # 5 tokens/s: drafting loses
        n = 0
        while not pacer.draft_now():
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32]
    pacer.record_tree(tokens=4, seconds=0.2)  # 20 tokens/s: drafting wins
    assert pacer.draft_now() and pacer.backoff == 16  # one win halves the back-off, no reset
    for _ in range(4):
        pacer.record_tree(tokens=4, seconds=0.2)
    assert pacer.backoff == 1 and pacer.draft_now()
    pacer.record_tree(tokens=4, seconds=0.2)
    assert pacer.draft_now()  # winning rounds never pause
    # Slow plain steps (measured, not the profile's guess) make drafting win sooner.
    slow = Pacer(plain_seconds=0.1)
    for _ in range(4):
        slow.record_plain(1.0)
    slow.record_tree(tokens=1, seconds=0.2)
    assert slow.draft_now()


def test_a_stale_profile_is_scaled_by_the_verifies_the_round_times():
    """The verify profile is cached per model and machine, but the machine's speed drifts: one
    measured on a busy machine (here 1.5x dearer than now) prices a plain step too high, so a
    drafter at 1.2 tokens a round, which loses to real plain steps, would never be paused
    (and never get the plain step that would correct it). The rounds' own verify times
    scale the profile until a plain step is timed."""
    from mlx_dflash.engine.budget import AutoBudget, VerifyProfile
    from mlx_dflash.engine.tree import Tree

    sizes = [1, 2, 4, 8, 16, 32, 48, 65]
    now = VerifyProfile(sizes, [0.10 + 0.005 * s for s in sizes])  # what a verify costs today
    stale = VerifyProfile(sizes, 1.5 * now.seconds)
    tree = Tree(
        np.array([5, 6, 7]), np.array([-1, 0, 1]), np.array([0, 1, 2]), np.log([1, 0.6, 0.5])
    )
    verify, overhead = float(now.cost(3)), 0.02
    for fresh in (False, True):
        policy = AutoBudget(stale)
        paused = 0
        for _ in range(12):
            if not policy.draft_now():
                paused += 1
                continue
            # 1.2 tokens a round in 0.135 s (8.9 tok/s) against plain steps at 0.105 s (9.5/s)
            policy.record_tree(
                tree, 3, [0], 1 + (policy.tree_rounds % 5 == 0), overhead, overhead + verify
            )
            if not fresh:  # the old behaviour: the profile as cached
                policy.speed, policy.pacer.plain = 1.0, (1.0, float(stale.cost(1)))
        if fresh:
            assert policy.speed == pytest.approx(1 / 1.5)
            assert policy.costs().cost(3) == pytest.approx(verify)
            assert policy.pacer.plain[1] == pytest.approx(float(now.cost(1)))
            assert paused > 0, "drafting that loses to today's plain steps ran without a pause"
        else:
            assert paused == 0  # what a stale profile did
    policy.record_plain(0.2)  # a timed plain step: from now on the pacer's own measurement
    policy.record_tree(tree, 3, [0], 1, overhead, overhead + verify)
    assert policy.pacer.plain[1] > float(now.cost(1))


def test_pacer_keeps_drafting_through_noisy_rounds_that_win_on_average():
    """Accepted lengths 3, 1, 1, ... at 0.14 s a round beat 10 tokens/s on average (11.9):
    single bad rounds must not pause drafting (a one-round average would pause every third)."""
    from mlx_dflash.engine.budget import Pacer

    pacer = Pacer(plain_seconds=0.1)
    for tokens in [3, 1, 1] * 10:
        assert pacer.draft_now()
        pacer.record_tree(tokens=tokens, seconds=0.14)
    # ...but a real change of text (the drafter stops predicting) still pauses it soon.
    losing = 0
    while pacer.draft_now():
        pacer.record_tree(tokens=1, seconds=0.14)
        losing += 1
    assert losing <= 3


def test_auto_budget_calibration_shrinks_trees_of_an_overconfident_drafter():
    from mlx_dflash.engine.budget import VerifyProfile, choose_budget

    lp = np.log(np.array([[0.9, 0.05]] * 6))
    tree = build_tree(0, np.array([[1, 2]] * 6), lp, 16)
    prof = VerifyProfile([1, 2, 64], [1.0, 1.3, 20.0])
    trusted = choose_budget(tree, prof, overhead=0.5)
    assert trusted == 6  # the 0.9-chain
    assert choose_budget(tree, prof, overhead=0.5, calibration=0.5) < trusted
    assert choose_budget(tree, prof, overhead=0.5, calibration=0.2) == 0


def test_a_confident_lookup_branch_skips_the_drafter_pass():
    """A round whose lookup branch is likely to land verifies it without a drafter pass (the
    pass and its nodes would earn only where the branch fails at once); a doubtful branch, or
    a drafter not yet measured, keeps the pass."""
    from mlx_dflash.engine.budget import AutoBudget, VerifyProfile
    from mlx_dflash.engine.lookup import LookupStats
    from mlx_dflash.engine.tree import root_only

    policy = AutoBudget(VerifyProfile([1, 2, 16, 64], [1.0, 1.2, 1.6, 4.0]))
    tree = build_tree(0, np.array([[5, 6]] * 8), np.log(np.array([[0.6, 0.2]] * 8)), 8)
    chains = [[7, 8, 9, 10, 11, 12]]
    sure, doubtful = LookupStats(), LookupStats()
    sure.hits, sure.misses = 19.0, 1.0  # r = 0.95
    doubtful.hits, doubtful.misses = 1.0, 4.0  # r = 0.2
    root = root_only(0)

    def suffices(chains, stats):  # the branches as the round cuts them, then the decision
        return policy.lookup_suffices(root, policy.cut_lookup(root, chains, stats, False), stats)

    for i in range(6):
        # the drafter: a 0.1 s pass, 8 nodes, 1.5 extra tokens a round
        if i < 4:
            assert not suffices(chains, sure), "skipped before measuring"
        path = [0, 1] + ([2] if i % 2 else [])
        policy.record_tree(tree, 9, path, len(path), 0.12, 1.9, t_draft=0.1)
    assert suffices(chains, sure)
    assert not suffices(chains, doubtful)
    assert not suffices([], sure)


def run_with_scripted_pauses(target, taps, pattern, monkeypatch, tmp_path):
    """`--budget auto` with the pacer's draft/pause decisions scripted by pattern ("T" drafts).

    Returns (output, mlx-lm's greedy reference, taus). The oracle asserts at every draft that
    its context matches the target's, so a pause that forgot to feed the drafter fails here.
    """
    from mlx_dflash.engine.budget import Pacer

    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path))
    script = itertools.cycle(pattern)
    monkeypatch.setattr(Pacer, "draft_now", lambda self: next(script) == "T")
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps(taps)
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=N, mode="ddtree", budget="auto")
    return out, ref, taus


@pytest.mark.parametrize("pattern", ["TFFTFTTFFF", "FFFFFFFFFT", "TTTTTTTTTT"])
def test_auto_budget_pauses_between_drafts_stay_exact(target, tmp_path, monkeypatch, pattern):
    """Plain steps inside a DDTree run (the pacer's pauses) keep output and drafter exact
    (test_hybrid runs the same on recurrent targets)."""
    out, ref, taus = run_with_scripted_pauses(target, [0, 1], pattern, monkeypatch, tmp_path)
    assert out == ref
    if pattern.count("T") > 3:
        assert max(taus) > 1  # the tree rounds between pauses still accept drafts
