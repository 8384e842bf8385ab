"""Sampling is lossless: emitted tokens follow the target's distribution (chi-square tests).

Every draft source is legitimate for speculative sampling, so a weak random drafter is used:
its proposals are accepted sometimes and rejected often, exercising both branches.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from oracle import diversify
from scipy.stats import chisquare

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.sampling import SamplingParams, speculative_on_device, token_probs
from mlx_dflash.models.drafter import DrafterRunner, init_drafter
from mlx_dflash.models.drafter_config import DrafterConfig
from mlx_dflash.models.target import Target
from mlx_dflash.models.tiny import load_module, tiny_target_config

V = 24
PROMPT = [3, 9, 4, 17, 5]


def chi2_pvalue(samples: np.ndarray, expected_p: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells whose expected count is under 5."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(expected_p)).astype(float)
    exp = expected_p * n
    big, small = exp >= 5, (exp > 0) & (exp < 5)
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if small.any():
        obs_b.append(counts[small].sum())
        exp_b.append(exp[small].sum())
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    assert counts[expected_p == 0].sum() == 0, "emitted a token the target can never produce"
    return chisquare(obs_b, exp_b * obs_b.sum() / exp_b.sum()).pvalue


def test_speculative_acceptance_rule_marginals():
    """The device-side rule: the first emitted token is distributed as p[0], and after a full
    accept the bonus as p[n] (q has no row there)."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V) * 0.5, size=3).astype(np.float32)
    q = rng.dirichlet(np.ones(V) * 0.5, size=2).astype(np.float32)
    pm, qm = mx.array(p), mx.array(q)
    firsts, after_full = [], []
    for i in range(6000):
        drafts = np.array([rng.choice(V, p=q[0]), rng.choice(V, p=q[1])])
        a, bonus = speculative_on_device(mx.array(drafts), pm, qm, mx.random.key(i))
        a, bonus = int(a.item()), int(bonus.item())
        firsts.append(drafts[0] if a >= 1 else bonus)
        if a == 2:
            after_full.append(bonus)
    assert chi2_pvalue(np.array(firsts), p[0].astype(np.float64)) > 1e-3
    assert len(after_full) > 300
    assert chi2_pvalue(np.array(after_full), p[2].astype(np.float64)) > 1e-3


