"""The tree round: draft a tree from one drafter pass (plus prompt-lookup branches), verify it in
one target pass with tree attention, walk it, commit the accepted path (docs/ddtree.md).

How big a tree to draft, and whether to draft at all, is the budget policy's (budget.py); what
the round keeps between rounds is only the prompt-lookup index and its acceptance counts.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..kernels.tree_attention import tree_depths
from .budget import AutoBudget, FixedBudget
from .contract import Drafter, Pass, Proposal
from .corpus import corpus_of, lookup_corpus
from .device import read
from .grammar import Grammar, prune_tree, with_certain_run
from .lookup import MAX_BRANCHES, LookupStats, PromptLookup
from .rounds import plain_round, token_logprobs
from .session import GenerationConfig, Round, Session
from .tree import Tree, graft, root_only, walk


class DDTree:
    """The round of `--mode ddtree` and `--mode lookup`: the drafter's tree and/or prompt lookup
    branches (lookup.py), one verify. Under a grammar (engine/grammar.py) the tree holds only
    what it allows, plus its certain runs, and the walk masks the target's logits; DFlash's
    round under a grammar is this round with `branching` 1."""

    def __init__(
        self,
        session: Session,
        cfg: GenerationConfig,
        policy: FixedBudget | AutoBudget,
        grammar: Grammar | None = None,
        branching: int | None = None,
    ):
        self.session = session
        self.sampling = cfg.sampling
        self.policy = policy
        self.grammar = grammar
        self.branching = branching or cfg.branching
        # --mode lookup drafts from the text alone, even when a drafter is loaded.
        self.drafter = session.drafter if cfg.uses_drafter else None
        self.lookup_len = cfg.lookup or 0  # (GenerationConfig resolved its default)
        self.lookup = PromptLookup() if self.lookup_len > 0 else None
        self.lookup_stats = LookupStats()
        # The past answers' branches stand in where the text at hand has none; they are
        # accepted at their own rate, so they are cut by their own counts.
        self.corpus = corpus_of(lookup_corpus(cfg, session.drafter)) if self.lookup else None
        self.corpus_stats = LookupStats()
        self.echo_stats = LookupStats()  # PromptLookup.echo's
        self.chain_stats = self.lookup_stats  # the counts this round's branches came with
        self.logprobs = cfg.logprobs
        self.budgets: list[int] = []  # each verified tree's size (bench and tests read them)

    def __call__(self, last: int, n: int, rng, tokens_left: int) -> Round:
        """One round after `last`: the drafter drafts at most `n` deep, lookup branches at most
        `tokens_left` (the tokens max_tokens still allows after the bonus)."""
        session, policy = self.session, self.policy
        # rank 0's clock decides for all ranks; a grammar's certain run is always worth a verify
        want = policy.draft_now()
        lookup_only = self._lookup_only(last, tokens_left) if want else None
        want_agreed, lookup_only_agreed = session.agree([want, lookup_only is not None])
        drafting = bool(want_agreed) and not lookup_only_agreed
        start = len(session.tokens)
        t0 = time.perf_counter()
        tree, n_drafted, chains, t_build, pruned, t_pass = self._draft(
            last, start, n, tokens_left, drafting, lookup_only if lookup_only_agreed else None
        )
        if len(tree.tokens) == 1:  # nothing to verify: a plain step
            t_draft = time.perf_counter() - t0
            rnd = self._plain(last, rng)
            if drafting and self.drafter is not None:
                # A draft the budget cut to nothing cost its drafting and earned no token more
                # than the plain step: the pacer hears it as a lost round, so it pauses.
                t = t_draft + rnd.t_verify + rnd.t_other
                policy.record_tree(tree, 0, [0], 1, t_draft, t)
            return rnd
        self.budgets.append(len(tree.tokens) - 1)
        t1 = time.perf_counter()
        logits, taps = self._verify(tree, start)
        # greedy: the target's choice at every node comes back with the verify's one wait
        t_build += time.perf_counter() - t1
        verified = [logits] if taps is None else [logits, taps]
        if self.sampling.greedy:  # the target's choice at every node, read in the same wait
            (choice,) = read(mx.argmax(logits, axis=-1), also=verified)
        else:
            choice = None
            mx.eval(verified)
        t2 = time.perf_counter()
        path, out, lps = self._accept(tree, logits, taps, rng, chains, choice)
        t3 = time.perf_counter()
        drafted = n_drafted if self.drafter is not None else 0
        if drafting:
            overhead = (t1 - t0) + (t3 - t2)
            policy.record_tree(tree, drafted, path, len(out), overhead, t3 - t0, t_pass)
        else:  # a pause's round (lookup branches, a certain run): what not drafting earns
            policy.record_plain(t3 - t0, len(out), len(tree.tokens))
        certain = tree.is_certain()
        return Round(
            out,
            len(path),
            len(tree.tokens) - 1,
            t_draft=t1 - t0,
            t_verify=t2 - t1,
            t_other=t3 - t2,
            t_build=t_build,
            logprobs=lps,
            pruned=pruned,
            certain=int(certain.sum()),
            certain_accepted=int(sum(certain[i] for i in path[1:])),
        )

    def _accept(self, tree: Tree, logits, taps, rng, chains: list[list[int]], choice=None):
        """Walk the verified tree (under a grammar, its masked walk), agreed over the ranks,
        and commit the accepted path: (path, emitted tokens, their logprobs or None)."""
        session = self.session
        masks: list | None = [] if self.logprobs is not None else None
        path, bonus = walk(tree, logits, self.sampling, rng, self.grammar, masks, choice)
        *path, bonus = session.world.agree_seq([*path, bonus]).tolist()
        session.commit([int(tree.tokens[i]) for i in path], taps, path)
        out = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        if self.grammar is not None:
            self.grammar.accept(out)
        lps = None
        if self.logprobs is not None:
            lps = token_logprobs(logits, path, out, self.logprobs, masks or None)
        for chain in chains:
            self.chain_stats.record(chain, out)
        return path, out, lps

    def _draft(
        self,
        last: int,
        start: int,
        n: int,
        tokens_left: int,
        drafting: bool = True,
        lookup_only: tuple[Tree, list[list[int]]] | None = None,
    ):
        """(tree, how many of its nodes the drafter made, lookup chains grafted, build time,
        nodes the grammar pruned, seconds in the drafter's pass and tree), agreed over the
        ranks of a sharded target. Not `drafting` (auto's pause, or `lookup_only`: the
        lookup-only round `_lookup_only` found), the drafter does not run: a grammar's certain
        run and (with a drafter loaded) lookup branches still do."""
        t0 = time.perf_counter()
        t_build, pruned, grammar = 0.0, 0, self.grammar
        drafter = self.drafter if lookup_only is None and drafting else None
        # Lookup branches cost no drafter pass: a pause stops the drafter, not them (their own
        # measured acceptance cuts them). Only in --mode lookup, where they are all the round
        # drafts, does a pause stop them too.
        looking = lookup_only is None and self.lookup is not None
        looking = looking and (drafting or self.drafter is not None)
        if drafter is not None:  # queued: the branch search runs while the drafter computes
            proposal, t_build = self._propose(drafter, last, start, n)
        t1 = time.perf_counter()
        found = self._lookup_branches(last, tokens_left) if looking else []
        t2 = time.perf_counter()
        if lookup_only is not None:
            tree, chains = lookup_only
        elif drafter is not None:
            tree, pruned = self._drafter_tree(proposal, last, tokens_left)
        else:
            tree = self._base_tree(last, tokens_left)
        # the drafter's pass and tree, not the branch search
        n_drafted, t_pass = len(tree.tokens), (t1 - t0) + (time.perf_counter() - t2)
        if lookup_only is None:
            chains = self._cut_lookup(tree, found, drafting) if looking else []
        tree = graft(tree, chains)
        if chains and grammar is not None:
            tree, cut = prune_tree(tree, grammar)
            pruned += cut
        tree, n_drafted = _agree_tree(self.session, tree, n_drafted)
        return tree, n_drafted, chains, t_build, pruned, t_pass

    def _propose(self, drafter: Drafter, last: int, start: int, n: int) -> tuple[Proposal, float]:
        """The drafter's pass, queued (mx.async_eval) with what its tree will read, and its
        graph's build time. A tree of max_budget nodes is at most max_budget deep: deeper
        slots' logits would go unused, and the LM head over them is most of the drafter's time
        on a CPU."""
        t0 = time.perf_counter()
        max_b = self.policy.max_budget
        proposal = drafter.propose(last, start, min(n, max_b))
        proposal.queue(max_b, self.branching, self._temperature(), self.grammar is not None)
        return proposal, time.perf_counter() - t0

    def _temperature(self) -> float:
        """The temperature a tree's path probabilities are taken at."""
        return self.sampling.temperature if not self.sampling.greedy else 1.0

    def _drafter_tree(self, proposal: Proposal, last: int, tokens_left: int) -> tuple[Tree, int]:
        """The drafter's best-first tree, cut by the budget policy: (tree, nodes pruned)."""
        max_b, grammar, temp = self.policy.max_budget, self.grammar, self._temperature()
        if grammar is None:
            return self.policy.cut(proposal.tree(last, max_b, self.branching, temp)), 0
        # Under a grammar: only what it allows, and its forced runs as certain nodes.
        return proposal.constrained_tree(
            last, max_b, self.branching, temp, grammar, tokens_left, self.policy.cut
        )

    def _base_tree(self, last: int, tokens_left: int) -> Tree:
        """The round's tree before any drafter or lookup node: the root, and after it a
        grammar's certain run."""
        tree = root_only(last)
        if self.grammar is not None:
            tree = with_certain_run(tree, self.grammar, min(tokens_left, self.policy.max_budget))
        return tree

    def _cut_lookup(self, tree: Tree, chains: list[list[int]], drafting: bool) -> list[list[int]]:
        """The lookup branches `tree` takes, as the budget policy cuts them."""
        drafted = drafting and self.drafter is not None
        return self.policy.cut_lookup(tree, chains, self.chain_stats, drafted)

    def _lookup_branches(self, last: int, tokens_left: int) -> list[list[int]]:
        """The text's (else the corpus's, else the last token's) branches after `last`; their
        counts become chain_stats."""
        # The index holds session.tokens + [last] as of its last call (this round's, or the
        # last round's, whose `last` is now in session.tokens): only what follows is new.
        lookup, tokens = self.lookup, self.session.tokens
        assert lookup is not None
        done = len(lookup.tokens)
        lookup.extend([*tokens[done:], last] if done <= len(tokens) else [])
        length = min(self.lookup_len, tokens_left)
        chains, self.chain_stats = lookup.branches(length), self.lookup_stats
        if not chains and self.corpus is not None:
            chains = self.corpus.branches(lookup.tokens, length, MAX_BRANCHES)
            self.chain_stats = self.corpus_stats
        if not chains and self.policy.prices_lookup:  # (a fixed budget would verify them all)
            chains, self.chain_stats = lookup.echo(length), self.echo_stats
        return chains

    def _lookup_only(self, last: int, tokens_left: int) -> tuple[Tree, list[list[int]]] | None:
        """This round without a drafter pass (its base tree and cut lookup branches), where
        the policy finds the branches enough (budget.py: AutoBudget.lookup_suffices)."""
        if self.drafter is None or self.lookup is None:
            return None
        base = self._base_tree(last, tokens_left)
        chains = self._cut_lookup(base, self._lookup_branches(last, tokens_left), drafting=False)
        if chains and self.policy.lookup_suffices(base, chains, self.chain_stats):
            return base, chains
        return None

    def _verify(self, tree: Tree, start: int):
        tokens = mx.array(tree.tokens.astype(np.int32))
        taps = self.drafter is not None
        p = Pass(tokens, self.session.cache, start, tree.parents, taps=taps)
        return self.session.target.forward([p])[0]

    def _plain(self, last: int, rng) -> Round:
        rnd = plain_round(
            self.session,
            last,
            self.sampling,
            rng,
            feed_drafter=self.drafter is not None,
            logprobs=self.logprobs,
            grammar=self.grammar,
        )
        self.policy.record_plain(rnd.t_verify + rnd.t_other)
        return rnd


def _agree_tree(session: Session, tree: Tree, n_drafted: int) -> tuple[Tree, int]:
    """Rank 0's tree on every rank (its size came from rank 0's clock under --budget auto)."""
    vals = session.world.agree_seq([n_drafted, *tree.tokens.tolist(), *tree.parents.tolist()])
    n = (len(vals) - 1) // 2
    tokens, parents = vals[1 : 1 + n], vals[1 + n :]
    if np.array_equal(tokens, tree.tokens) and np.array_equal(parents, tree.parents):
        return tree, int(vals[0])
    depths = tree_depths(parents).astype(np.int64)
    return Tree(tokens, parents, depths, np.zeros(n)), int(vals[0])
