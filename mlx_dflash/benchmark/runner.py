"""The benchmark harness: every method on every prompt, side by side on one loaded target.

Methods are plain mlx-lm decoding (`generate_step`, the reference) and our engine's modes;
outputs are compared token for token (report.py) and speeds reported against mlx-lm.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..distributed import LOCAL
from ..engine import GenerationConfig, SamplingParams, Session, Stats, parse_budget, stream_generate
from ..engine.choice import default_mode, describe
from ..engine.corpus import AnswerCorpus, live_corpus, load_corpus
from ..engine.session import DEFAULT_LOOKUP, uses_drafter
from ..errors import DFlashError
from ..models.pair import load_pair
from ..prompts import encode_prompt, has_template, stop_ids
from .datasets import load_grammars, load_prompts
from .report import check_identical, speedups, summarize

# "default" is what `generate` runs when told nothing (engine/choice.py), resolved for the
# loaded pair on this machine; the table's footer says what it was.
DEFAULT_METHODS = "mlx-lm,default,ar,dflash"
WARMUP_TOKENS = 8


# A method's name -> (the engine mode it runs, whether it takes :BUDGET, lookup tokens per
# branch, whether its lookup also reads the --lookup-corpus)
METHODS = {
    "mlx-lm": ("mlx-lm", False, 0, False),
    "default": ("default", False, None, False),
    "ar": ("ar", False, 0, False),
    "dflash": ("dflash", True, 0, False),
    "ddtree": ("ddtree", True, 0, False),
    "ddtree+lookup": ("ddtree", True, DEFAULT_LOOKUP, False),
    "lookup": ("lookup", True, DEFAULT_LOOKUP, False),
    "ddtree+lookup+corpus": ("ddtree", True, DEFAULT_LOOKUP, True),
    "lookup+corpus": ("lookup", True, DEFAULT_LOOKUP, True),
}


@dataclass(frozen=True)
class Method:
    label: str  # as the user wrote it: "ddtree:16"
    mode: str  # "mlx-lm" | "default" | "ar" | "dflash" | "ddtree" | "lookup"
    budget: int | str | None = None  # None: the mode's default (GenerationConfig)
    lookup: int | None = 0  # prompt-lookup tokens per branch (ddtree+lookup, lookup)
    # The past answers its lookup also reads (the +corpus methods); an AnswerCorpus of its
    # own grows with its answers (--grow-corpus); "": none; None: the drafter's own.
    corpus: str | AnswerCorpus | None = ""


def parse_methods(
    spec: str | list[str], corpus: str | None = None, grows: bool = False
) -> list[Method]:
    """`mlx-lm,ar,dflash,ddtree:4,ddtree:auto,lookup,ddtree+lookup:auto` -> Methods (ddtree
    alone means budget 16; lookup takes a budget too: auto sizes its branches). The `+corpus`
    methods read `corpus` too (engine/corpus.py); with `grows`, each its own copy (empty
    without `corpus`) that its answers join as they come, as serve's does."""
    items = spec.split(",") if isinstance(spec, str) else [s for x in spec for s in x.split(",")]
    out: list[Method] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        name, _, arg = item.partition(":")
        mode, budgeted, look, reads = METHODS.get(name, (None, False, 0, False))
        if mode is None or (arg and not budgeted):
            raise DFlashError(
                f"Unknown method '{item}' (use mlx-lm, default, ar, dflash, ddtree[:BUDGET], "
                "lookup[:BUDGET], ddtree+lookup[:BUDGET], or either lookup with +corpus)."
            )
        # "": no corpus; None: the drafter's own, as `generate` reads it (the default method)
        source: str | AnswerCorpus | None = None if mode == "default" else ""
        if reads and grows:
            source = live_corpus(corpus)  # (a bad file is one sentence before any model loads)
        elif reads:
            if not corpus:
                raise DFlashError(
                    f"Method '{item}' reads a corpus: give --lookup-corpus FILE or --grow-corpus."
                )
            load_corpus(corpus)
            source = corpus
        # (ddtree and lookup alone: 16 nodes; dflash alone: the drafter's whole block)
        budget = parse_budget(arg) if arg else None if name == "dflash" or not budgeted else 16
        out.append(Method(item, mode, budget, look, source))
    if not out:
        raise DFlashError("--methods names no method.")
    labels = [m.label for m in out]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise DFlashError(f"Method '{dup}' is listed twice.")
    return out


