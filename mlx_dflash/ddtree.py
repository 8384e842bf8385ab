"""DDTree: a draft tree from one drafter pass, verified in one target pass (algorithm.md §4).

The drafter's per-slot distributions are treated as independent; the best tree of B nodes under
that factorised distribution is the set of the B most probable prefixes, which a best-first
heap over (depth, rank) produces in non-increasing probability. Because the B-node tree is the
first B pops of any larger run, one heap run also gives the expected acceptance of every
smaller budget, which is what `--budget auto` trades against measured verify cost.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import DFlashError
from .sampling import draw, token_probs

AUTO_MAX_BUDGET = 64


@dataclass
class Tree:
    """Nodes in creation order; index 0 is the root (the last verified token)."""

    tokens: np.ndarray  # (T,) int
    parents: np.ndarray  # (T,) int, parents[0] = -1
    depths: np.ndarray  # (T,) int, root 0
    log_probs: np.ndarray  # (T,) path log-probability under the drafter, root 0

    def children(self) -> list[dict[int, int]]:
        """Per node: token -> child index (siblings carry distinct tokens)."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]][int(self.tokens[i])] = i
        return kids


def top_candidates(
    logits: mx.array, k: int, on_host: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per depth, the k most likely tokens and their log-probabilities, best first.

    Only the k winners and each row's log-normaliser are needed, never the full log-softmax.
    `on_host` (default: when MLX has no Metal device) computes them in numpy: MLX's CPU backend
    evaluates exp about 13x slower than numpy, and this runs every round over the whole
    vocabulary (15 x 49K rows: 16 ms in MLX, 1.2 ms in numpy on a 2-core x86).
    """
    if on_host is None:
        on_host = not mx.metal.is_available()
    k = min(k, logits.shape[-1])
    if on_host:
        x = np.array(logits.astype(mx.float32))
        top = x.max(axis=-1, keepdims=True)
        lse = top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
        idx = np.argpartition(-x, k - 1, axis=-1)[:, :k] if k < x.shape[-1] else None
        if idx is None:
            idx = np.broadcast_to(np.arange(x.shape[-1]), x.shape)
        vals = np.take_along_axis(x, idx, axis=-1) - lse
        order = np.argsort(-vals, axis=-1, kind="stable")
        return np.take_along_axis(idx, order, axis=-1), np.take_along_axis(
            vals, order, axis=-1
        ).astype(np.float64)
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    idx = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k] if k < logits.shape[-1] else None
    if idx is None:
        idx = mx.broadcast_to(mx.arange(logits.shape[-1]), logits.shape)
    vals = mx.take_along_axis(logits, idx, axis=-1) - lse
    order = mx.argsort(-vals, axis=-1)
    return np.array(mx.take_along_axis(idx, order, axis=-1)), np.array(
        mx.take_along_axis(vals, order, axis=-1), dtype=np.float64
    )


def build_tree(root: int, tokens: np.ndarray, lp: np.ndarray, budget: int) -> Tree:
    """Best-first heap over ranks: the `budget` most probable prefixes, parents first.

    tokens/lp: (depth, K) candidate tokens and log-probs per depth, sorted best first.
    """
    depth_max, k = lp.shape
    out_tok, out_par, out_dep, out_lp = [root], [-1], [0], [0.0]
    heap = [(-lp[0, 0], 0, 0, 0)] if depth_max and budget > 0 else []  # (-score, d, r, parent)
    while heap and len(out_tok) <= budget:
        neg, d, r, parent = heapq.heappop(heap)
        node = len(out_tok)
        out_tok.append(int(tokens[d, r]))
        out_par.append(parent)
        out_dep.append(d + 1)
        out_lp.append(-neg)
        if r + 1 < k:
            heapq.heappush(heap, (neg + lp[d, r] - lp[d, r + 1], d, r + 1, parent))
        if d + 1 < depth_max:
            heapq.heappush(heap, (neg - lp[d + 1, 0], d + 1, 0, node))
    return Tree(
        np.array(out_tok, dtype=np.int64),
        np.array(out_par, dtype=np.int64),
        np.array(out_dep, dtype=np.int64),
        np.array(out_lp, dtype=np.float64),
    )


def expected_tokens(tree: Tree) -> np.ndarray:
    """E[tokens emitted] for budgets 0..len-1 under the drafter: 1 + sum of path probabilities."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.exp(tree.log_probs[1:]))])


def walk(tree: Tree, logits: mx.array, sampling, rng) -> tuple[list[int], int]:
    """Follow the target through the tree; return (accepted node path incl. root, bonus token).

    Greedy follows the argmax. Sampling draws one token from the target at each visited node
    and moves to the child holding it: every emitted token is a target sample (lossless).
    """
    kids = tree.children()
    path = [0]
    if sampling.greedy:
        choice = np.array(mx.argmax(logits, axis=-1))
        while True:
            nxt = kids[path[-1]].get(int(choice[path[-1]]))
            if nxt is None:
                return path, int(choice[path[-1]])
            path.append(nxt)
    while True:
        cur = path[-1]
        # Transform only the rows the walk visits.
        x = draw(token_probs(logits[cur : cur + 1], sampling)[0], rng)
        nxt = kids[cur].get(x)
        if nxt is None:
            return path, x
        path.append(nxt)


class VerifyProfile:
    """Measured target verify time as a function of tree size, cached per model and machine."""

    SIZES = (1, 2, 4, 8, 16, 32, 48, 65)

    def __init__(self, sizes, seconds):
        self.sizes = np.asarray(sizes, dtype=np.float64)
        self.seconds = np.asarray(seconds, dtype=np.float64)

    def cost(self, n_tokens) -> np.ndarray:
        return np.interp(n_tokens, self.sizes, self.seconds)

    @classmethod
    def measure(cls, target, context: int = 256, repeats: int = 3) -> VerifyProfile:
        """Time chain-shaped verifies of each size after `context` cached tokens."""
        cache = target.make_cache()
        ids = mx.array(np.arange(context) % max(2, target.vocab_size - 1), dtype=mx.int32)
        target.forward(ids, cache, 0, logits="last", taps=False, rewindable=False)
        mx.eval([c.state_arrays for c in cache])
        for c in cache:
            c.snapshot()  # recurrent layers (hybrid targets) rewind to here after each verify
        secs = []
        for n in cls.SIZES:
            parents = np.arange(-1, n - 1)
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                logits, taps = target.forward(ids[:n], cache, context, parents=parents)
                mx.eval(logits, taps)
                best = min(best, time.perf_counter() - t0)
                for c in cache:
                    c.trim(context)
            secs.append(best)
        return cls(cls.SIZES, secs)

    @classmethod
    def load_or_measure(cls, target, key: str) -> VerifyProfile:
        root = Path(os.environ.get("DFLASH_MLX_CACHE", Path.home() / ".cache" / "dflash-mlx"))
        path = root / "profiles" / f"{key}.json"
        if path.exists():
            try:
                d = json.loads(path.read_text())
                return cls(d["sizes"], d["seconds"])
            except (ValueError, KeyError):
                pass  # a damaged profile is simply measured again
        prof = cls.measure(target)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"sizes": list(prof.sizes), "seconds": list(prof.seconds)}))
        except OSError:
            pass
        return prof


