"""The DDTree round: draft a tree from one drafter pass, verify it in one target pass with
tree attention, walk it, compact the caches to the accepted path (docs/ddtree.md)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from .budget import AUTO_MAX_BUDGET, Pacer, VerifyProfile, choose_budget, profile_key
from .lookup import LookupStats, PromptLookup
from .rounds import plain_round
from .session import Round
from .tree import Tree, build_tree, expected_tokens, graft, root_only, top_candidates, walk


class DDTree:
    """Round logic for `--mode ddtree` and `--mode lookup`: the drafter's tree and/or prompt
    lookup branches (lookup.py), one verify; holds the auto-budget state between rounds."""

    def __init__(self, session, cfg):
        self.session = session
        self.sampling = cfg.sampling
        self.budget = cfg.budget
        self.branching = getattr(cfg, "branching", None)
        # --mode lookup drafts from the text alone, even when a drafter is loaded.
        self.drafter = session.drafter if cfg.mode == "ddtree" else None
        self.lookup_len = cfg.lookup
        self.lookup = PromptLookup() if cfg.lookup > 0 else None
        self.lookup_stats = LookupStats()
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
        self.t_build = 0.0  # this round's Python graph building (Round.t_build)

    @property
    def calibration(self) -> float:
        """Accepted / predicted extra tokens so far (1 until there is evidence), in [0.1, 2].

        Both running means start at 0 and decay alike, so their ratio needs no warm-up
        correction; a few rounds keep one lucky round from deciding it.
        """
        if self.tree_rounds < 4 or self.expected <= 1e-6:
            return 1.0
        return float(np.clip(self.realised / self.expected, 0.1, 2.0))

    def _plain(self, last: int, rng) -> Round:
        rnd = plain_round(
            self.session, last, self.sampling, rng, feed_drafter=self.drafter is not None
        )
        if self.pacer is not None:
            self.pacer.record_plain(rnd.t_verify + rnd.t_other)
        return rnd

    def _drafter_tree(self, last: int, start: int, n: int) -> Tree:
        max_b = AUTO_MAX_BUDGET if self.budget == "auto" else self.budget
        # A tree of max_b nodes is at most max_b deep: deeper slots' logits would go unused,
        # and the LM head over them is most of the drafter's time on a CPU.
        t0 = time.perf_counter()
        logits_q = self.drafter.propose(last, start, min(n, max_b))
        self.t_build = time.perf_counter() - t0
        k = min(self.branching or max_b, max_b)
        cand_tok, cand_lp = top_candidates(logits_q, k)
        tree = build_tree(last, cand_tok, cand_lp, max_b)
        if self.profile is None:
            return tree
        b = choose_budget(tree, self.profile, self.t_fixed, self.calibration)
        return Tree(
            tree.tokens[: b + 1],
            tree.parents[: b + 1],
            tree.depths[: b + 1],
            tree.log_probs[: b + 1],
        )

    def _lookup_chains(self, tree: Tree, last: int, room: int) -> list[list[int]]:
        """Lookup branches for this round; under --budget auto, cut to the length that
        maximises expected tokens per second at the measured lookup acceptance."""
        # The index holds session.tokens + [last] as of the last round: its last token is the
        # old `last`, now in session.tokens, so only the tokens after it are new.
        self.lookup.extend([*self.session.tokens[len(self.lookup.tokens) :], last])
        chains = self.lookup.branches(min(self.lookup_len, room))
        if not chains or self.profile is None:
            return chains
        base = 1.0
        if self.drafter is not None:
            base += self.calibration * (expected_tokens(tree)[-1] - 1.0)
        best, best_rate = 0, base / (self.t_fixed + self.profile.cost(len(tree.tokens)))
        for length in range(1, max(len(c) for c in chains) + 1):
            size = len(graft(tree, [c[:length] for c in chains]).tokens)
            rate = (base + self.lookup_stats.expected(length)) / (
                self.t_fixed + self.profile.cost(size)
            )
            if rate > best_rate:
                best, best_rate = length, rate
        return [c[:best] for c in chains] if best else []

    def round(self, last: int, n: int, rng, room: int | None = None) -> Round:
        """One round after `last`: the drafter drafts at most `n` deep, lookup branches at most
        `room` (the tokens max_tokens still allows after the bonus; default n)."""
        session, target, drafter = self.session, self.session.target, self.drafter
        room = n if room is None else room
        draft_now = self.pacer is None or self.pacer.draft_now()
        if session.world is not None:  # the pacer reads this rank's clock: rank 0 decides
            draft_now = bool(session.agree([draft_now])[0])
        if not draft_now:
            return self._plain(last, rng)
        start = len(session.tokens)
        t0 = time.perf_counter()
        self.t_build = 0.0
        tree = self._drafter_tree(last, start, n) if drafter is not None else root_only(last)
        n_drafted = len(tree.tokens)
        chains = self._lookup_chains(tree, last, room) if self.lookup is not None else []
        tree = graft(tree, chains)
        if session.world is not None:
            tree, n_drafted = _agree_tree(session, tree, n_drafted)
        if len(tree.tokens) == 1:  # nothing to verify: a plain step
            return self._plain(last, rng)
        self.budgets.append(len(tree.tokens) - 1)
        t1 = time.perf_counter()
        logits, taps = target.forward(
            mx.array(tree.tokens.astype(np.int32)),
            session.cache,
            start,
            parents=tree.parents,
            taps=drafter is not None,
        )
        self.t_build += time.perf_counter() - t1
        mx.eval(logits if taps is None else (logits, taps))
        t2 = time.perf_counter()
        path, bonus = walk(tree, logits, self.sampling, rng)
        if session.world is not None:
            *path, bonus = session.world.agree_seq([*path, bonus]).tolist()
        for c in session.cache:
            c.compact(start, path)
        session.tokens.extend(int(tree.tokens[i]) for i in path)
        if drafter is not None:
            drafter.add_context(taps[mx.array(path)])
        out = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        for chain in chains:
            self.lookup_stats.record(chain, out)
        t3 = time.perf_counter()
        self.t_fixed = (
            0.8 * self.t_fixed + 0.2 * ((t1 - t0) + (t3 - t2))
            if self.t_fixed
            else (t1 - t0) + (t3 - t2)
        )
        if self.pacer is not None:
            if drafter is not None:
                predicted = expected_tokens(tree)[n_drafted - 1] - 1.0
                self.expected = 0.9 * self.expected + 0.1 * predicted
                self.realised = 0.9 * self.realised + 0.1 * sum(i < n_drafted for i in path[1:])
            self.tree_rounds += 1
            self.pacer.record_tree(len(out), t3 - t0)
        return Round(
            out,
            len(path),
            len(tree.tokens) - 1,
            t_draft=t1 - t0,
            t_verify=t2 - t1,
            t_other=t3 - t2,
            t_build=self.t_build,
        )


def _agree_tree(session, tree: Tree, n_drafted: int) -> tuple[Tree, int]:
    """Rank 0's tree on every rank (its size came from rank 0's clock under --budget auto)."""
    vals = session.world.agree_seq([n_drafted, *tree.tokens.tolist(), *tree.parents.tolist()])
    n = (len(vals) - 1) // 2
    tokens, parents = vals[1 : 1 + n], vals[1 + n :]
    if np.array_equal(tokens, tree.tokens) and np.array_equal(parents, tree.parents):
        return tree, int(vals[0])
    depths = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return Tree(tokens, parents, depths, np.zeros(n)), int(vals[0])
