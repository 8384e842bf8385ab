"""`--budget auto` (docs/auto-budget.md): each round's tree size from measured verify cost and
the drafter's calibrated confidence, and a pacer that pauses drafting while it loses to plain
decoding steps."""

from __future__ import annotations

import hashlib
import json
import platform
import time

import mlx.core as mx
import numpy as np

from ..paths import cache_root
from .tree import Tree, expected_tokens

AUTO_MAX_BUDGET = 64


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
        logits, _ = target.forward(ids, cache, 0, logits="last", taps=False, rewindable=False)
        # The logits too: on a pipeline stage they are what carries the send to the next rank.
        mx.eval(logits, [c.state_arrays for c in cache])
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
        path = cache_root() / "profiles" / f"{key}.json"
        world = getattr(target, "world", None)
        prof = cls._load(path)
        found = prof is not None
        if world is not None:  # measuring runs forwards, which all ranks must run together
            found = world.all_true(found)
        if found:
            return prof
        prof = cls.measure(target)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"sizes": list(prof.sizes), "seconds": list(prof.seconds)}))
        except OSError:
            pass
        return prof

    @classmethod
    def _load(cls, path):
        if path.exists():
            try:
                d = json.loads(path.read_text())
                return cls(d["sizes"], d["seconds"])
            except (ValueError, KeyError):
                pass  # a damaged profile is simply measured again
        return None


def profile_key(target) -> str:
    device = "gpu" if mx.metal.is_available() else "cpu"
    ident = json.dumps(target.config, sort_keys=True, default=str)
    h = hashlib.sha1(ident.encode()).hexdigest()[:12]
    world = getattr(target, "world", None)
    shards = f"-tp{world.size}" if world is not None else ""
    return f"{target.model_type}-{h}-{platform.machine()}-{device}{shards}"


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