def profile_key(target) -> str:
    device = "gpu" if mx.metal.is_available() else "cpu"
    ident = json.dumps(target.config, sort_keys=True, default=str)
    h = hashlib.sha1(ident.encode()).hexdigest()[:12]
    return f"{target.model_type}-{h}-{platform.machine()}-{device}"


def choose_budget(
    tree: Tree, profile: VerifyProfile, t_fixed: float, calibration: float = 1.0
) -> int:
    """The budget that maximises expected tokens per second for this round.

    `calibration` scales the drafter's expected extra tokens by how many it has really been
    getting (see `DDTree`): a drafter that is overconfident away from its training data would
    otherwise buy trees whose deep nodes never land.
    """
    b = np.arange(len(tree.tokens))
    gain = 1.0 + calibration * (expected_tokens(tree) - 1.0)
    rate = gain / (t_fixed + profile.cost(b + 1))
    return int(np.argmax(rate))


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
        return ((1 - a) * old[0] + a * tokens, (1 - a) * old[1] + a * seconds)

    def record_plain(self, seconds: float) -> None:
        # A plain step always yields one token: its time is not noisy enough to need ALPHA.
        self.plain = self._ema(self.plain, 1.0, seconds, self.PROBE_ALPHA)

    def record_tree(self, tokens: int, seconds: float) -> None:
        a = self.PROBE_ALPHA if self.probing else self.ALPHA
        self.probing = False
        self.tree = self._ema(self.tree, tokens, seconds, a)
        if self.tree[0] / self.tree[1] < self.plain[0] / self.plain[1]:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_WAIT)
        else:
            # Halved, not reset: one lucky probe on hard text must not restart every-round
            # drafting; a run of wins brings it down to 1 within a few rounds.
            self.backoff = max(1, self.backoff // 2)


class DDTree:
    """Round logic for `--mode ddtree`; holds the auto-budget profile between rounds."""

    def __init__(self, session, cfg):
        self.session = session
        self.sampling = cfg.sampling
        self.budget = cfg.budget
        self.branching = getattr(cfg, "branching", None)
        if self.budget != "auto" and (not isinstance(self.budget, int) or self.budget < 1):
            raise DFlashError(
                f"The DDTree budget must be a positive integer or 'auto', not {self.budget}."
            )
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

    def round(self, last: int, n: int, rng):
        from .engine import Round, plain_round

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
