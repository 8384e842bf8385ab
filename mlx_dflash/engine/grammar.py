"""Structured output: a grammar decides which tokens the target may emit (docs/structured.md).

The constrained output is the target's own constrained decoding: at every position the target's
logits are masked to the tokens the grammar allows, then greedy or sampling picks as usual.
Speculation keeps that exact and gains from it twice: forbidden drafts are pruned before the
verify, and a forced run is certain drafts. The grammar engine is llguidance, which compiles
schemas, regexes and Lark grammars, rolls back and computes the forced run; why not xgrammar:
docs/structured.md.
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from .sampling import SamplingParams, draw, token_probs
from .tree import Tree, graft

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")

# JSON whitespace as llama.cpp's schema grammars bound it: a run of at most 20 spaces or tabs,
# or one line break and an indent of at most 20. llguidance's default, any run of whitespace,
# lets a model that prefers whitespace loop there until max_tokens (the 0.5B coder does, after
# `"steps":`): bounded, the grammar forces the next token of the value instead. A schema whose
# "x-guidance" says anything about whitespace keeps its own choice (`json_defaults`).
JSON_DEFAULTS: JsonCompileOptions = {
    "whitespace_pattern": r"[\x20\x09]{1,20}|(?:\r?\n[\x20\x09]{0,20})"
}


def json_defaults(schema: dict) -> JsonCompileOptions | None:
    """Our bounded whitespace, unless the schema's llguidance options choose whitespace."""
    own = schema.get("x-guidance")
    if isinstance(own, dict) and {"whitespace_pattern", "whitespace_flexible"} & own.keys():
        return None
    return JSON_DEFAULTS


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: a JSON schema (text), any JSON object, a regex or a Lark
    grammar. Checked and compiled by `compile_grammar`; a spec is plain data, so configs that
    carry one stay comparable and picklable."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise DFlashError(f"Unknown grammar kind '{self.kind}' ({', '.join(GRAMMAR_KINDS)}).")

    @classmethod
    def json_schema(cls, schema: dict | str) -> GrammarSpec:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec in llguidance's grammar format; a malformed schema is one sentence."""
    import llguidance

    m = llguidance.LLMatcher
    if spec.kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return m.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return m.grammar_from_lark(spec.source)
    try:
        schema = json.loads(spec.source)
    except ValueError as e:
        raise DFlashError(f"The JSON schema is not valid JSON: {e}.") from None
    if not isinstance(schema, dict):
        raise DFlashError("A JSON schema must be a JSON object.")
    try:
        return m.grammar_from_json_schema(schema, defaults=json_defaults(schema))
    except ValueError as e:
        raise DFlashError(f"The JSON schema cannot be used: {e}.") from None


# llguidance's view of a tokenizer costs ~0.3-1.4 s to build: one per tokenizer object.
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: tuple[int, ...]):
    import llguidance
    import llguidance.hf
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    # mlx-lm's TokenizerWrapper holds the Hugging Face tokenizer llguidance reads
    hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    per = _LL_TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, eos)
    if key not in per:
        try:
            per[key] = llguidance.hf.from_tokenizer(
                hf, n_vocab=vocab_size, eos_token=list(eos) or None
            )
        except (ValueError, TypeError) as e:
            raise DFlashError(f"Structured output needs a fast Hugging Face tokenizer: {e}") from e
    return per[key]


def compile_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: int, stop_ids=()) -> Grammar:
    """A fresh matcher for one generation; an invalid grammar is a DFlashError carrying
    llguidance's reason (the server answers it with a 400)."""
    import llguidance

    lt = _ll_tokenizer(tokenizer, vocab_size, tuple(sorted(stop_ids)))
    text = _grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, lt)
    matcher = None if is_error else llguidance.LLMatcher(lt, text, log_level=0)
    if matcher is None or matcher.is_error():
        reason = _one_line(messages[0] if matcher is None else matcher.get_error(), spec.kind)
        raise DFlashError(f"The grammar cannot be compiled: {reason}")
    return Grammar(matcher, vocab_size, stop_ids)


def _one_line(message: str, kind: str) -> str:
    """llguidance's reason as one sentence: its first line, completed by the `error:` line
    under a regex parse error, without the source it draws beneath; the position (`at 1(8):`)
    only where it points into the user's own text (a Lark grammar, not the one made of a
    regex or a schema)."""
    lines = [line.strip() for line in message.strip().splitlines()] or ["no reason given"]
    first = lines[0]
    if first.endswith(":"):
        first += " " + next((x[6:].strip() for x in lines if x.startswith("error:")), "")
    if kind != "lark" and first.startswith("at ") and "): " in first:
        first = first.split("): ", 1)[1]
    return first.rstrip(". ") + "."