def test_token_probs_matches_mlx_lm_sampler_support():
    """top-p / min-p / top-k pick the candidate set on the untempered distribution, in
    mlx-lm's order."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logits = mx.array(np.random.default_rng(1).normal(size=(1, V)).astype(np.float32) * 2)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    cases = [(0.8, 0, 0.0, 1), (1.0, 5, 0.0, 1), (0.9, 7, 0.0, 1), (1.0, 0, 0.1, 1),
             (0.9, 0, 0.05, 1), (1.0, 4, 0.2, 1), (1.0, 0, 0.9, 3)]  # fmt: skip
    for top_p, top_k, min_p, keep in cases:
        ref = lp
        if top_p < 1:
            ref = apply_top_p(ref, top_p)
        if min_p:
            ref = apply_min_p(ref, min_p, keep)
        if top_k:
            ref = apply_top_k(ref, top_k)
        ref_p = np.array(mx.softmax(ref / 0.7, axis=-1))[0]
        ours = token_probs(logits, SamplingParams(0.7, top_p, top_k, min_p, keep))[0]
        np.testing.assert_allclose(ours, ref_p, atol=1e-6)
        assert (
            min_p == 0 or (ours == 0).sum() > (token_probs(logits, SamplingParams(0.7)) == 0).sum()
        )


@pytest.fixture(scope="module")
def small_target():
    cfg = tiny_target_config("llama", vocab_size=V, num_hidden_layers=2)
    mod = load_module("llama")
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    diversify(model, gain=1.0, seed=3)
    return Target(model, None, cfg)


def exact_marginals(target, sampling, depth):
    """Marginal distribution of generated tokens 1..depth, by enumerating every prefix."""
    marg, prefixes, weights = [], [()], np.array([1.0])
    for _ in range(depth):
        batch = mx.array([PROMPT + list(pre) for pre in prefixes])
        logits = target.model(batch)[:, -1, :]
        cond = token_probs(logits, sampling)  # (len(prefixes), V)
        joint = weights[:, None] * cond
        marg.append(joint.sum(axis=0))
        prefixes = [pre + (t,) for pre, t in itertools.product(prefixes, range(V))]
        weights = joint.reshape(-1)
    return marg


@pytest.mark.parametrize(
    "sampling,mode,budget,draft_vocab",
    [
        (SamplingParams(1.0), "dflash", 0, False),
        (SamplingParams(0.7, 0.9, 0), "dflash", 0, False),
        (SamplingParams(1.3, 1.0, 6), "dflash", 0, False),
        (SamplingParams(1.0), "ddtree", 6, False),
        (SamplingParams(0.8, 0.95, 8), "ddtree", 3, False),
        (SamplingParams(1.0, min_p=0.15), "ddtree", 6, False),
        (SamplingParams(1.0, xtc_probability=0.5, xtc_threshold=0.05), "ddtree", 6, False),
        # q is zero outside the draft vocabulary: those tokens come only from the residual.
        (SamplingParams(1.0), "dflash", 0, True),
        (SamplingParams(1.0), "ddtree", 6, True),
    ],
)
def test_emitted_distribution_matches_target(small_target, sampling, mode, budget, draft_vocab):
    target = small_target
    cfg = DrafterConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=V,
        block_size=4,
        mask_token_id=V - 1,
        target_layer_ids=[0, 1],
        layer_types=["full_attention"],
    )
    target.set_taps(cfg.target_layer_ids)
    drafter = init_drafter(cfg, seed=5)
    if draft_vocab:
        drafter.draft_vocab = np.arange(0, V, 2)
    depth = 3
    samples, taus = [], []
    for seed in range(1500):
        session = Session(target, DrafterRunner(drafter, target))
        gen = GenerationConfig(
            max_tokens=depth,
            sampling=sampling,
            seed=seed,
            block_size=4,
            mode=mode,
            budget=budget or 1,
        )
        out = []
        for r in generate_rounds(session, PROMPT, gen):
            out += r.tokens
            taus += [] if r.prefill else [r.accepted]
        samples.append(out)
    samples = np.array(samples)
    assert 1.0 < np.mean(taus) < 3.0, "both acceptance and rejection must be exercised"
    for k, expected in enumerate(exact_marginals(target, sampling, depth)):
        assert chi2_pvalue(samples[:, k], expected) > 1e-3, f"token {k + 1} is biased"


def test_xtc_is_mlx_lm_samplers_distribution():
    """XTC's coin makes a token's distribution the mixture of the kept and the excluded one:
    ours, against 40000 draws of mlx-lm's own sampler (make_sampler with XTC) on the same
    logits, and the exclusion itself against mlx-lm's apply_xtc."""
    from mlx_lm.sample_utils import apply_xtc, make_sampler

    logits = mx.array(np.random.default_rng(7).normal(size=(1, V)).astype(np.float32) * 1.5)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    params = SamplingParams(0.9, top_k=12, xtc_probability=0.5, xtc_threshold=0.08,
                            xtc_special=(3,))  # fmt: skip
    ours = token_probs(logits, params)[0]
    forced = apply_xtc(lp, 1.0, 0.08, [3])  # the coin always says exclude
    excluded = token_probs(logits, SamplingParams(0.9, xtc_probability=1.0, xtc_threshold=0.08,
                                                  xtc_special=(3,)))[0]  # fmt: skip
    assert np.array_equal(np.isfinite(np.array(forced))[0], excluded > 0)
    assert 0 < (excluded == 0).sum() < V - 2
    sampler = make_sampler(0.9, top_k=12, xtc_probability=0.5, xtc_threshold=0.08,
                           xtc_special_tokens=[3])  # fmt: skip
    mx.random.seed(0)
    draws = np.array([int(sampler(lp).item()) for _ in range(40000)])
    assert chi2_pvalue(draws, ours) > 1e-3
    plain = token_probs(logits, SamplingParams(0.9, top_k=12))[0]
    assert set(draws.tolist()) - set(np.nonzero(plain)[0].tolist())  # (not the plain sampler)
