"""Prompt lookup: n-gram branches from earlier text, alone (`--mode lookup`, no drafter) or
joined to the drafter's DDTree; output stays exactly the target's (greedy: token for token
against mlx-lm; sampling: chi-square against the exact distribution)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from oracle import OracleDrafter, diversify
from test_engine import mlx_lm_greedy, run
from test_sampling import V, chi2_pvalue, exact_marginals

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine import lookup as lookup_mod
from mlx_dflash.engine.lookup import LookupStats, PromptLookup
from mlx_dflash.engine.sampling import SamplingParams
from mlx_dflash.engine.tree import build_tree, graft, graft_sizes, root_only
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.target import Target
from mlx_dflash.models.tiny import HYBRID_TYPES, TARGET_TYPES, load_module, tiny_target_config
from mlx_dflash.settings import SETTINGS

# A prompt that repeats itself, as code edits and quotes do.
PHRASE = [11, 23, 35, 47, 59, 61, 73, 85, 97, 19]
PROMPT = PHRASE + [5, 6] + PHRASE + [7, 8] + PHRASE[:4]
N = 48


def test_branches_follow_the_longest_earlier_suffix():
    look = PromptLookup()
    look.sync([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    # suffix (1, 2, 3) occurred once, followed by 4 9 2 ...; (2, 3) twice more: longest wins
    assert look.branches(3) == [[4, 9, 2]]
    look.sync([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3, 7, 2, 3])
    # (3, 7, 2, 3)... no 3/4-gram match; the bigram (2, 3): newest first, distinct, then older
    assert look.branches(2) == [[7, 2], [5, 1], [4, 9]]
    assert look.branches(2, max_branches=1) == [[7, 2]]
    assert look.branches(0) == []
    look.sync([5, 6])  # not an extension: starts over
    assert look.branches(4) == []


def test_echo_follows_the_last_token_alone():
    """The last resort where no 2-gram matched: what followed the last token, newest first."""
    look = PromptLookup()
    look.sync([7, 1, 2, 9, 1, 3, 4, 8, 1])
    assert look.branches(2) == []  # (8, 1) did not occur before
    assert look.echo(2) == [[3, 4], [2, 9]]
    assert look.echo(2, max_branches=1) == [[3, 4]] and look.echo(0) == []
    look.sync([7, 1, 2, 9, 1, 3, 4, 8, 1, 5])
    assert look.echo(3) == []  # 5 is new


def test_sync_is_incremental():
    seq = list(np.random.default_rng(0).integers(0, 6, 200))
    a, b = PromptLookup(), PromptLookup()
    a.sync(seq)
    for i in range(1, len(seq) + 1, 7):
        b.sync(seq[:i])
    b.sync(seq)
    c = PromptLookup()
    for i in range(0, len(seq), 5):  # what each DDTree round appends
        c.extend(seq[i : i + 5])
    assert dict(a.index) == dict(b.index) == dict(c.index)
    assert a.tokens == b.tokens == c.tokens == [int(t) for t in seq]


def test_graft_shares_prefixes_and_keeps_parents_first():
    tree = build_tree(
        7, np.array([[3, 4], [5, 6]]), np.log(np.array([[0.6, 0.4], [0.7, 0.3]])), budget=4
    )
    grafted = graft(tree, [[3, 5, 9], [8]])
    kids = grafted.children()
    assert len(grafted.tokens) == len(tree.tokens) + 2  # 9 under (3, 5), and 8 under the root
    assert np.all(grafted.parents[1:] < np.arange(1, len(grafted.tokens)))
    node = 0
    for tok in (3, 5, 9):
        node = kids[node][tok]
    assert grafted.depths[node] == 3
    assert kids[0][8] == len(grafted.tokens) - 1
    assert len(graft(root_only(7), [[1, 2], [1, 3]]).tokens) == 4


def test_graft_sizes_count_every_cut_length():
    """graft_sizes (what the auto budget prices lookup branches with) equals the size of the
    grafted tree at every cut length: chains sharing a prefix, following the drafter's nodes,
    repeating one another, and of different lengths."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        k = int(rng.integers(1, 4))
        logits = rng.normal(size=(int(rng.integers(1, 6)), k))
        cands = rng.integers(0, 4, size=logits.shape)
        for row in cands:  # distinct siblings, as the drafter's top-k are
            row[:] = rng.permutation(6)[:k]
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        tree = build_tree(9, cands, np.log(probs), budget=int(rng.integers(0, 12)))
        chains = [rng.integers(0, 4, size=int(rng.integers(1, 8))).tolist() for _ in range(3)]
        if trial % 4 == 0:
            chains.append(list(chains[0]))
        sizes = graft_sizes(tree, chains)
        want = [len(graft(tree, [c[:n] for c in chains]).tokens) for n in range(len(sizes))]
        assert sizes.tolist() == want
        assert len(sizes) == max(len(c) for c in chains) + 1


