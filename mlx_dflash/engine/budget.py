"""The tree round's budget policy: a fixed `--budget N`, or `--budget auto` (docs/auto-budget.md):
each round's tree size from measured verify cost and the drafter's calibrated confidence, and a
pacer that pauses drafting while it loses to plain decoding steps.

The tree round (ddtree.py) only asks its policy: draft this round? how deep? cut this tree?
cut these lookup branches? and tells it what each round cost and earned. Both policies answer
the same questions, so the round has no `if auto` of its own.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..paths import profile_key, read_profile, write_profile
from .contract import Pass
from .session import Session
from .tree import Tree, expected_tokens, graft, graft_sizes

AUTO_MAX_BUDGET = 64

# The running means --budget auto keeps between rounds, each new value weighing:
COST_WEIGHT = 0.2  # what a round costs (outside the verify, the drafter's pass and nodes, the
#                    machine's speed against the profile): the last ~5 rounds
ACCEPT_WEIGHT = 0.1  # the drafter's predicted against accepted drafts: ~10 rounds (noisier)


def smooth(old: float, new: float, weight: float, first: bool = False) -> float:
    """The running mean after `new` (exponentially weighted); `new` itself when `first`."""
    return new if first else (1 - weight) * old + weight * new


def session_at(target, context: int) -> tuple[Session, mx.array]:
    """A Session of `target` with `context` tokens cached, and their ids: where the verify
    profile and the queueing choice (models/queueing.py) time verifies."""
    session = Session(target)
    prompt = (np.arange(context) % max(2, target.vocab_size - 1)).tolist()
    ids = mx.array(prompt, dtype=mx.int32)
    p = Pass(ids, session.cache, 0, logits="last", taps=False, rewindable=False)
    logits, _ = target.forward([p])[0]
    session.commit(prompt)
    # The logits too: on a pipeline stage they are what carries the send to the next rank.
    mx.eval(logits, [c.state_arrays for c in session.cache])
    session.mark_prompt_end()  # recurrent layers (hybrid targets) rewind to here
    return session, ids


class VerifyProfile:
    """Measured target verify time as a function of tree size, cached per model and machine."""

    SIZES = (1, 2, 4, 8, 16, 32, 48, 65)

    def __init__(self, sizes, seconds):
        self.sizes = np.asarray(sizes, dtype=np.float64)
        # More tokens never cost less: a noisy measurement (a 16-token verify timed faster
        # than an 8-token one) would give a negative marginal cost, and in a batch the pacer
        # would then price a plain step below zero and draft every round.
        self.seconds = np.maximum.accumulate(np.asarray(seconds, dtype=np.float64))

    def cost(self, n_tokens) -> np.ndarray:
        """Seconds to verify n tokens: interpolated, and linear past the largest size measured
        (a packed forward of batched rows carries more tokens than one tree)."""
        n = np.asarray(n_tokens, dtype=np.float64)
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.sizes[-1] - self.sizes[-2])
        past = self.seconds[-1] + max(slope, 0.0) * (n - self.sizes[-1])
        return np.where(n > self.sizes[-1], past, np.interp(n, self.sizes, self.seconds))

    def scaled(self, speed: float) -> VerifyProfile:
        """The same curve at `speed` times the seconds (the machine slower or faster now than
        when the profile was measured and cached)."""
        return VerifyProfile(self.sizes, self.seconds * speed)

    @classmethod
    def measure(
        cls, target, context: int = 256, repeats: int = 3, sizes: tuple[int, ...] = SIZES
    ) -> VerifyProfile:
        """Time chain-shaped verifies of each size after `context` cached tokens."""
        session, ids = session_at(target, context)
        secs = []
        for n in sizes:
            parents = np.arange(-1, n - 1)
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                p = Pass(ids[:n], session.cache, context, parents=parents)
                logits, taps = target.forward([p])[0]
                mx.eval(logits, taps)
                best = min(best, time.perf_counter() - t0)
                session.commit([])  # keep nothing: every cache back to the context
            secs.append(best)
        return cls(sizes, secs)

    @classmethod
    def load_or_measure(
        cls, target, key: str, sizes: tuple[int, ...] = SIZES, repeats: int = 3
    ) -> VerifyProfile:
        prof = cls.cached(key)
        # Measuring runs forwards, which all ranks of a sharded target must run together.
        if target.world.all_true(prof is not None):
            assert prof is not None
            return prof
        prof = cls.measure(target, repeats=repeats, sizes=sizes)
        write_profile(key, {"sizes": list(prof.sizes), "seconds": list(prof.seconds)})
        return prof

    @classmethod
    def cached(cls, key: str) -> VerifyProfile | None:
        """The profile cached under `key`, None where absent or damaged (measured again)."""
        return read_profile(key, lambda d: cls(d["sizes"], d["seconds"]))


# Whether speculation can pay on this machine at all: a verify of PROBE_TOKENS tokens must
# cost at most PROBE_TOKENS / MIN_IDEAL_SPEEDUP plain steps, or even drafts that were all
# accepted would win less than MIN_IDEAL_SPEEDUP over plain decoding, before any draft cost.
# On this CPU a float32 target verifies 8 tokens for ~1.3 steps (BLAS), a 4-bit one for ~7
# (MLX's CPU quantized matmul is linear in the rows); on Apple GPUs stock MLX's 4-bit 8-row
# verify costs 1.7-2.7 steps (docs/kernels.md), so speculation stays on there.
PROBE_TOKENS = 8
MIN_IDEAL_SPEEDUP = 2.0


def profile_name(target) -> str:
    """The cache name of the target's verify profile: per model and machine (paths.profile_key),
    apart for a forward padded to BLAS's cheaper row counts (models/padding.py), and apart for
    each choice of verify kernel paths (models/quantized.py)."""
    return profile_key(target) + target.forward_paths


def verify_steps(target) -> float:
    """What a verify of PROBE_TOKENS tokens costs in plain steps on this machine: from the
    cached verify profile, else a quick probe (two sizes, cached too)."""
    target = target.unbatched
    name = profile_name(target)
    prof = VerifyProfile.cached(name)
    if not target.world.all_true(prof is not None):
        prof = VerifyProfile.load_or_measure(
            target, name + "-probe", sizes=(1, PROBE_TOKENS), repeats=2
        )
    assert prof is not None
    return float(prof.cost(PROBE_TOKENS) / max(float(prof.cost(1)), 1e-9))


def speculation_pays(target) -> bool:
    """Whether drafting can beat plain decoding on this target and machine (measured)."""
    return PROBE_TOKENS / verify_steps(target) >= MIN_IDEAL_SPEEDUP


class MarginalProfile:
    """Batched rounds (engine/batch.py): what n more tokens add to a packed forward that
    already carries `others` tokens of other rows. That, not a forward of its own, is what a
    row's tree costs there, and what its plain step saves."""

    def __init__(self, profile: VerifyProfile, others: float):
        self.profile, self.others = profile, float(others)
        self.base = profile.cost(self.others)
        # At least half the profile's mean cost per token: where the measured curve is flat
        # between two sizes, a token would otherwise cost nothing (and a plain step's rate
        # be infinite, or its time zero). A profile flat from end to end (a tiny model whose
        # 1-token verify was timed slowest) still prices a token at 5% of its largest
        # verify's share per token.
        span = max(profile.sizes[-1] - profile.sizes[0], 1.0)
        spread = 0.5 * (profile.seconds[-1] - profile.seconds[0]) / span
        self.floor = max(spread, 0.05 * profile.seconds[-1] / profile.sizes[-1])

    def cost(self, n_tokens) -> np.ndarray:
        n = np.asarray(n_tokens, dtype=np.float64)
        return np.maximum(self.profile.cost(self.others + n) - self.base, self.floor * n)


