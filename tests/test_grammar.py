"""Structured output (engine/grammar.py): constrained speculative decoding equals plain
constrained decoding, token for token, in every mode.

The reference is independent of our engine: mlx-lm's `generate_step` with a logits processor
that applies llguidance's own bitmask (llguidance.numpy) — the library's constrained decoding
in a plain loop. Our engine must reproduce it while pruning drafts the grammar forbids and
verifying the grammar's forced runs as certain drafts.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from llguidance.numpy import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_next_token_bitmask,
)
from mlx_lm.generate import generate_step
from oracle import LatticeOracle, OracleDrafter, diversify
from test_sampling import chi2_pvalue

from mlx_dflash.engine import GenerationConfig, SamplingParams, Session, generate_rounds
from mlx_dflash.engine.grammar import (
    JSON_DEFAULTS,
    GrammarSpec,
    compile_grammar,
    json_defaults,
)
from mlx_dflash.engine.sampling import token_probs
from mlx_dflash.engine.tree import best_first, marginal_child
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target
from mlx_dflash.prompts import stop_ids

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SPEC = GrammarSpec.json_schema(SCHEMA)
PROMPT = list(range(3, 23))
N = 60


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t = load_target(write_tiny_target(tmp_path_factory.mktemp("g") / "t", "qwen3"))
    diversify(t.model)
    return t


def library_processor(target, spec: GrammarSpec, prompt_len: int):
    """An mlx-lm logits processor made of llguidance's own pieces (its matcher, its numpy
    bitmask): the library's constrained decoding, independent of our engine/grammar.py but
    for the JSON options we compile with (bounded whitespace)."""
    lt = llguidance.hf.from_tokenizer(
        target.tokenizer._tokenizer,
        n_vocab=target.vocab_size,
        eos_token=sorted(stop_ids(target.tokenizer)),
    )
    text = {
        "json_schema": lambda: llguidance.LLMatcher.grammar_from_json_schema(
            spec.source, defaults=json_defaults(json.loads(spec.source))
        ),
        "regex": lambda: llguidance.LLMatcher.grammar_from_regex(spec.source),
        "lark": lambda: llguidance.LLMatcher.grammar_from_lark(spec.source),
        "json_object": lambda: llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_DEFAULTS
        ),
    }[spec.kind]()
    matcher = llguidance.LLMatcher(lt, text, log_level=0)
    bitmask = allocate_token_bitmask(1, target.vocab_size)
    seen = [prompt_len]

    def processor(tokens, logits):
        for t in np.array(tokens[seen[0] :]).tolist():
            assert matcher.consume_token(int(t))
        seen[0] = len(tokens)
        fill_next_token_bitmask(matcher, bitmask)
        x = np.array(logits.astype(mx.float32))
        apply_token_bitmask_inplace(x, bitmask)
        return mx.array(x)

    return processor


def reference(target, spec: GrammarSpec, n=N, sampler=None, seed=None, vectors=None):
    """mlx-lm's plain decoding with llguidance's bitmask applied to every step's logits
    (`vectors`, when a list, receives each step's log-probabilities, mask applied)."""
    processor = library_processor(target, spec, len(PROMPT))
    if seed is not None:
        mx.random.seed(seed)
    sampler = sampler or (lambda x: mx.argmax(x, axis=-1))
    out = []
    stops = stop_ids(target.tokenizer)
    for t, lp in generate_step(
        mx.array(PROMPT), target.model, max_tokens=n, sampler=sampler, logits_processors=[processor]
    ):
        out.append(int(t))
        if vectors is not None:
            vectors.append(np.array(lp))
        if int(t) in stops:
            break
    return out


def run(target, drafter, spec=SPEC, n=N, **kw):
    cfg = GenerationConfig(max_tokens=n, grammar=spec, stop_ids=stop_ids(target.tokenizer), **kw)
    tokens, rounds = [], []
    for r in generate_rounds(Session(target, drafter), PROMPT, cfg):
        tokens += r.tokens
        rounds.append(r)
    return tokens, rounds


MODES = [
    ("ar", 16, 0),
    ("dflash", 16, 0),
    ("ddtree", 4, 0),
    ("ddtree", 16, 0),
    ("ddtree", "auto", 0),
    ("ddtree", 8, 4),
    ("lookup", 16, 4),
]


@pytest.mark.parametrize("mode, budget, lookup", MODES)
@pytest.mark.parametrize("corrupt", [0.0, 0.4])
def test_greedy_equals_plain_constrained_decoding(target, mode, budget, lookup, corrupt):
    want = reference(target, SPEC)
    drafter = None
    if mode in ("dflash", "ddtree"):
        drafter = OracleDrafter(
            PROMPT + want, target.vocab_size, block_size=8, corrupt=corrupt, seed=1
        )
        target.set_taps([1, 3])
    got, rounds = run(target, drafter, mode=mode, budget=budget, lookup=lookup)
    assert got == want
    text = target.tokenizer.decode([t for t in got if t not in stop_ids(target.tokenizer)])
    if len(got) < N:  # the grammar ended the answer: it is a valid instance of the schema
        jsonschema.validate(json.loads(text), SCHEMA)
    if mode != "ar":
        assert sum(r.certain_accepted for r in rounds) > 0  # keys and punctuation were certain
    if mode in ("dflash", "ddtree") and corrupt:
        assert sum(r.pruned for r in rounds) > 0


REGEX = GrammarSpec("regex", "[ab]{2,5}")


def exact_marginals(target, spec, sampling, depth):
    """Marginals of emitted tokens 1..depth under the grammar, by enumerating every allowed
    prefix: the target's distribution masked and renormalised at each (stop tokens end a
    prefix: they are counted, and nothing follows them)."""
    grammar = compile_grammar(spec, target.tokenizer, target.vocab_size, stop_ids(target.tokenizer))
    stops = stop_ids(target.tokenizer)
    marg, prefixes, weights = [], [()], np.array([1.0])
    for _ in range(depth):
        m = np.zeros(target.vocab_size)
        nxt, nw = [], []
        for pre, w in zip(prefixes, weights, strict=True):
            if pre and pre[-1] in stops:
                continue
            grammar.goto(list(pre))
            logits = target.model(mx.array([PROMPT + list(pre)]))[0, -1]
            masked = mx.where(mx.array(grammar.mask()), logits, -mx.inf)
            p = token_probs(masked[None], sampling)[0]
            m += w * p
            for t in np.nonzero(p)[0]:
                nxt.append((*pre, int(t)))
                nw.append(w * p[t])
        marg.append(m / m.sum())
        prefixes, weights = nxt, np.array(nw)
    grammar.goto([])
    return marg


@pytest.fixture(scope="module")
def flat_target(tmp_path_factory):
    t = load_target(write_tiny_target(tmp_path_factory.mktemp("gs") / "t", "llama"))
    diversify(t.model, gain=1.0, seed=3)
    return t


@pytest.mark.parametrize("mode, budget", [("dflash", 16), ("ddtree", 6), ("lookup", 16)])
def test_sampling_under_a_grammar_is_the_masked_target_distribution(flat_target, mode, budget):
    target, depth = flat_target, 3
    sampling = SamplingParams(1.5)
    a, b = (target.tokenizer.encode(x)[0] for x in "ab")
    truth = PROMPT + [a, b, a, b, b, a, a]  # drafts the walk sometimes takes, sometimes not
    target.set_taps([1, 3])
    samples, taus, certain = [], [], 0
    for seed in range(600):
        drafter = OracleDrafter(truth, target.vocab_size, block_size=4, corrupt=0.3, seed=seed)
        cfg = GenerationConfig(
            max_tokens=depth,
            sampling=sampling,
            seed=seed,
            mode=mode,
            budget=budget,
            lookup=2 if mode == "lookup" else 0,
            grammar=REGEX,
            stop_ids=stop_ids(target.tokenizer),
        )
        out = []
        for r in generate_rounds(
            Session(target, drafter if mode != "lookup" else None), PROMPT, cfg
        ):
            out += r.tokens
            taus += [] if r.prefill else [r.accepted]
            certain += r.certain_accepted
        samples.append(out + [-1] * (depth - len(out)))
    samples = np.array(samples)
    if mode != "lookup":
        assert np.mean(taus) > 1.2, "drafts must be accepted in some rounds"
    for k, expected in enumerate(exact_marginals(target, REGEX, sampling, depth)):
        col = samples[:, k]
        col = col[col >= 0]
        expected = expected / expected.sum()
        assert chi2_pvalue(col, expected) > 1e-3, f"token {k + 1} is biased"


def test_dflash2_lattice_trees_under_a_grammar(target):
    """A DFlash 2 drafter's lattice tree is pruned after it is built and gets the root's
    certain run grafted: still exact."""
    want = reference(target, SPEC)
    target.set_taps([1, 3])
    for budget in (6, "auto"):
        drafter = LatticeOracle(PROMPT + want, target.vocab_size, block_size=8, corrupt=0.4, seed=3)
        got, rounds = run(target, drafter, mode="ddtree", budget=budget)
        assert got == want
        assert sum(r.pruned for r in rounds) > 0


@pytest.mark.parametrize("kind", ["dflash", "lattice"])
def test_a_constrained_tree_reads_what_was_queued(target, kind, monkeypatch):
    """On a GPU a constrained tree reads the candidates queued with the drafter's pass: the
    queue and the tree agree on their width (at least GRAMMAR_CANDIDATES a depth, where
    --mode dflash's chain is a tree of branching 1 under a grammar). Exact."""
    from test_syncs import queued_reads

    want = reference(target, SPEC)
    target.set_taps([1, 3])
    found = queued_reads(monkeypatch, "metal")
    oracle = LatticeOracle if kind == "lattice" else OracleDrafter
    drafter = oracle(PROMPT + want, target.vocab_size, block_size=8, corrupt=0.4, seed=3)
    for mode in ("ddtree", "dflash"):
        got, rounds = run(target, drafter, mode=mode, budget=16)
        assert got == want and sum(r.pruned for r in rounds) > 0, mode
    assert len(found) > 6 and all(found), found


def test_certain_runs_without_a_drafter(target):
    """A constant in the schema is a run the grammar forces: lookup mode, with nothing to look
    up, still verifies it in one pass as certain drafts, and every one is accepted."""
    schema = {
        "type": "object",
        "properties": {"kind": {"const": "tools.search_everything"}},
        "required": ["kind"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }  # fmt: skip  (llguidance's option)
    spec = GrammarSpec.json_schema(schema)
    want = reference(target, spec)
    got, rounds = run(target, None, spec=spec, mode="lookup", lookup=1)
    assert got == want
    certain = sum(r.certain for r in rounds)
    assert certain >= 5 and sum(r.certain_accepted for r in rounds) == certain
    assert max(r.accepted for r in rounds) >= 5
    text = target.tokenizer.decode([t for t in got if t not in stop_ids(target.tokenizer)])
    assert json.loads(text) == {"kind": "tools.search_everything"}


def test_grammar_tree_prunes_and_adds_certain_runs(target):
    """The builder itself: every node is allowed on its path, candidates the grammar forbids
    are counted, a forced run follows the node that opens it, and branching 1 is a chain."""
    g = compile_grammar(
        GrammarSpec("regex", r"[xz](yes|no)123"), target.tokenizer, target.vocab_size
    )
    enc = target.tokenizer.encode
    x, yes, no = enc("x")[0], enc("yes"), enc("no")
    cand = np.array([[x, yes[0], no[0]], [yes[0], no[0], x], [x, x, x], [x, x, x]])
    lp = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.9, 0.05, 0.05]]))
    tree, pruned = best_first(0, marginal_child(cand, lp), 4, 3, 20, g, tokens_left=20)
    kids = tree.children()
    assert pruned > 0
    for i in range(1, len(tree.tokens)):
        path, j = [], i
        while j:
            path.insert(0, int(tree.tokens[j]))
            j = int(tree.parents[j])
        assert g.matcher.validate_tokens(path) == len(path)
    assert tree.tokens[1] == x and not tree.is_certain()[1]
    assert tree.is_certain().sum() > 0  # "123" after "yes" / "no" is forced
    chain, _ = best_first(0, marginal_child(cand, lp), 4, 3, 20, g, tokens_left=20, branching=1)
    assert all(len(k) <= 1 for k in chain.children())
    assert g.branch == [] and len(kids[0]) == 1


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_json_whitespace_is_bounded_unless_the_schema_says_otherwise(target, kind):
    """A model that prefers whitespace cannot loop in it until max_tokens (the real 0.5B coder
    wrote spaces after `"steps":` for 1200 tokens): at most 20 spaces, or a line break and an
    indent of 20, then the grammar forces the value. A schema's "x-guidance" still decides."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    own = {**schema, "x-guidance": {"whitespace_pattern": r"[\x20\x0A]+"}}

    def takes(spec, text):
        g = compile_grammar(spec, target.tokenizer, target.vocab_size)
        ids = target.tokenizer.encode(text)
        return g.matcher.validate_tokens(ids) == len(ids)

    spec = GrammarSpec.json_schema(schema) if kind == "json_schema" else GrammarSpec(kind)
    for ok in ['{"a": 1}', '{"a":' + " " * 20 + "1}", '{\n  "a":\n' + " " * 20 + "1\n}"]:
        assert takes(spec, ok), ok
    for loop in ['{"a":' + " " * 21, '{"a":\n\n', '{"a":' + " " * 20 + "\n" + " " * 20]:
        assert not takes(spec, loop), loop
    assert takes(GrammarSpec.json_schema(own), '{"a":' + " \n" * 40 + "1}")
    compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
    assert not takes(GrammarSpec.json_schema(compact), '{"a": 1}')
    assert takes(GrammarSpec.json_schema(compact), '{"a":1}')


@pytest.mark.parametrize(
    "spec, reason",
    [
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("json_schema", json.dumps({"type": "nosuchtype"})), "compiled: .*nosuchtype"),
        (
            GrammarSpec("regex", "(unclosed"),
            'compiled: invalid regex "\\(unclosed".*unclosed group',
        ),
        (GrammarSpec("lark", "start: undefined_rule"), 'compiled: at 1\\(8\\): .*"undefined_rule"'),
    ],
)
def test_bad_grammars_are_one_sentence(target, spec, reason):
    """One line, naming what is wrong (not the source llguidance draws under it)."""
    with pytest.raises(DFlashError, match=reason) as err:
        run(target, None, spec=spec, mode="ar")
    assert "\n" not in str(err.value) and "^" not in str(err.value)


def test_stats_report_the_grammar(target):
    from mlx_dflash.engine import Stats

    want = reference(target, SPEC)
    target.set_taps([1, 3])
    drafter = OracleDrafter(PROMPT + want, target.vocab_size, block_size=8, corrupt=0.4, seed=1)
    _, rounds = run(target, drafter, mode="ddtree", budget=8)
    stats = Stats()
    for r in rounds:
        stats.add(r)
    d = stats.to_dict()
    assert d["grammar_pruned"] > 0 and 0 < d["grammar_drafts_accepted"] <= d["grammar_drafts"]
    assert d["time_grammar_s"] > 0 and "certain drafts taken" in stats.line()


def test_generate_flags(run_cli, tmp_path):
    """`generate --regex / --json-schema / --lark` on the embedded pair; every mode's answer
    matches, and bad grammar input is one sentence with a non-zero exit."""
    import re

    texts = set()
    for mode in ("ar", "dflash", "ddtree"):
        code, out, err = run_cli(
            "generate", "-p", "Once upon a time", "-n", "40", "--mode", mode, "--json",
            "--regex", r"( [a-z]+){3,8}\.",
        )  # fmt: skip
        assert code == 0, err
        d = json.loads(out)
        # (the decoded text drops the first token's leading space, as sentencepiece does)
        assert re.fullmatch(r"[a-z]+( [a-z]+){2,7}\.", d["text"]) and d["finish_reason"] == "stop"
        texts.add(d["text"])
    assert len(texts) == 1  # greedy: the same constrained answer in every mode
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                                  "required": ["n"], "additionalProperties": False,
                                  "x-guidance": {"whitespace_flexible": False}}))  # fmt: skip
    code, out, err = run_cli("generate", "-p", "Count:", "-n", "60", "--json-schema", str(schema),
                             "--json", "--mode", "ddtree")  # fmt: skip
    assert code == 0, err
    assert set(json.loads(json.loads(out)["text"])) == {"n"}
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    for args, msg in [
        (["--json-schema", str(bad)], "not valid JSON"),
        (["--json-schema", str(tmp_path / "missing.json")], "does not exist"),
        (["--regex", "(x"], "cannot be compiled"),
        (["--regex", "x", "--lark", str(schema)], "not several"),
    ]:
        code, _, err = run_cli("generate", "-p", "Hi", "-n", "5", *args)
        assert code != 0 and msg in err and "Traceback" not in err


@pytest.mark.parametrize("mode, budget", [("ar", 16), ("dflash", 16), ("ddtree", 6)])
def test_logprobs_under_a_grammar_are_mlx_lms_masked_ones(target, mode, budget):
    """mlx-lm reports log-probabilities after its logits processors: under a grammar, of the
    masked distribution; so do we, in every round kind."""
    vectors: list = []
    want = reference(target, SPEC, vectors=vectors)
    drafter = None
    if mode != "ar":
        drafter = OracleDrafter(PROMPT + want, target.vocab_size, block_size=8, corrupt=0.3, seed=1)
        target.set_taps([1, 3])
    got, rounds = run(target, drafter, mode=mode, budget=budget, logprobs=3)
    lps = [x for r in rounds for x in (r.logprobs or [])]
    assert got == want and len(lps) == len(want)
    for (chosen, top), t, vec in zip(lps, want, vectors, strict=True):
        assert abs(chosen - float(vec[t])) < 1e-4
        assert all(np.isfinite(v) and abs(v - float(vec[i])) < 1e-4 for i, v in top)


def test_the_mask_decides_not_validate_tokens(target):
    """llguidance's validate_tokens accepts some splits its mask refuses (after '{"attend' only
    the canonical 'ee' is in the mask, yet 'e' validates): plain constrained decoding follows
    the mask, so a row whose unmasked argmax is such a token must not be taken at its word."""
    schema = {"type": "object", "properties": {"attendees": {"type": "integer"}},
              "required": ["attendees"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    g = compile_grammar(GrammarSpec.json_schema(schema), target.tokenizer, target.vocab_size)
    g.accept(target.tokenizer.encode('{"attend'))
    mask = g.mask()
    split = [v for v in range(target.vocab_size) if g.allows(v) and not mask[v]]
    assert split, "the tokenizer no longer shows the case this test guards"
    row = np.zeros(target.vocab_size, dtype=np.float32)
    row[split[0]] = 5.0
    row[np.nonzero(mask)[0][0]] = 4.0
    pick = g.pick(mx.array(row), split[0], SamplingParams(), None)
    assert pick == int(np.nonzero(mask)[0][0]) and mask[pick]
