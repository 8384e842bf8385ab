"""The DDTree round: draft a tree from one drafter pass, verify it in one target pass with
tree attention, walk it, compact the caches to the accepted path (docs/ddtree.md)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from .budget import AUTO_MAX_BUDGET, Pacer, VerifyProfile, choose_budget, profile_key
from .rounds import plain_round
from .session import Round
from .tree import Tree, build_tree, expected_tokens, top_candidates, walk


class DDTree:
    """Round logic for `--mode ddtree`; holds the auto-budget profile between rounds."""

    def __init__(self, session, cfg):
        self.session = session
        self.sampling = cfg.sampling
        self.budget = cfg.budget
        self.branching = getattr(cfg, "branching", None)
        self.profile = self.pacer = None
        if self.budget == "auto":
            self.profile = VerifyProfile.load_or_measure(
                session.target, profile_key(session.target)
            )
            self.pacer = Pacer(float(self.profile.cost(1)))
        self.t_fixed = 0.0  # running estimate of draft + bookkeeping time per round
        self.expected = self.realised = 0.0  # running extra tokens: predicted vs accepted
        self.tree_rounds = 0
        self.budgets: list[int] = []

    @property
    def calibration(self) -> float:
        """Accepted / predicted extra tokens so far (1 until there is evidence), in [0.1, 2].

        Both running means start at 0 and decay alike, so their ratio needs no warm-up
        correction; a few rounds keep one lucky round from deciding it.
        """
        if self.tree_rounds < 4 or self.expected <= 1e-6:
            return 1.0
        return float(np.clip(self.realised / self.expected, 0.1, 2.0))

    def round(self, last: int, n: int, rng) -> Round:
        session, target, drafter = self.session, self.session.target, self.session.drafter
        if self.pacer is not None and not self.pacer.draft_now():
            rnd = plain_round(session, last, self.sampling, rng, feed_drafter=True)
            self.pacer.record_plain(rnd.t_verify + rnd.t_other)
            return rnd
        start = len(session.tokens)
        t0 = time.perf_counter()
        max_b = AUTO_MAX_BUDGET if self.budget == "auto" else self.budget
        # A tree of max_b nodes is at most max_b deep: deeper slots' logits would go unused,
        # and the LM head over them is most of the drafter's time on a CPU.
        logits_q = drafter.propose(last, start, min(n, max_b))
        k = min(self.branching or max_b, max_b)
        cand_tok, cand_lp = top_candidates(logits_q, k)
        tree = build_tree(last, cand_tok, cand_lp, max_b)
        if self.profile is not None:
            b = choose_budget(tree, self.profile, self.t_fixed, self.calibration)
            tree = Tree(
                tree.tokens[: b + 1],
                tree.parents[: b + 1],
                tree.depths[: b + 1],
                tree.log_probs[: b + 1],
            )
        self.budgets.append(len(tree.tokens) - 1)
        t1 = time.perf_counter()
        logits, taps = target.forward(
            mx.array(tree.tokens.astype(np.int32)), session.cache, start, parents=tree.parents
        )
        mx.eval(logits, taps)
        t2 = time.perf_counter()
        path, bonus = walk(tree, logits, self.sampling, rng)
        for c in session.cache:
            c.compact(start, path)
        session.tokens.extend(int(tree.tokens[i]) for i in path)
        drafter.add_context(taps[mx.array(path)])
        out = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        t3 = time.perf_counter()
        self.t_fixed = (
            0.8 * self.t_fixed + 0.2 * ((t1 - t0) + (t3 - t2))
            if self.t_fixed
            else (t1 - t0) + (t3 - t2)
        )
        if self.pacer is not None:
            self.expected = 0.9 * self.expected + 0.1 * (expected_tokens(tree)[-1] - 1.0)
            self.realised = 0.9 * self.realised + 0.1 * (len(path) - 1)
            self.tree_rounds += 1
            self.pacer.record_tree(len(out), t3 - t0)
        return Round(
            out, len(path), len(tree.tokens) - 1, t_draft=t1 - t0, t_verify=t2 - t1, t_other=t3 - t2
        )