def choose_budget(
    tree: Tree, profile: VerifyProfile | MarginalProfile, overhead: float, calibration: float = 1.0
) -> int:
    """The budget that maximises expected tokens per second for this round.

    `calibration` scales the drafter's expected extra tokens by how many it has really been
    getting (`AutoBudget.calibration`): a drafter that is overconfident away from its training
    data would otherwise buy trees whose deep nodes never land.
    """
    b = np.arange(len(tree.tokens))
    gain = expected_tokens(tree, calibration)
    rate = gain / (overhead + profile.cost(b + 1))
    return int(np.argmax(rate))


def split_budget(
    gains: list[np.ndarray],
    base_tokens: float,
    base_gain: float,
    overhead: float,
    profile: VerifyProfile,
) -> list[int]:
    """One verify budget for a batch's round, split across its rows' trees (engine/batch.py).

    `gains[r]` holds row r's expected extra tokens per node in best-first order; the forward
    also carries `base_tokens` of other passes (plain steps, prefill chunks, DFlash blocks)
    that emit about `base_gain` tokens. Every tree's root is verified anyway (it yields the
    row's next token), so the choice is which nodes to add: the batch's best N nodes by
    expected gain, whichever row they belong to, with N the size that maximises the whole
    forward's expected tokens per second. A row whose drafter is confident gets the nodes; a
    row whose draft is unlikely to land gets none and takes a plain step.
    """
    if not gains:
        return []
    # A row's nodes are taken as a prefix (a tree cut anywhere else would orphan children):
    # sorting on the running minimum keeps each row in order even where its gains rise.
    keys = np.concatenate([np.minimum.accumulate(g) for g in gains])
    rows = np.concatenate([np.full(len(g), r) for r, g in enumerate(gains)]).astype(np.int64)
    order = np.argsort(-keys, kind="stable")
    total = np.concatenate([[0.0], np.cumsum(np.concatenate(gains)[order])])
    roots = len(gains)
    n = np.arange(len(total))
    rate = (base_gain + roots + total) / (overhead + profile.cost(base_tokens + roots + n))
    best = int(np.argmax(rate))
    return np.bincount(rows[order[:best]], minlength=roots).tolist()


