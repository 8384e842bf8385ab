"""What a generation is asked to do (GenerationConfig), what each round produced (Round), and
the state that outlives a call (Session): the target's and drafter's caches and the tokens
they hold. docs/dflash.md has the conventions (slot 0, positions, cache commit)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..errors import DFlashError
from .contract import Drafter, TargetModel, in_place
from .corpus import AnswerCorpus
from .grammar import GrammarSpec
from .sampling import SamplingParams

if TYPE_CHECKING:
    from ..models.cache import KVQuantization

MODES = ("dflash", "ddtree", "lookup", "ar")
DEFAULT_LOOKUP = 10  # tokens per prompt-lookup branch, when --mode lookup is not told
# The kind of round each mode runs (loop.py picks the round from this, once per generation):
# "plain" one target step, "block" a DFlash block, "tree" a DDTree / prompt-lookup tree.
ROUND_KINDS = {"ar": "plain", "dflash": "block", "ddtree": "tree", "lookup": "tree"}


def uses_drafter(mode: str) -> bool:
    """Whether `mode` runs the drafter (lookup drafts from the text; ar drafts nothing)."""
    return mode in ("dflash", "ddtree")


def speculates(mode: str) -> bool:
    """Whether `mode` verifies drafted tokens (a block or a tree), not one token a step."""
    return ROUND_KINDS.get(mode, "plain") != "plain"


def parse_budget(budget: int | str) -> int | str:
    """A DDTree budget: a positive integer (or its text), or "auto"."""
    if budget == "auto":
        return "auto"
    try:
        b = int(budget)
    except (TypeError, ValueError):
        b = 0
    if b < 1 or isinstance(budget, float | bool):
        raise DFlashError(
            f"The DDTree budget (--budget) must be a positive integer or 'auto', not '{budget}'."
        )
    return b


MAX_TOP_LOGPROBS = 20


def default_lookup(mode: str, budget) -> int:
    """--lookup when it is not given: lookup branches join DDTree trees under --budget auto,
    which prices them at their measured acceptance and drops them where they do not pay (with
    them `ddtree:auto` was as fast or faster on every bench set: README "Prompt lookup joins
    auto trees by default"); none with a fixed budget."""
    return DEFAULT_LOOKUP if mode == "ddtree" and str(budget) == "auto" else 0


def default_budget(mode: str) -> int | str | None:
    """--budget when it is not given: "auto" for trees (ddtree, lookup) and plain decoding
    (where it means nothing); None for `dflash`, whose chain is then the drafter's whole block
    every round, as z-lab's loop verifies it (`--budget auto` sizes each chain instead)."""
    return None if mode == "dflash" else "auto"


@dataclass
class GenerationConfig:
    """Checked when built: a bad mode or budget is one sentence before any model work."""

    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    # The defaults are the fastest configuration measured (README "The default configuration"):
    # DDTree trees sized by --budget auto, with prompt-lookup branches and the drafter's corpus.
    mode: str = "ddtree"
    block_size: int | None = None  # None: the drafter's
    # Nodes verified after the root: a DDTree budget, a dflash chain's drafts, or "auto" (sized
    # each round from the measured verify cost); None: default_budget(mode).
    budget: int | str | None = None
    branching: int | None = None  # DDTree: max children per node (None: the budget; 1: a chain)
    # Prompt lookup: tokens per branch joining the tree (0: none; None: default_lookup).
    lookup: int | None = None
    # Lookup in the target's past answers where the text at hand has no match (corpus.py):
    # a JSONL file of {"tokens": [...]} lines, or an AnswerCorpus of the caller's (serve's
    # grows with its answers); None: the drafter's own corpus where its folder ships one
    # (engine/corpus.py, drafter_corpus); "": the text at hand only.
    lookup_corpus: str | AnswerCorpus | None = None
    prefill_chunk: int = 512
    # Report each emitted token's log-probability under the target, with this many top
    # alternatives (None: off). Costs one more small sync a round; acceptance is unchanged.
    logprobs: int | None = None
    stop_ids: frozenset[int] = frozenset()
    # Structured output: the output follows this grammar (engine/grammar.py); None: free text.
    grammar: GrammarSpec | None = None
    # Sync after each phase of a round so its time split is the device's (bench --profile);
    # slower, since nothing overlaps.
    profile: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise DFlashError(f"Unknown mode '{self.mode}' (choose from {', '.join(MODES)}).")
        if self.budget is None:
            self.budget = default_budget(self.mode)
        if self.budget is not None:
            self.budget = parse_budget(self.budget)
        if self.lookup is None:
            self.lookup = default_lookup(self.mode, self.budget)
        if not isinstance(self.lookup, int) or self.lookup < 0:
            raise DFlashError(f"--lookup must be a number of tokens >= 0, not {self.lookup}.")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1:
            raise DFlashError(
                f"The prefill step must be at least 1 token, not {self.prefill_chunk}."
            )
        if self.lookup and self.mode not in ("ddtree", "lookup"):
            raise DFlashError(
                "Prompt lookup (--lookup) joins DDTree trees: use --mode ddtree or lookup."
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise DFlashError(f"logprobs must be 0..{MAX_TOP_LOGPROBS} alternatives.")
        if self.mode == "lookup" and not self.lookup:
            self.lookup = DEFAULT_LOOKUP
        if self.lookup_corpus not in (None, "") and not self.lookup:
            raise DFlashError(
                "A lookup corpus (--lookup-corpus) feeds lookup branches: use --mode lookup, or "
                "--mode ddtree with --budget auto or --lookup N."
            )

    @property
    def uses_drafter(self) -> bool:
        return uses_drafter(self.mode)

    @property
    def round_kind(self) -> str:
        """ "plain", "block" or "tree": what one round of this generation is."""
        return ROUND_KINDS[self.mode]


@dataclass
class Round:
    """What one round produced and where its time went."""

    tokens: list[int]
    accepted: int  # tau: drafts accepted + the bonus token
    drafted: int
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_other: float = 0.0
    t_build: float = 0.0  # of the above, Python building MLX graphs (see GenerationConfig.profile)
    prefill: bool = False
    prefill_tokens: int = 0
    t_prefill: float = 0.0
    finished: str | None = None  # "stop" | "length" when this round ends generation
    # With GenerationConfig.logprobs: per emitted token, its log-probability under the target
    # and the top alternatives [(token, logprob)], best first.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # Under a grammar: draft nodes it pruned before the verify, its certain (forced) drafts
    # in the verified tree, and how many of those the output took.
    pruned: int = 0
    certain: int = 0
    certain_accepted: int = 0
    t_grammar: float = 0.0  # of the round's time, inside the grammar library


class Session:
    """Caches that outlive one generate call (chat reuses the prompt prefix across turns).

    The target's caches hold exactly `tokens`, and the drafter (if any) holds their context;
    `commit` is the one place that moves the three forward together, `rewind` the one place
    that moves them back. A Session is not thread-safe: one generation at a time runs on it.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        kv: KVQuantization | None = None,
        max_kv_size: int | None = None,
    ):
        self.target = target
        self.drafter = drafter
        # A target sharded over several processes (mlx_dflash/distributed.py) takes host
        # decisions on rank 0 and broadcasts them; an unsharded one holds the local world.
        self.world = target.world
        # kv: mlx-lm's quantized KV cache (--kv-bits; models/cache.py QuantizedKVCache);
        # max_kv_size: mlx-lm's rotating cache (--max-kv-size; models/cache.py RotatingKVCache)
        self.kv, self.max_kv_size = kv, max_kv_size
        bounded = kv is not None or max_kv_size is not None
        self.cache = target.make_cache(kv, max_kv_size) if bounded else target.make_cache()
        self.tokens: list[int] = []  # tokens whose K/V sit in the target cache

    def agree(self, values) -> list[int]:
        """Rank 0's ints on every rank of a sharded target; the values themselves otherwise."""
        return [int(v) for v in self.world.agree(values)]

    def commit(self, kept: list[int], taps: mx.array | None = None, path: Any = None) -> None:
        """Keep `kept`, the tokens just run after `self.tokens` that the output follows.

        Linear (path None): the forward ran a block whose first len(kept) tokens are kept, so
        every cache drops the rest. Tree: `path` are the kept nodes' indices in the verified
        tree (root first), and every cache compacts them into place. The drafter gets the kept
        positions' taps; without taps (a plain step that fed no drafter) it lags the target,
        which `rewind` allows for.
        """
        start = len(self.tokens)
        if path is None:
            end = start + len(kept)
            for c in self.cache:
                c.trim(end)
        else:
            for c in self.cache:
                c.compact(start, path)
        self.tokens.extend(kept)
        if self.drafter is not None and taps is not None:
            linear = path is None or in_place(path)  # (a prefix: a slice, not a gather)
            self.drafter.add_context(taps[: len(kept)] if linear else taps[mx.array(path)])

    def mark_prompt_end(self) -> None:
        """Recurrent layers remember this point, so a later turn can rewind to it."""
        for c in self.cache:
            c.snapshot()

    def rewind(self, prompt: list[int]) -> list[int]:
        """Keep the longest cached prefix of `prompt` (at least one token left to run)."""
        n = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        if self.drafter is not None:
            # The drafter can lag the target (a plain-decoding last step feeds it no taps).
            n = min(n, self.drafter.context_len)
        # Recurrent layers only rewind to a few points (see models/gated_deltanet.py).
        n = min([n] + [c.rewind_point(n) for c in self.cache])
        n = self.world.all_min(n)  # pipeline stages hold different layers: the furthest back
        for c in self.cache:
            c.trim(n)
        if self.drafter is not None:
            self.drafter.reset(n)
        self.tokens = self.tokens[:n]
        return prompt[n:]
