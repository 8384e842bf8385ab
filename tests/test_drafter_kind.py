"""A drafter kind is one file: this one, a toy bigram proposer written against the engine's
contract alone (engine/contract.py: a Drafter whose passes return a Proposal of a kind of its
own), runs DFlash chains, DDTree trees (fixed and auto budgets, with lookup) and a grammar's
constrained trees, token for token the target's own greedy text. No engine module knows it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash import load_pair
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.grammar import GrammarSpec, prune_tree, with_certain_run
from mlx_dflash.engine.tree import Tree, graft, root_only

PROMPT = "Once upon a time, there was a little girl named Lily. She"


class PathDrafts:
    """The proposal kind: one path of tokens, drafted with certainty (q one-hot)."""

    def __init__(self, tokens: list[int], vocab_size: int):
        self.tokens, self.vocab_size = tokens, vocab_size

    @property
    def logits(self) -> mx.array:
        one_hot = np.full((len(self.tokens), self.vocab_size), -1e4, dtype=np.float32)
        one_hot[np.arange(len(self.tokens)), self.tokens] = 0.0
        return mx.array(one_hot)

    def chain(self, sampling, key):
        drafts = mx.array(self.tokens, dtype=mx.int32)
        return drafts, None if key is None else mx.softmax(self.logits, axis=-1)

    def queue(self, budget, branching, temperature, constrained):
        """Nothing to compute on the device: the path is known."""

    def tree(self, root: int, budget: int, branching: int | None, temperature: float) -> Tree:
        return graft(root_only(root), [self.tokens[:budget]], log_prob=-0.5)

    def constrained_tree(self, root, budget, branching, temperature, grammar, tokens_left, cut):
        tree, pruned = prune_tree(self.tree(root, budget, branching, temperature), grammar)
        return with_certain_run(cut(tree), grammar, min(tokens_left, budget)), pruned


class BigramDrafter:
    """Proposes, from the last token on, what followed each token the last time it was
    decided; learns the decided text from what each round kept (its taps' row count)."""

    block_size = 8
    corpus_file = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.context_len = 0
        self.follows: dict[int, int] = {}
        self.asked: list[int] = []  # this round's last token and drafts
        self.tail: int | None = None  # the newest token it knows was decided

    def reset(self, length: int = 0) -> None:
        self.context_len = min(self.context_len, length)
        self.asked, self.tail = [], None

    def add_context(self, taps: mx.array) -> None:
        kept = self.asked[: int(taps.shape[0])]
        for a, b in zip(kept, kept[1:], strict=False):
            self.follows[a] = b
        self.tail = kept[-1] if kept else None
        self.asked = []
        self.context_len += int(taps.shape[0])

    def propose(self, last_token: int, start: int, n: int) -> PathDrafts:
        if self.tail is not None:
            self.follows[self.tail] = last_token
        path, t = [], last_token
        while len(path) < n and t in self.follows:
            t = self.follows[t]
            path.append(t)
        self.asked = [last_token, *path]
        return PathDrafts(path + [last_token] * (n - len(path)), self.vocab_size)

    def propose_together(self, asks):
        return [a.drafter.propose(a.last_token, a.start, a.n) for a in asks]


@pytest.fixture(scope="module")
def target():
    target, _ = load_pair(None, None)
    return target


def greedy(target, ids, n):
    out = []
    for r in generate_rounds(Session(target), ids, GenerationConfig(max_tokens=n, mode="ar")):
        out += r.tokens
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {"mode": "dflash"},
        {"mode": "ddtree", "budget": 6},
        {"mode": "ddtree", "budget": "auto"},
        {"mode": "ddtree", "budget": "auto", "lookup": 10},
        {"mode": "dflash", "grammar": GrammarSpec("regex", r"( [A-Za-z]+[.,]?){40}")},
    ],
    ids=["chain", "tree", "auto", "auto+lookup", "grammar"],
)
def test_a_drafter_kind_of_its_own_is_exact(target, settings):
    ids = target.tokenizer.encode(PROMPT)
    n = 48
    drafter = BigramDrafter(target.vocab_size)
    cfg = GenerationConfig(max_tokens=n, **settings)
    rounds = list(generate_rounds(Session(target, drafter), ids, cfg))
    out = [t for r in rounds for t in r.tokens]
    if "grammar" in settings:  # the grammar's own text: the ar round under the same grammar
        ar = GenerationConfig(max_tokens=n, mode="ar", grammar=settings["grammar"])
        want = [t for r in generate_rounds(Session(target), ids, ar) for t in r.tokens]
    else:
        want = greedy(target, ids, n)
    assert out == want
    if settings.get("budget") != "auto":  # (auto may find that its drafts do not pay here)
        assert max(r.accepted for r in rounds) > 1, "no draft of the toy kind was accepted"