def test_lookup_stats_rate():
    s = LookupStats()
    for _ in range(50):
        s.record([1, 2, 3, 4], [1, 2, 3, 9])  # 3 of 4 accepted, then a miss
    assert 0.7 < s.rate < 0.8 and s.expected(2) > s.expected(1)


@pytest.fixture(scope="module", params=TARGET_TYPES + HYBRID_TYPES)
def target(request):
    cfg = tiny_target_config(request.param)
    mod = load_module(request.param)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    diversify(model, gain=2.0)
    return Target(model, None, cfg)


@pytest.mark.parametrize("model_type", TARGET_TYPES + HYBRID_TYPES)
def test_lookup_mode_is_exact_and_accepts(model_type):
    """Random models of three weight scales: the more repetitive ones (a text that repeats
    itself) get lookup branches accepted, every one stays exact."""
    accepted = 0
    for gain in (2.0, 1.0, 0.5):
        cfg = tiny_target_config(model_type)
        mod = load_module(model_type)
        model = mod.Model(mod.ModelArgs.from_dict(cfg))
        diversify(model, gain=gain)
        target = Target(model, None, cfg)
        ref = mlx_lm_greedy(target, PROMPT, N)
        for budget, look in ((16, 6), ("auto", 0)):
            kw = dict(max_tokens=N, mode="lookup", budget=budget, lookup=look)
            out, taus = run(Session(target), PROMPT, **kw)
            assert out == ref, (gain, budget)
            accepted += sum(t - 1 for t in taus)
    assert accepted > 0, "no lookup branch was ever accepted"


@pytest.mark.parametrize("budget", [4, "auto"])
def test_ddtree_with_lookup_is_exact(target, budget):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=4)
    kw = dict(max_tokens=N, mode="ddtree", budget=budget, lookup=8)
    out, taus = run(Session(target, oracle), PROMPT, **kw)
    assert out == ref and np.mean(taus) > 1.3 and max(taus) > 2


def test_a_paused_drafter_leaves_lookup_branches_running(target, monkeypatch, tmp_path):
    """`--budget auto` pauses the drafter while it loses; lookup branches cost no drafter pass,
    so they go on through the pause (on the 0.5B coder, losing them in pauses put DDTree +
    lookup 5-16% behind lookup alone). Here the drafter never runs and every branch found is
    worth a verify: lookup trees are verified, the output stays exact, and the pacer hears
    each round as what not drafting earns."""
    from mlx_dflash.engine.budget import Pacer

    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path))
    monkeypatch.setattr(lookup_mod, "MIN_NGRAM", 1)  # a branch after almost every token
    monkeypatch.setattr(LookupStats, "expected", lambda self, length: float(length))
    monkeypatch.setattr(Pacer, "draft_now", lambda self: False)
    heard = []
    real = Pacer.record_plain

    def record(self, seconds, tokens=1, size=1):
        heard.append(tokens)
        real(self, seconds, tokens, size)

    monkeypatch.setattr(Pacer, "record_plain", record)
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=4)
    oracle.propose = None  # a drafter pass fails the test
    cfg = GenerationConfig(max_tokens=N, mode="ddtree", budget="auto", lookup=8)
    every = list(generate_rounds(Session(target, oracle), PROMPT, cfg))
    assert [t for r in every for t in r.tokens] == ref
    rounds = [r for r in every if not r.prefill]
    assert sum(r.drafted > 0 for r in rounds) >= 5, "lookup stopped in the pause"
    # (every round but a last one with room for no draft, which is a plain step outside it)
    assert heard == [len(r.tokens) for r in rounds][: len(heard)] and len(heard) >= len(rounds) - 1


def test_rounds_that_skip_the_drafter_for_lookup_stay_exact(target, monkeypatch, tmp_path):
    """Rounds where the policy finds the lookup branches enough run no drafter pass (and the
    drafter still gets their context); with every other round skipping, output is exact. The
    branches are kept whole: priced by the clock (cut_lookup), a loaded machine could cut
    them all, and no round would skip (it failed so once in a full run)."""
    from mlx_dflash.engine.budget import AutoBudget

    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path))
    monkeypatch.setattr(lookup_mod, "MIN_NGRAM", 1)
    flips = itertools.cycle([True, False])
    monkeypatch.setattr(AutoBudget, "lookup_suffices", lambda self, *a: next(flips))
    monkeypatch.setattr(AutoBudget, "cut_lookup", lambda self, tree, chains, *a: chains)
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=4)
    passes = []
    real = oracle.propose
    oracle.propose = lambda *a: passes.append(1) or real(*a)
    kw = dict(max_tokens=N, mode="ddtree", budget="auto", lookup=8)
    out, taus = run(Session(target, oracle), PROMPT, **kw)
    assert out == ref and max(taus) > 2
    assert 0 < len(passes) < len(taus)