class Grammar:
    """One generation's grammar state: llguidance's matcher after the tokens emitted so far.

    Tree building moves the matcher down a draft branch and back (`goto`); every caller leaves
    it at the emitted tokens (an empty `branch`). `seconds` counts the time inside llguidance
    (Round.t_grammar, bench --profile).
    """

    def __init__(self, matcher, vocab_size: int, stop_ids=()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stops = frozenset(int(t) for t in stop_ids)
        self.branch: list[int] = []  # tokens consumed beyond the emitted ones (a draft branch)
        self.seconds = 0.0  # inside llguidance: the grammar's cost (bench --profile reports it)

    def _ll(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def allows(self, token: int) -> bool:
        # llguidance's validate_tokens refuses the end token even where its mask (and
        # consume_token) take it: the grammar is complete there.
        if int(token) in self.stops:
            return bool(self._ll(self.matcher.is_accepting))
        return self._ll(self.matcher.validate_tokens, [int(token)]) == 1

    def push(self, token: int) -> bool:
        """Consume a draft token (false, and nothing consumed, when the grammar forbids it)."""
        if not self.allows(token):
            return False
        self._ll(self.matcher.consume_token, int(token))
        self.branch.append(int(token))
        return True

    def goto(self, tokens: list[int]) -> None:
        """Move to the state after `tokens` from the emitted ones (rolling back only what
        differs from the current branch); the tokens must be allowed."""
        common = 0
        while (
            common < len(tokens)
            and common < len(self.branch)
            and self.branch[common] == tokens[common]
        ):
            common += 1
        if len(self.branch) > common:
            self._ll(self.matcher.rollback, len(self.branch) - common)
            del self.branch[common:]
        for t in tokens[common:]:
            ok = self.push(t)
            assert ok, "goto follows allowed tokens only"

    def accept(self, tokens: list[int]) -> None:
        """The emitted tokens of a round: the new base state."""
        self.goto([])
        for t in tokens:
            if not self._ll(self.matcher.consume_token, int(t)):
                raise DFlashError(
                    f"The grammar rejected an emitted token: {self.matcher.get_error()}"
                )

    def allowed(self, path: list[int], token: int) -> bool:
        """Whether `token` may follow the draft branch `path` (tree.best_first's filter)."""
        self.goto(path)
        return self.allows(token)

    def run_after(self, path: list[int], limit: int) -> list[int] | None:
        """After the draft branch `path`: None where the answer has ended there (nothing may
        follow), else the run the grammar forces next (at most `limit`, often none)."""
        if path and path[-1] in self.stops:
            return None
        self.goto(path)
        return self.forced(limit)

    def forced(self, limit: int) -> list[int]:
        """The run of tokens the grammar allows as the only continuation here (at most `limit`)."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return [int(t) for t in self._ll(self.matcher.compute_ff_tokens)[:limit]]

    def mask(self) -> np.ndarray:
        """The allowed tokens here, as a bool vector over the target's vocabulary."""
        bits = np.frombuffer(self._ll(self.matcher.compute_bitmask), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def pick(
        self, row: mx.array, argmax: int | None, sampling: SamplingParams, rng, mask=None
    ) -> int:
        """The target's token here under the mask: masked argmax (greedy) or a draw from the
        masked distribution (sampling), exactly as a plain constrained decoding step.

        `argmax` (the row's unmasked argmax, read back with the round's other choices) is the
        masked one whenever the mask allows it, and then the row is never read. The mask, not
        `allows`, decides: llguidance's `validate_tokens` accepts some tokens its mask refuses
        (a non-canonical split of a fixed key: "attend" + "ee" + "s"), and plain constrained
        decoding follows the mask. `mask`: this state's, when the caller has it already."""
        mask = self.mask() if mask is None else mask
        if sampling.greedy:
            if argmax is not None and mask[argmax]:
                return argmax
            x = np.array(row.astype(mx.float32))
            return int(np.argmax(np.where(mask, x, -np.inf)))
        masked = mx.where(mx.array(mask), row, -mx.inf)
        return draw(token_probs(masked[None], sampling)[0], rng)


def with_certain_run(tree: Tree, grammar: Grammar, limit: int) -> Tree:
    """`tree` with the grammar's forced run at the root (at most `limit` tokens) grafted as
    certain drafts: for trees built without the grammar (a DFlash 2 lattice, already pruned)
    and for rounds without a drafter."""
    run = grammar.forced(limit)
    return graft(tree, [run], certain=True) if run else tree


def prune_tree(tree: Tree, grammar: Grammar) -> tuple[Tree, int]:
    """Drop the nodes (and their subtrees) whose token the grammar forbids, keeping creation
    order; returns (tree, nodes pruned) with the grammar left at the emitted tokens."""
    keep = [0]
    index = {0: 0}
    paths: dict[int, list[int]] = {0: []}
    for i in range(1, len(tree.tokens)):
        p = int(tree.parents[i])
        if p not in index:
            continue
        grammar.goto(paths[p])
        if not grammar.allows(int(tree.tokens[i])):
            continue
        index[i] = len(keep)
        keep.append(i)
        paths[i] = [*paths[p], int(tree.tokens[i])]
    grammar.goto([])
    k = np.array(keep)
    parents = np.array([-1] + [index[int(tree.parents[i])] for i in keep[1:]], dtype=np.int64)
    certain = None if tree.certain is None else tree.certain[k]
    out = Tree(tree.tokens[k], parents, tree.depths[k], tree.log_probs[k], certain)
    return out, len(tree.tokens) - len(keep)
