"""The speculative decoding loop: draft, verify, walk, commit (docs/dflash.md, docs/ddtree.md).

State between rounds is small: the target's KV cache holds every position < `start`, the
drafter's cache holds the same positions' context, and `last` is the newest decided token
(not yet run through the target). A round drafts a block (DFlash) or a tree (DDTree) after
`last`, verifies it in one target forward, emits the accepted tokens plus one bonus token
from the target, and commits both caches to the accepted path (Session.commit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from .budget import budget_policy, speculation_pays
from .ddtree import DDTree
from .device import compute, wired
from .grammar import Grammar, compile_grammar
from .rounds import PipelinedSteps, _pick, block_round, plain_round, prefill, token_logprobs
from .session import GenerationConfig, Round, Session

# (last token, drafts allowed this round, rng, tokens max_tokens still allows) -> Round
RoundFn = Callable[[int, int, np.random.Generator, int], Round]


def round_function(
    session: Session, cfg: GenerationConfig, grammar: Grammar | None = None, block: int = 16
) -> RoundFn:
    """The one place a generation's kind of round is chosen, from cfg.round_kind.

    A DFlash chain is a block round (drafts and acceptance on the device, one sync) unless
    something must see its drafts on the host first: `--budget auto`, which sizes each chain
    from the drafter's confidence and the measured verify cost, or a grammar (the best
    allowed draft at each depth, with its certain runs). Then it is a tree round with one
    child per node, so every speculative mode shares one sizing and one constrained walk.
    Where no draft can pay on this machine (budget.speculation_pays: a quantized target on
    the CPU), `--budget auto` decodes plainly."""
    kind, sampling = cfg.round_kind, cfg.sampling
    if kind != "plain" and cfg.budget == "auto" and not speculation_pays(session.target):
        kind = "plain"

    def plain(last: int, n: int, rng: np.random.Generator, tokens_left: int) -> Round:
        return plain_round(session, last, sampling, rng, logprobs=cfg.logprobs, grammar=grammar)

    if kind == "plain":
        return PipelinedSteps(session) if pipelines(session, cfg, grammar) else plain
    spec: RoundFn
    if kind == "tree":
        spec = DDTree(session, cfg, budget_policy(session.target, cfg.budget or "auto"), grammar)
    elif grammar is not None or cfg.budget == "auto":
        budget = "auto" if cfg.budget == "auto" else block - 1
        spec = DDTree(session, cfg, budget_policy(session.target, budget), grammar, branching=1)
    else:
        spec = lambda last, n, rng, tokens_left: block_round(  # noqa: E731
            session, last, n, sampling, rng, cfg.profile, cfg.logprobs
        )
    # Where max_tokens allows no draft, the last token is a plain step.
    return lambda last, n, rng, tokens_left: (plain if tokens_left == 0 else spec)(
        last, n, rng, tokens_left
    )


def pipelines(session: Session, cfg: GenerationConfig, grammar: Grammar | None) -> bool:
    """Whether plain decoding keeps a step in flight (rounds.PipelinedSteps): greedy, with no
    host work between tokens (a grammar's mask, logprobs, profiling) and a target that runs
    its forwards alone (not a batch row waiting for others, nor ranks agreeing each token)."""
    quiet = grammar is None and cfg.logprobs is None and not cfg.profile
    return cfg.sampling.greedy and quiet and session.target.runs_alone


def start_grammar(session: Session, cfg: GenerationConfig) -> Grammar | None:
    """This generation's grammar matcher (None: free text); a bad grammar stops here, before
    any model work."""
    if cfg.grammar is None:
        return None
    target = session.target
    return compile_grammar(cfg.grammar, target.tokenizer, target.vocab_size, cfg.stop_ids)


def generate_rounds(session: Session, prompt: list[int], cfg: GenerationConfig) -> Iterator[Round]:
    """Yield one Round per decoding step; the tokens across rounds are the output."""
    if not prompt:
        raise DFlashError("The prompt is empty.")
    if cfg.uses_drafter and session.drafter is None:
        raise DFlashError(f"Mode '{cfg.mode}' needs a drafter.")
    bs = _block_size(session, cfg)
    grammar = start_grammar(session, cfg)
    rng = np.random.default_rng(cfg.seed)
    if cfg.seed is not None:
        mx.random.seed(cfg.seed)
    with wired(session.target.model):
        with compute():
            logits, first = prefill(session, prompt, cfg)
        if cfg.max_tokens <= 0:
            first.finished = "length"
            yield first
            return
        t0 = time.perf_counter()
        mask = grammar.mask() if grammar is not None else None
        last = session.agree([_pick(logits, cfg.sampling, rng, grammar, mask)])[0]
        masks = [mask] if mask is not None and cfg.logprobs is not None else None
        if grammar is not None:
            grammar.accept([last])
            first.t_grammar = grammar.seconds
        first.tokens, first.accepted, first.t_other = [last], 1, time.perf_counter() - t0
        if cfg.logprobs is not None:
            first.logprobs = token_logprobs(logits, [0], [last], cfg.logprobs, masks)
        emitted = _finish(first, 0, cfg)
        yield first
        if first.finished:
            return
        next_round = round_function(session, cfg, grammar, bs)
        while True:
            # drafts allowed: never verify past max_tokens
            tokens_left = cfg.max_tokens - emitted - 1
            g0 = grammar.seconds if grammar is not None else 0.0
            with compute():
                rnd = next_round(last, min(bs - 1, tokens_left), rng, tokens_left)
            if grammar is not None:
                rnd.t_grammar = grammar.seconds - g0
            emitted = _finish(rnd, emitted, cfg)
            last = rnd.tokens[-1]
            yield rnd
            if rnd.finished:
                return


def _finish(rnd: Round, emitted: int, cfg: GenerationConfig) -> int:
    """End the round at its first stop token, or mark it the last when max_tokens is reached;
    return the tokens emitted so far, this round's included."""
    for i, t in enumerate(rnd.tokens):
        if t in cfg.stop_ids:
            rnd.tokens = rnd.tokens[: i + 1]
            rnd.finished = "stop"
            break
    emitted += len(rnd.tokens)
    if rnd.finished is None and emitted >= cfg.max_tokens:
        rnd.finished = "length"
    return emitted


def _block_size(session: Session, cfg: GenerationConfig) -> int:
    """Slots a round may draft, plus one: --block-size (the drafter's block by default), and
    for a dflash chain of a fixed --budget N at most N + 1."""
    if session.drafter is None or not cfg.uses_drafter:
        return 1
    native = session.drafter.block_size
    bs = native if cfg.block_size is None else cfg.block_size
    if bs < 2 or bs > native:
        raise DFlashError(f"Block size must be between 2 and the drafter's {native}, not {bs}.")
    if cfg.round_kind == "block" and isinstance(cfg.budget, int):
        bs = min(bs, cfg.budget + 1)
    return bs