def test_lookup_never_verifies_past_max_tokens(target):
    ref = mlx_lm_greedy(target, PROMPT, N)
    for n in (1, 2, 3, 5, 9):
        out, _ = run(Session(target), PROMPT, max_tokens=n, mode="lookup", lookup=16)
        assert out == ref[:n]


def test_lookup_needs_a_tree_mode():
    with pytest.raises(DFlashError, match="--lookup"):
        GenerationConfig(mode="dflash", lookup=4)
    with pytest.raises(DFlashError, match="--lookup"):
        GenerationConfig(mode="lookup", lookup=-1)
    assert GenerationConfig(mode="lookup").lookup > 0


def sampling_target() -> Target:
    """A 2-layer llama over test_sampling's small vocabulary, whose exact marginals the
    chi-square checks compare with."""
    cfg = tiny_target_config("llama", vocab_size=V, num_hidden_layers=2)
    mod = load_module("llama")
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    diversify(model, gain=1.0, seed=3)
    return Target(model, None, cfg)


def assert_lossless(monkeypatch, target, prompt, sampling, what: str, depth=3, **cfg):
    """1500 sampled generations of `depth` tokens in --mode lookup (plus `cfg`): `what`
    drafts were accepted, and each position's tokens follow the target's exact marginals."""
    samples, taus = [], []
    for seed in range(1500):
        gen = GenerationConfig(max_tokens=depth, sampling=sampling, seed=seed, mode="lookup", **cfg)
        out, t = run(Session(target), prompt, **vars(gen))
        samples.append(out)
        taus += t
    samples = np.array(samples)
    assert 1.0 < np.mean(taus), f"{what} were never accepted"
    import test_sampling

    monkeypatch.setattr(test_sampling, "PROMPT", prompt)
    for k, expected in enumerate(exact_marginals(target, sampling, depth)):
        assert chi2_pvalue(samples[:, k], expected) > 1e-3, f"token {k + 1} is biased"


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.8, 0.9, 6)])
def test_lookup_sampling_matches_target(monkeypatch, sampling):
    """Every token of the vocabulary has earlier continuations (unigram lookup), so each round
    verifies lookup branches; the emitted tokens must still follow the target exactly."""
    monkeypatch.setattr(lookup_mod, "MIN_NGRAM", 1)
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in itertools.chain(rng.permutation(V), rng.permutation(V))]
    assert_lossless(monkeypatch, sampling_target(), prompt, sampling, "lookup branches")


def test_echo_branches_keep_sampling_lossless(monkeypatch):
    """A prompt of distinct tokens: no 2-gram repeats early, but every token occurred, so the
    rounds verify echo branches (offered at a fixed budget here: only auto offers them)."""
    from mlx_dflash.engine.budget import FixedBudget

    monkeypatch.setattr(FixedBudget, "prices_lookup", True)
    prompt = [int(t) for t in np.random.default_rng(8).permutation(V)]
    assert_lossless(monkeypatch, sampling_target(), prompt, SamplingParams(1.0), "echo branches")


def test_rounds_index_exactly_the_text_so_far(target, monkeypatch):
    """Each round appends only what it committed; the index must then hold the whole text
    (prompt, every emitted token, the newest one included) and nothing else."""
    from mlx_dflash.engine.ddtree import DDTree

    checked = []
    real = DDTree._lookup_branches  # the one place a round extends the index

    def checking(self, last, tokens_left):
        chains = real(self, last, tokens_left)
        assert self.lookup.tokens == [*self.session.tokens, last]
        checked.append(1)
        return chains

    monkeypatch.setattr(DDTree, "_lookup_branches", checking)
    target.set_taps([1, 3])
    ref = mlx_lm_greedy(target, PROMPT, N)
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=4)
    for session, mode in ((Session(target, oracle), "ddtree"), (Session(target), "lookup")):
        out, _ = run(session, PROMPT, max_tokens=N, mode=mode, budget="auto", lookup=6)
        assert out == ref
    assert len(checked) > 4