@dataclass
class Run:
    tokens: list[int]
    prompt_tokens: int
    t_prefill: float
    t_decode: float
    taus: list[int]
    t_draft: float | None = None
    t_verify: float | None = None
    t_other: float | None = None
    t_build: float | None = None
    draft_rounds: int = 0
    peak_memory: int = 0  # bytes MLX held at most during the run (weights included)
    t_grammar: float | None = None  # inside the grammar library (structured output only)
    grammar: tuple[int, int, int] = (0, 0, 0)  # candidates pruned, certain drafts, taken
    valid: bool | None = None  # structured output: the answer is complete under its grammar


def run_engine(
    target, runner, ids: list[int], cfg: GenerationConfig, session: Session | None = None
) -> Run:
    """Our engine (ar, dflash, ddtree or lookup) on one prompt, from an empty cache, or from
    `session`'s (which then prefills only the part of the prompt it does not hold)."""
    if session is None:
        session = Session(target, runner if cfg.uses_drafter else None)
    stats, tokens = Stats(), []  # (stats: the last chunk's running totals)
    for chunk in stream_generate(session, ids, cfg):
        stats = chunk.stats
        tokens += chunk.tokens
    return Run(
        tokens,
        stats.prompt_tokens,
        stats.t_prefill,
        stats.t_decode,
        stats.taus,
        stats.t_draft,
        stats.t_verify,
        stats.t_other,
        stats.t_build,
        stats.draft_rounds,
        t_grammar=stats.t_grammar if cfg.grammar is not None else None,
        grammar=(stats.grammar_pruned, stats.grammar_drafts, stats.grammar_drafts_accepted),
    )