class Pacer:
    """`--budget auto`: draft only while drafting pays.

    Tree rounds and plain decoding steps each keep a running (tokens, seconds). When tree
    rounds fall behind plain steps, the next `wait` rounds are plain steps (which still feed
    the drafter its context, so it can resume at any round), then one tree round probes
    again; `wait` doubles while drafting keeps losing, up to MAX_WAIT, and halves when it
    wins. On text the drafter cannot predict, that bounds the loss to one probe in
    MAX_WAIT + 1 rounds instead of paying for a draft every round.

    One round's accepted length is noisy (on GSM8K a drafter with tau 1.6 accepts nothing in
    about half its rounds), so rounds drafted back to back average over ~4 rounds (ALPHA);
    only a probe after a pause weighs half (PROBE_ALPHA), so that it can turn the decision
    by itself. With 0.5 for every round, the SmolLM2 drafter paused in 60% of GSM8K rounds
    and lost to a fixed budget of 2.
    """

    ALPHA = 0.25
    PROBE_ALPHA = 0.5
    MAX_WAIT = 32

    def __init__(self, plain_seconds: float):
        self.tree: tuple[float, float] | None = None
        self.plain = (1.0, float(plain_seconds))
        self.wait = 0
        self.backoff = 1
        self.probing = False  # the next tree round follows a pause
        self.heard_plain = False  # `plain` is still the profile's estimate, not a measurement

    def draft_now(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            self.probing = True
            return False
        return True

    @staticmethod
    def _ema(old, tokens: float, seconds: float, a: float):
        if old is None:
            return (tokens, seconds)
        return (smooth(old[0], tokens, a), smooth(old[1], seconds, a))

    def record_plain(self, seconds: float, tokens: int = 1, size: int = 1) -> None:
        """A round without the drafter that emitted `tokens` from a verify of `size`: a plain
        step, or a round of lookup branches or a grammar's certain run; drafting must beat
        these to go on."""
        # A plain step always yields one token: its time is not noisy enough to need ALPHA.
        # A verify of more (lookup) is noisy like a tree round, whatever it accepted this time.
        a = self.PROBE_ALPHA if size == 1 else self.ALPHA
        self.plain = self._ema(self.plain, float(tokens), seconds, a)
        self.heard_plain = True

    def record_tree(self, tokens: int, seconds: float) -> None:
        a = self.PROBE_ALPHA if self.probing else self.ALPHA
        self.probing = False
        self.tree = self._ema(self.tree, tokens, seconds, a)
        # Rates compared cross-multiplied: a plain step timed at zero seconds must not raise.
        if self.tree[0] * self.plain[1] < self.plain[0] * self.tree[1]:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_WAIT)
        else:
            # Halved, not reset: one lucky probe on hard text must not restart every-round
            # drafting; a run of wins brings it down to 1 within a few rounds.
            self.backoff = max(1, self.backoff // 2)


class FixedBudget:
    """`--budget N`: every round drafts, and the heap alone stops the tree at N nodes."""

    prices_lookup = False  # cut_lookup keeps every branch: loose ones (echo) are not offered

    def __init__(self, budget: int):
        self.max_budget = budget

    def draft_now(self) -> bool:
        return True

    def cut(self, tree: Tree) -> Tree:
        return tree

    def cut_lookup(self, tree: Tree, chains: list[list[int]], lookup_stats, drafted: bool):
        return chains

    def lookup_suffices(self, root: Tree, chains: list[list[int]], lookup_stats) -> bool:
        return False

    def record_plain(self, seconds: float, tokens: int = 1, size: int = 1) -> None:
        pass

    def record_tree(self, *round_facts: object, **named: object) -> None:
        """Nothing to learn: a fixed budget never changes."""


class AutoBudget:
    """`--budget auto`: each round's budget from the measured verify profile and the running
    estimates it keeps between rounds; its `Pacer` pauses drafting while drafting loses."""

    prices_lookup = True  # cut_lookup weighs each source's branches by its own acceptance

    max_budget = AUTO_MAX_BUDGET
    batch = None  # a batched target's Batcher: its rounds then pay marginal costs

    def __init__(self, profile: VerifyProfile):
        self.profile = profile
        self.pacer = Pacer(float(profile.cost(1)))
        self.overhead = 0.0  # a round's seconds beyond the verify (draft, bookkeeping)
        self.expected = self.realised = 0.0
        self.tree_rounds = 0
        # Per round that ran the drafter: its pass's seconds and the nodes it added (running
        # means), and how many such rounds the running means have seen.
        self.t_draft = self.drafter_nodes = 0.0
        self.drafted_rounds = 0
        self.speed = 1.0
        self.timed_verifies = 0

    @classmethod
    def for_target(cls, target) -> AutoBudget:
        """With the target's verify profile, measured once per model and machine and cached
        (on the target itself when it is batched: alone, not inside someone's batch)."""
        batch, target = target.batcher, target.unbatched
        policy = cls(VerifyProfile.load_or_measure(target, profile_name(target)))
        policy.batch = batch
        return policy

    def costs(self) -> VerifyProfile | MarginalProfile:
        """Verify cost by size: a forward of its own, or a share of the next packed one."""
        if self.batch is None:
            return self.profile if self.speed == 1.0 else self.profile.scaled(self.speed)
        if self.batch.others_tokens() <= 0:
            return self.profile
        return MarginalProfile(self.profile, self.batch.others_tokens())

    def _time_verify(self, size: int, seconds: float) -> None:
        """A verify of `size` tokens took `seconds`: update `speed`. The profile is cached per
        model and machine, but the machine's speed drifts (another process, a cooler or hotter
        CPU): the 0.5B coder's cached profile priced a plain step at 0.27 s where steps took
        0.2 s. Until the pacer has timed a plain step of its own, its estimate of one follows
        too; priced 35% too dear, it would let drafting that loses run without a pause."""
        ratio = float(np.clip(seconds / float(self.profile.cost(size)), 0.25, 4.0))
        first = self.timed_verifies == 0
        self.speed = smooth(self.speed, ratio, COST_WEIGHT, first)
        self.timed_verifies += 1
        if not self.pacer.heard_plain:
            self.pacer.plain = (1.0, self.speed * float(self.profile.cost(1)))

    @property
    def calibration(self) -> float:
        """Accepted / predicted extra tokens so far (1 until there is evidence), in [0.1, 2].

        Both running means start at 0 and decay alike, so their ratio needs no warm-up
        correction; a few rounds keep one lucky round from deciding it.
        """
        if self.tree_rounds < 4 or self.expected <= 1e-6:
            return 1.0
        return float(np.clip(self.realised / self.expected, 0.1, 2.0))

    def draft_now(self) -> bool:
        return self.pacer.draft_now()

    def cut(self, tree: Tree) -> Tree:
        """The tree's first b+1 nodes, b the budget that maximises expected tokens per second:
        its own, or in a batch its share of the round's one budget (`split_budget`)."""
        b = self.batch.allot(self, tree) if self.batch is not None else None
        if b is None:
            b = choose_budget(tree, self.costs(), self.overhead, self.calibration)
        return tree.prefix(b + 1)

    def gains(self, tree: Tree) -> np.ndarray:
        """Expected extra tokens of each node after the root, at the calibrated confidence."""
        return np.diff(expected_tokens(tree, self.calibration))

    def cut_lookup(self, tree: Tree, chains: list[list[int]], lookup_stats, drafted: bool):
        """Lookup branches cut to the length that maximises expected tokens per second at the
        measured lookup acceptance (`lookup_stats`); none when they do not pay."""
        if not chains:
            return chains
        # The drafter's nodes at its calibrated confidence, grammar drafts as certain.
        base = expected_tokens(tree, self.calibration if drafted else 1.0)[-1]
        sizes = graft_sizes(tree, chains)  # the grafted tree's size at each cut length
        gains = base + np.asarray(lookup_stats.expected_each(len(sizes) - 1))
        rates = gains / (self.overhead + self.costs().cost(sizes))
        best = int(np.argmax(rates))  # the shortest of the best (0: none pays)
        return [c[:best] for c in chains] if best else []

    def lookup_suffices(self, root: Tree, chains: list[list[int]], lookup_stats) -> bool:
        """Whether this round's lookup branches (as `cut_lookup` cut them for a round without
        the drafter) alone beat them joined by a drafter pass.

        The drafter adds its pass and its nodes to the verify, and earns its measured extra
        tokens only where the lookup branch fails at once (probability 1 - r): on text that
        repeats, a confident branch makes the pass a waste (copy edits on the 0.5B coder:
        lookup alone 2.24x mlx-lm, with the drafter beside it every round 1.90x).
        """
        if self.drafted_rounds < 4 or self.batch is not None or not chains:
            return False
        size = len(graft(root, chains).tokens)
        got = 1.0 + lookup_stats.expected(max(len(c) for c in chains))
        # `realised` is a running mean started at 0: unbias it by the rounds it has seen.
        drafter = self.realised / (1.0 - 0.9**self.drafted_rounds)
        costs, t_other = self.costs(), max(self.overhead - self.t_draft, 0.0)
        alone = got / (t_other + float(costs.cost(size)))
        joined = (got + (1.0 - lookup_stats.rate) * drafter) / (
            self.overhead + float(costs.cost(size + self.drafter_nodes))
        )
        return alone >= joined

    def record_plain(self, seconds: float, tokens: int = 1, size: int = 1) -> None:
        if self.batch is not None:  # its wall time is the whole batch's: count its share
            seconds = float(self.costs().cost(size))
        self.pacer.record_plain(seconds, tokens, size)

    def record_tree(
        self,
        tree: Tree,
        n_drafted: int,
        path: list[int],
        emitted: int,
        overhead: float,
        t: float,
        t_draft: float = 0.0,
    ) -> None:
        """A tree round: its first `n_drafted` nodes were the drafter's (0: lookup only), it
        accepted `path`, emitted `emitted` tokens, spent `overhead` outside the verify (of it
        `t_draft` in the drafter's pass) and `t` in all."""
        self.overhead = smooth(self.overhead, overhead, COST_WEIGHT, first=not self.overhead)
        if n_drafted:
            first = self.drafted_rounds == 0
            self.t_draft = smooth(self.t_draft, t_draft, COST_WEIGHT, first)
            nodes = float(n_drafted - 1)
            self.drafter_nodes = smooth(self.drafter_nodes, nodes, COST_WEIGHT, first)
            self.drafted_rounds += 1
            # The drafter's confidence against its acceptance; grammar drafts are neither.
            certain = tree.is_certain()
            drafter = ~certain[1:n_drafted]
            predicted = float(np.exp(tree.log_probs[1:n_drafted])[drafter].sum())
            self.expected = smooth(self.expected, predicted, ACCEPT_WEIGHT)
            realised = sum(i < n_drafted and not certain[i] for i in path[1:])
            self.realised = smooth(self.realised, realised, ACCEPT_WEIGHT)
        self.tree_rounds += 1
        if self.batch is not None:  # the verify's share of the packed forward, not its wall
            costs = self.costs()
            t = overhead + float(costs.cost(len(tree.tokens)))
            # And the plain step it is weighed against is a token's share too, now: not the
            # forward of its own the pacer starts from, which made every tree round look like
            # a win in a batch (so no plain step ever came to correct it, and rows drafted
            # every round at tau ~1 while plain rows ran 1.4x faster).
            self.pacer.plain = (1.0, float(costs.cost(1)))
        else:
            self._time_verify(len(tree.tokens), t - overhead)
        self.pacer.record_tree(emitted, t)


def budget_policy(target, budget: int | str) -> FixedBudget | AutoBudget:
    """The policy for `--budget` (a node count, or "auto")."""
    if budget == "auto":
        return AutoBudget.for_target(target)
    return FixedBudget(int(budget))
