"""`dflash-mlx train`: train a DFlash drafter for a target on prompts answered by the target
itself (the work is mlx_dflash.training; recipes in training/README.md)."""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import typer

from ..benchmark.datasets import eval_sets
from ..checkpoints.read import check_pair
from ..errors import DFlashError
from ..models.drafter import dflash2_config, init_drafter, load_drafter, reshape_drafter, to_dflash2
from ..progress import progress
from ..training.checkpoint import load_checkpoint
from ..training.data import answer_prompts, done_ids, encode, load_records
from ..training.trainer import (
    TrainConfig,
    Trainer,
    load_training_target,
    new_drafter_config,
    prepare_prompts,
)
from .options import panel


def _parse_numbers(s: str, kind: type = float, what: str = "numbers") -> list:
    try:
        return [kind(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise DFlashError(f"Expected comma-separated {what}, not '{s}'.") from None


# The command's options, one constant each, so its signature reads one line per option.
MODEL = typer.Option(
    None, "--model", "-m", help="Target model folder (default: embedded stories260K)."
)
DATA = typer.Option(
    [], "--data", help="Prompt JSONL file(s) (prompt/question/text field); repeatable."
)
OUT = typer.Option(..., "--out", "-o", help="Output folder: checkpoint and data.")
LAYERS = typer.Option(
    None,
    "--layers",
    min=1,
    help="Drafter decoder layers (default 2). With --init: grow that drafter to N layers; "
    "the added ones start as identity, so step 0 drafts as --init does.",
)
INTERMEDIATE_SIZE = typer.Option(
    None,
    "--intermediate-size",
    min=1,
    help="Drafter MLP width (default: the target's). With --init: widen that drafter's "
    "MLPs; the added units start with zero output weights, so step 0 drafts as --init does.",
)
HEADS = typer.Option(None, "--heads", min=1, help="Drafter heads (default: target's).")
WINDOW = typer.Option(
    None, "--window", min=1, help="Sliding-window attention over the last N positions."
)
TAPS = typer.Option(None, "--taps", help="Tapped target layers, e.g. 1,3.")
BLOCK_SIZE = typer.Option(
    None, "--block-size", min=2, help="Draft block (default 16; with --init: its own)."
)
MASK_TOKEN_ID = typer.Option(None, "--mask-token-id", help="Default: unk/pad.")
INIT = typer.Option(None, "--init", help="Start from this drafter checkpoint.")
ARCH = typer.Option(
    None,
    "--arch",
    help="dflash (default) or dflash2: DFlash 2's dynamic convolutions and candidate selector. "
    "With --init of a DFlash 1 drafter, dflash2 grows them so that step 0 drafts as --init does.",
)
SELECTOR_RANK = typer.Option(
    32, "--selector-rank", min=1, help="DFlash 2 codebook width (published: 256)."
)
SELECTOR_TOP_K = typer.Option(16, "--selector-top-k", min=1, help="DFlash 2 candidates a slot.")
STEPS = typer.Option(1000, "--steps", min=1)
LR = typer.Option(1e-3, "--lr")
WARMUP = typer.Option(50, "--warmup", min=0)
BATCH = typer.Option(8, "--batch", min=1, help="Sequences per step.")
ANCHORS = typer.Option(16, "--anchors", min=1, help="Blocks per sequence.")
GAMMA = typer.Option(7.0, "--gamma", help="Loss decay over block slots.")
MAX_LEN = typer.Option(512, "--max-len", help="Truncate sequences to this.")
CLIP = typer.Option(1.0, "--clip", help="Gradient norm clip.")
RESUME = typer.Option(False, "--resume", help="Continue from the checkpoint in --out.")
EVAL_EVERY = typer.Option(200, "--eval-every", min=0, help="0: only at the end.")
EVAL_PROMPTS = typer.Option(8, "--eval-prompts", min=0, help="Held-out prompts.")
EVAL_TOKENS = typer.Option(96, "--eval-tokens", min=2)
SAVE_EVERY = typer.Option(200, "--save-every", min=0)
CACHE_TAPS = typer.Option(
    None,
    "--cache-taps/--no-cache-taps",
    help="Keep the target's taps (and soft targets) on disk as it answers, and all taps in "
    "memory while training (default: if they fit in 2 GB).",
)
LOSS_VOCAB = typer.Option(
    "full",
    "--loss-vocab",
    help="full, or corpus: softmax over the tokens the answers use plus --negatives "
    "random others (much faster with a large vocabulary).",
)
NEGATIVES = typer.Option(1024, "--negatives", min=0, help="See --loss-vocab.")
KL_WEIGHT = typer.Option(
    0.0,
    "--kl-weight",
    min=0.0,
    max=1.0,
    help="Distillation: weight of the target's own top-k distribution (kept while "
    "answering with --cache-taps) against the answer token in each slot's loss.",
)
PRECONDITION = typer.Option(
    True, "--precondition/--no-precondition", help="Scale tap features to equal size for fc."
)
NUM_PROMPTS = typer.Option(0, "--num-prompts", min=0, help="Use the first N (0: all).")
STORY_WORDS = typer.Option(
    6, "--story-words", min=2, help="No --data, no chat template: openings of 2..N words."
)
GEN_TEMPS = typer.Option("0,0.7", "--gen-temps", help="Answer temperatures, cycled.")
GEN_MAX_TOKENS = typer.Option(256, "--gen-max-tokens", min=1)
GEN_BATCH = typer.Option(32, "--gen-batch", min=1)
GEN_ONLY = typer.Option(False, "--gen-only", help="Only answer prompts, no training.")
GEN = typer.Option(
    True, "--gen/--no-gen", help="--no-gen: train on the answers already in OUT, answer none."
)
ANSWERS = typer.Option(
    [],
    "--answers",
    help="Another run's answers (answers.jsonl or .jsonl.gz) to train on too; repeatable.",
)
EVAL_SET = typer.Option(
    [],
    "--eval-set",
    help="NAME[:N]: also measure tau on the first N (default 4) prompts of a bench set "
    "(gsm8k, humaneval, mt-bench, mixed, ... or a .jsonl file) at every evaluation; "
    "repeatable. The curve goes to OUT/curve.jsonl.",
)
DEQUANTIZE = typer.Option(True, "--dequantize/--keep-quantized")
SEED = typer.Option(0, "--seed")

panel("Target and data", MODEL, DATA, OUT, NUM_PROMPTS, STORY_WORDS, ANSWERS, DEQUANTIZE)
panel("Answers", GEN_TEMPS, GEN_MAX_TOKENS, GEN_BATCH, GEN_ONLY, GEN, CACHE_TAPS)
panel(
    "Drafter",
    LAYERS, INTERMEDIATE_SIZE, HEADS, WINDOW, TAPS, BLOCK_SIZE, MASK_TOKEN_ID, INIT, ARCH,
    SELECTOR_RANK, SELECTOR_TOP_K, PRECONDITION,
)  # fmt: skip
panel(
    "Optimisation",
    STEPS, LR, WARMUP, BATCH, ANCHORS, GAMMA, MAX_LEN, CLIP, LOSS_VOCAB, NEGATIVES, KL_WEIGHT,
    SEED, RESUME,
)  # fmt: skip
panel("Evaluation and checkpoints", EVAL_EVERY, EVAL_PROMPTS, EVAL_TOKENS, EVAL_SET, SAVE_EVERY)


def train_command(
    model: str = MODEL,
    data: list[Path] = DATA,
    out: Path = OUT,
    layers: int = LAYERS,
    intermediate_size: int = INTERMEDIATE_SIZE,
    heads: int = HEADS,
    window: int = WINDOW,
    taps: str = TAPS,
    block_size: int = BLOCK_SIZE,
    mask_token_id: int = MASK_TOKEN_ID,
    init: Path = INIT,
    arch: str = ARCH,
    selector_rank: int = SELECTOR_RANK,
    selector_top_k: int = SELECTOR_TOP_K,
    steps: int = STEPS,
    lr: float = LR,
    warmup: int = WARMUP,
    batch: int = BATCH,
    anchors: int = ANCHORS,
    gamma: float = GAMMA,
    max_len: int = MAX_LEN,
    clip: float = CLIP,
    resume: bool = RESUME,
    eval_every: int = EVAL_EVERY,
    eval_prompts: int = EVAL_PROMPTS,
    eval_tokens: int = EVAL_TOKENS,
    save_every: int = SAVE_EVERY,
    cache_taps: bool = CACHE_TAPS,
    loss_vocab: str = LOSS_VOCAB,
    negatives: int = NEGATIVES,
    kl_weight: float = KL_WEIGHT,
    precondition: bool = PRECONDITION,
    num_prompts: int = NUM_PROMPTS,
    story_words: int = STORY_WORDS,
    gen_temps: str = GEN_TEMPS,
    gen_max_tokens: int = GEN_MAX_TOKENS,
    gen_batch: int = GEN_BATCH,
    gen_only: bool = GEN_ONLY,
    gen: bool = GEN,
    answers: list[Path] = ANSWERS,
    eval_set: list[str] = EVAL_SET,
    dequantize: bool = DEQUANTIZE,
    seed: int = SEED,
) -> None:
    """Train a DFlash drafter for a target on prompts answered by the target itself."""
    a = SimpleNamespace(**locals())  # what the command was told, for the steps below
    _check_flags(a)
    target = load_training_target(model, dequantize)
    prompts = prepare_prompts(target, data, out, num_prompts, seed, story_words)
    if eval_prompts >= len(prompts):
        raise DFlashError(f"Only {len(prompts)} prompts: fewer than --eval-prompts + 1.")
    train_prompts = prompts[: len(prompts) - eval_prompts]
    held_out = prompts[len(prompts) - eval_prompts :]
    sets = {name: [encode(target.tokenizer, p) for p in ps] for name, ps in eval_sets(eval_set)}
    # The drafter comes first: its tapped layers are what answering keeps for training.
    drafter, opt_state, step, seen, fresh = _starting_drafter(target, a)
    check_pair(drafter.cfg, target.config)
    shard = _answer_prompts(target, drafter, train_prompts, a)
    if gen_only:
        typer.echo(f"Answers in {shard}")
        return
    records = load_records([shard, *answers], own=shard)
    names = {f.name for f in fields(TrainConfig)}  # (--cache-taps's default is settled below)
    cfg = TrainConfig(**{k: v for k, v in vars(a).items() if k in names})
    if cache_taps is None:
        n_tok = sum(min(len(r["tokens"]), max_len) for r in records)
        cfg.cache_taps = _taps_fit(drafter, target, n_tok)
    held = [encode(target.tokenizer, p) for p in held_out]
    trainer = Trainer(target, drafter, records, cfg, out=out, eval_prompts=held, step=step,
                      opt_state=opt_state, fresh=fresh, eval_sets=sets, seen_tokens=seen)  # fmt: skip
    t0 = time.perf_counter()
    trainer.run()
    ev = trainer.evaluate()
    if ev is not None:
        typer.echo(
            f"final eval tau {ev['tau']:.2f} (per response {ev['tau_per_response']:.2f}) "
            f"over {len(held_out)} held-out prompts"
        )
    typer.echo(f"Trained {trainer.step} steps in {time.perf_counter() - t0:.0f}s; wrote {out}")


def _check_flags(a: SimpleNamespace) -> None:
    """Refuse what needs no target to refuse, before the (slow) target loads."""
    if a.arch not in (None, "dflash", "dflash2"):
        raise DFlashError(f"--arch must be dflash or dflash2, not '{a.arch}'.")
    for path in a.answers:
        if not path.is_file():
            raise DFlashError(f"--answers {path}: no such file.")


def _answer_prompts(target, drafter, prompts: list[str], a: SimpleNamespace) -> Path:
    """The target's answers to `prompts` in OUT/answers.jsonl, with a progress bar: those not
    yet there are answered (with --no-gen, all must be), keeping the taps the drafter reads
    where they fit (see `answer_prompts`)."""
    shard = a.out / "answers.jsonl"
    if not a.gen:
        if not shard.exists():
            raise DFlashError(f"--no-gen needs answers in {shard}; run without it first.")
        return shard
    keep = a.cache_taps
    if keep is None:
        keep = _taps_fit(drafter, target, len(prompts) * (a.gen_max_tokens + 128))
    temps = _parse_numbers(a.gen_temps)
    done = len(done_ids(shard) & set(range(len(prompts))))
    with progress(info=True, show=True, transient=False) as bar:
        task = bar.add_task("answer", total=len(prompts), completed=done, info="")
        answer_prompts(
            target,
            prompts,
            shard,
            temps=temps,
            max_tokens=a.gen_max_tokens,
            batch=a.gen_batch,
            seed=a.seed,
            on_batch=lambda k: bar.advance(task, k),
            tap_ids=drafter.cfg.target_layer_ids if keep else None,
        )
    return shard


def _taps_fit(drafter, target, n_tokens: int) -> bool:
    """The default of --cache-taps: all taps of n_tokens in float16 under 2 GB."""
    return n_tokens * drafter.cfg.num_taps * target.hidden_size * 2 < 2**31


def _starting_drafter(target, a: SimpleNamespace):
    """(drafter, optimizer state, step, tokens seen, fresh): resumed from --out, grown from
    --init, or new."""
    if a.resume and (a.out / "model.safetensors").exists():
        return (*load_checkpoint(a.out, target.num_layers), False)
    if a.init is not None:
        for flag, value in [("--taps", a.taps), ("--heads", a.heads), ("--window", a.window),
                            ("--mask-token-id", a.mask_token_id)]:  # fmt: skip
            if value is not None:
                raise DFlashError(f"{flag} shapes a new drafter; --init {a.init} keeps its own.")
        drafter = load_drafter(a.init, num_target_layers=target.num_layers)
        c = drafter.cfg
        old = (c.num_hidden_layers, c.block_size, c.intermediate_size)
        new = (a.layers or old[0], a.block_size or old[1], a.intermediate_size or old[2])
        if new != old:
            drafter = reshape_drafter(drafter, new[0], new[1], a.seed, intermediate_size=new[2])
        if a.arch == "dflash" and c.kind == "dflash2":
            raise DFlashError(
                f"--init {a.init} is a DFlash 2 drafter; it cannot lose its selector."
            )
        if a.arch == "dflash2" and c.kind == "dflash":
            drafter = to_dflash2(drafter, a.selector_rank, a.selector_top_k, seed=a.seed)
        return drafter, None, 0, 0, False
    taps = _parse_numbers(a.taps, int, "integers") if a.taps else None
    dcfg = new_drafter_config(
        target, a.layers or 2, taps, a.block_size or 16, a.mask_token_id, a.heads, a.window,
        a.intermediate_size,
    )  # fmt: skip
    if a.arch == "dflash2":
        dcfg = dflash2_config(dcfg, a.selector_rank, a.selector_top_k)
    return init_drafter(dcfg, seed=a.seed), None, 0, 0, True