def run_mlx_lm(target, ids: list[int], cfg: GenerationConfig) -> Run:
    """mlx-lm's own generate_step with its sampler: the reference everyone compares to. Under
    a grammar, plain constrained decoding: the grammar's mask as an mlx-lm logits processor."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    s = cfg.sampling
    sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0, top_k=s.top_k)
    grammar = _grammar(target, cfg)
    processors = [_mask_processor(grammar, len(ids))] if grammar is not None else None
    if cfg.seed is not None:
        mx.random.seed(cfg.seed)
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = t_last = t0
    gen = generate_step(mx.array(ids), target.model, max_tokens=cfg.max_tokens, sampler=sampler,
                        logits_processors=processors)  # fmt: skip
    try:
        for tok, _ in gen:
            t_last = time.perf_counter()
            if not tokens:
                t_first = t_last
            tokens.append(int(tok))
            if tokens[-1] in cfg.stop_ids:
                break
    finally:
        gen.close()
    taus = [1] * max(len(tokens) - 1, 0)
    t_grammar = grammar.seconds if grammar is not None else None
    return Run(tokens, len(ids), t_first - t0, t_last - t_first, taus, t_grammar=t_grammar)


def _grammar(target, cfg: GenerationConfig):
    from ..engine.grammar import compile_grammar

    if cfg.grammar is None:
        return None
    return compile_grammar(cfg.grammar, target.tokenizer, target.vocab_size, cfg.stop_ids)


def _mask_processor(grammar, prompt_len: int):
    """An mlx-lm logits processor: consume the tokens sampled since the last call, mask the
    logits to what the grammar allows next."""
    import mlx.core as mx

    seen = [prompt_len]

    def process(tokens, logits):
        grammar.accept(tokens[seen[0] :].tolist())
        seen[0] = len(tokens)
        return mx.where(mx.array(grammar.mask()), logits, -mx.inf)

    return process


def check_valid(target, cfg: GenerationConfig, tokens: list[int]) -> bool | None:
    """Structured output: the answer ended (a stop token) with its grammar complete, checked
    by a fresh matcher (llguidance's own validator). None without a grammar."""
    grammar = _grammar(target, cfg)
    if grammar is None:
        return None
    body = tokens[:-1] if tokens and tokens[-1] in cfg.stop_ids else None
    if body is None or grammar.matcher.validate_tokens(body) != len(body):
        return False
    grammar.accept(body)
    return bool(grammar.matcher.is_accepting())


def run_method(
    method: Method, target, runner, ids: list[int], cfg: GenerationConfig, session=None
) -> Run:
    import mlx.core as mx

    mx.reset_peak_memory()
    if method.mode == "mlx-lm":
        run = run_mlx_lm(target, ids, cfg)
    else:
        cfg = dataclasses.replace(cfg, mode=method.mode, budget=method.budget,
                                  lookup=method.lookup, lookup_corpus=method.corpus)  # fmt: skip
        run = run_engine(target, runner, ids, cfg, session)
    run.peak_memory = mx.get_peak_memory()
    run.valid = check_valid(target, cfg, run.tokens)
    return run


def with_context(tokenizer, prompts: list[str], context: int) -> list[str]:
    """Each prompt after enough earlier text of its set (the others, cycled) to make about
    `context` tokens: long-context speed on the same questions."""
    pool = "\n\n".join(prompts)
    ids = list(tokenizer.encode(pool))
    if not ids:
        return prompts
    ids = ids * (context // len(ids) + 1)
    out = []
    for p in prompts:
        room = max(0, context - len(tokenizer.encode(p)))
        out.append(tokenizer.decode(ids[:room]) + "\n\n" + p if room else p)
    return out


def package_version(pkg: str) -> str | None:
    """An installed package's version (None: not installed): bench's, doctor's, --version's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def _environment() -> dict[str, Any]:
    import mlx.core as mx

    from .. import __version__, _blas

    return {
        "dflash_mlx": __version__,
        "python": platform.python_version(),
        "mlx": package_version("mlx"),
        "mlx-lm": package_version("mlx-lm"),
        "machine": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "blas": _blas.loaded_blas,
    }


def run_bench(
    model: str | None = None,
    drafter: str | None = None,
    methods: str | list[str] = DEFAULT_METHODS,
    datasets: str | list[str] = "gsm8k",
    data_dir: str | Path | None = None,
    limit: int | None = 10,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = 0,
    block_size: int | None = None,
    chat_template: bool | None = None,
    system: str | None = None,
    context: int | None = None,
    profile: bool = False,
    lookup_corpus: str | None = None,
    grow_corpus: bool = False,
    repeat: int = 1,
    progress=None,
) -> dict[str, Any]:
    """Run every method on every prompt of every dataset; return the results as a dict.

    `progress(total)` may return `update(description, advance)`, called as the runs go.
    `context`: prefix each prompt with earlier text of its set up to about that many tokens;
    our engine's methods then share one prefill per prompt (a 16K-token prefill takes minutes
    on a CPU), and each reports the prefill it did itself.
    `profile`: sync after each phase of a round, so draft / verify / host / Python times are
    the device's (slower: nothing overlaps). `grow_corpus`: see parse_methods. `repeat`: each
    prompt run that many times by every method, interleaved; the median run counts."""
    asked = {k: v for k, v in locals().items() if k not in ("model", "drafter", "data_dir")}
    meths = parse_methods(methods, lookup_corpus, grow_corpus)
    names = _dataset_names(datasets)
    prompt_sets = {n: load_prompts(n, data_dir, limit) for n in names}
    grammars = {n: load_grammars(n, len(ps)) for n, ps in prompt_sets.items()}
    target, runner, meths, chosen = _load(model, drafter, meths)
    tok = target.tokenizer
    if context:
        prompt_sets = {n: with_context(tok, ps, context) for n, ps in prompt_sets.items()}
    encoded = {
        n: [encode_prompt(tok, p, chat_template, system) for p in ps]
        for n, ps in prompt_sets.items()
    }
    cfg = GenerationConfig(
        max_tokens=max_tokens,
        sampling=SamplingParams(temp, top_p, top_k),
        seed=seed,
        block_size=block_size,
        stop_ids=stop_ids(tok),
        profile=profile,
    )
    total = sum(len(v) for v in encoded.values()) * len(meths) * repeat
    update = progress(total) if progress else None
    first = next(iter(encoded))  # (its first prompt's grammar warms llguidance's tokenizer)
    _warm_up(meths, target, runner, encoded[first][0], cfg, grammars[first][0], update)
    runs, outputs = _run_all(
        meths, target, runner, encoded, grammars, cfg, bool(context), update, repeat
    )
    rows = [{"dataset": n, "method": m.label, **summarize(runs[n][m.label])}
            for n in encoded for m in meths]  # fmt: skip
    asked.pop("progress")
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": model or "stories260K (embedded)",
        "drafter": drafter,
        "drafter_kind": runner.cfg.describe() if runner is not None else None,
        # what the "default" method ran (engine/choice.py), and why where it is not DDTree
        "default": _default_ran(chosen, cfg, runner),
        "settings": {
            **asked,
            "methods": [m.label for m in meths],
            "datasets": names,
            "chat_template": has_template(tok) if chat_template is None else chat_template,
        },  # fmt: skip
        "environment": _environment(),
        "baseline": speedups(rows),
        "results": rows,
        "identical": check_identical(outputs, greedy=temp <= 0),
    }


def _load(model, drafter, meths: list[Method]):
    """(target, runner, the methods with "default" resolved, the Choice it resolved to or
    None): the pair loaded as `generate` would load it for the default (engine/choice.py)."""
    needs_drafter = any(uses_drafter(m.mode) for m in meths)
    default = any(m.mode == "default" for m in meths)
    # (mode None: the drafter where one is known, none where none is)
    load_mode = "ddtree" if needs_drafter else None if default else "ar"
    target, runner = load_pair(model, drafter, load_mode, world=LOCAL)
    if not default:
        return target, runner, meths, None
    chosen = default_mode(target, runner, model)
    meths = [dataclasses.replace(m, mode=chosen.mode, lookup=None) if m.mode == "default"
             else m for m in meths]  # fmt: skip
    return target, runner, meths, chosen


def _default_ran(chosen, cfg: GenerationConfig, runner) -> dict | None:
    if chosen is None:
        return None
    ran = dataclasses.replace(cfg, mode=chosen.mode, budget=None, lookup=None)
    return {"ran": describe(ran, runner), "note": chosen.note}


def _dataset_names(datasets: str | list[str]) -> list[str]:
    names = [datasets] if isinstance(datasets, str) else datasets
    names = [n.strip() for x in names for n in x.split(",") if n.strip()]
    if not names:
        raise DFlashError("--dataset names no dataset.")
    return names


def _warm_up(meths, target, runner, ids: list[int], cfg: GenerationConfig, grammar, update):
    """Compile paths, allocate caches, measure the DDTree auto profile, build llguidance's view
    of the tokenizer, off the clock. A short prompt does (a long context's prefill would double
    a long-context run)."""
    warm = dataclasses.replace(cfg, max_tokens=min(cfg.max_tokens, WARMUP_TOKENS), grammar=grammar)
    for m in meths:
        if update:
            update(f"warming up {m.label}", 0)
        run_method(m, target, runner, ids[-64:], warm)


def _run_all(
    meths, target, runner, encoded: dict, grammars: dict, cfg: GenerationConfig, shared, update,
    repeat: int = 1,
):  # fmt: skip
    """Every method on every prompt: (runs by set and method, outputs by set, prompt, method).
    With `shared`, our engine's methods share one Session (one prefill) per prompt. A prompt
    with a grammar (grammars[set][i]) is answered under it by every method. With `repeat`,
    every method runs each prompt that many times, interleaved, and the run of median decode
    time stands for it (a slow phase of the machine during one run then moves nothing)."""
    if repeat < 1:
        raise DFlashError(f"--repeat must be at least 1, not {repeat}.")
    runs: dict[str, dict[str, list[Run]]] = {n: {m.label: [] for m in meths} for n in encoded}
    outputs: dict[str, list[dict[str, list[int]]]] = {n: [] for n in encoded}
    for name, prompts in encoded.items():
        for i, ids in enumerate(prompts):
            one = dataclasses.replace(cfg, grammar=grammars[name][i])
            tries: dict[str, list[Run]] = {m.label: [] for m in meths}
            for _ in range(repeat):
                session = Session(target, runner) if shared else None
                for m in meths:
                    tries[m.label].append(run_method(m, target, runner, ids, one, session))
                    if update:
                        update(f"{name} {i + 1}/{len(prompts)} {m.label}", 1)
            outputs[name].append({})
            for m in meths:
                run = sorted(tries[m.label], key=lambda r: r.t_decode)[(repeat - 1) // 2]
                runs[name][m.label].append(run)
                # Every repeat's answer is compared, not only the run that counts: one that
                # decoded otherwise stands for the prompt, so the check reports it.
                odd = (r.tokens for r in tries[m.label] if r.tokens != run.tokens)
                outputs[name][i][m.label] = next(odd, run.tokens)
                if isinstance(m.corpus, AnswerCorpus):  # --grow-corpus: for the next prompts
                    m.corpus.add([t for t in run.tokens if t not in cfg.stop_ids])
    return runs, outputs
