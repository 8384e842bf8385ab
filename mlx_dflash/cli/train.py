"""`dflash-mlx train`: train a DFlash drafter for a target on prompts answered by the target
itself (the work is mlx_dflash.training; recipes in training/README.md)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from ..checkpoints.read import check_pair
from ..errors import DFlashError
from ..models.drafter import init_drafter, load_drafter, reshape_drafter
from ..training.checkpoint import load_checkpoint, saved_seen_tokens
from ..training.data import encode, load_records
from ..training.trainer import (
    TrainConfig,
    Trainer,
    answer,
    load_training_target,
    new_drafter_config,
    prepare_prompts,
)


def _parse_ints(s: str | None) -> list[int] | None:
    if not s:
        return None
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise DFlashError(f"Expected comma-separated integers, not '{s}'.") from None


def _eval_sets(specs: list[str]) -> list[tuple[str, list[str]]]:
    """NAME[:N] -> (NAME, its first N prompts)."""
    from ..benchmark.datasets import load_prompts

    out = []
    for spec in specs:
        name, _, n = spec.partition(":")
        try:
            limit = int(n) if n else 4
        except ValueError:
            raise DFlashError(f"--eval-set {spec}: N must be a whole number.") from None
        out.append((name, load_prompts(name, limit=limit)))
    return out


def _parse_floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise DFlashError(f"Expected comma-separated numbers, not '{s}'.") from None


def train_command(
    model: str = typer.Option(
        None, "--model", "-m", help="Target model folder (default: embedded stories260K)."
    ),
    data: list[Path] = typer.Option(
        [], "--data", help="Prompt JSONL file(s) (prompt/question/text field); repeatable."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder: checkpoint and data."),
    layers: int = typer.Option(
        None,
        "--layers",
        min=1,
        help="Drafter decoder layers (default 2). With --init: grow that drafter to N layers; "
        "the added ones start as identity, so step 0 drafts as --init does.",
    ),
    intermediate_size: int = typer.Option(
        None,
        "--intermediate-size",
        min=1,
        help="Drafter MLP width (default: the target's). With --init: widen that drafter's "
        "MLPs; the added units start with zero output weights, so step 0 drafts as --init does.",
    ),
    heads: int = typer.Option(None, "--heads", min=1, help="Drafter heads (default: target's)."),
    window: int = typer.Option(
        None, "--window", min=1, help="Sliding-window attention over the last N positions."
    ),
    taps: str = typer.Option(None, "--taps", help="Tapped target layers, e.g. 1,3."),
    block_size: int = typer.Option(
        None, "--block-size", min=2, help="Draft block (default 16; with --init: its own)."
    ),
    mask_token_id: int = typer.Option(None, "--mask-token-id", help="Default: unk/pad."),
    init: Path = typer.Option(None, "--init", help="Start from this drafter checkpoint."),
    steps: int = typer.Option(1000, "--steps", min=1),
    lr: float = typer.Option(1e-3, "--lr"),
    warmup: int = typer.Option(50, "--warmup", min=0),
    batch: int = typer.Option(8, "--batch", min=1, help="Sequences per step."),
    anchors: int = typer.Option(16, "--anchors", min=1, help="Blocks per sequence."),
    gamma: float = typer.Option(7.0, "--gamma", help="Loss decay over block slots."),
    max_len: int = typer.Option(512, "--max-len", help="Truncate sequences to this."),
    clip: float = typer.Option(1.0, "--clip", help="Gradient norm clip."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out."),
    eval_every: int = typer.Option(200, "--eval-every", min=0, help="0: only at the end."),
    eval_prompts: int = typer.Option(8, "--eval-prompts", min=0, help="Held-out prompts."),
    eval_tokens: int = typer.Option(96, "--eval-tokens", min=2),
    save_every: int = typer.Option(200, "--save-every", min=0),
    cache_taps: bool = typer.Option(
        None,
        "--cache-taps/--no-cache-taps",
        help="Keep the target's taps (and soft targets) on disk as it answers, and all taps in "
        "memory while training (default: if they fit in 2 GB).",
    ),
    loss_vocab: str = typer.Option(
        "full",
        "--loss-vocab",
        help="full, or corpus: softmax over the tokens the answers use plus --negatives "
        "random others (much faster with a large vocabulary).",
    ),
    negatives: int = typer.Option(1024, "--negatives", min=0, help="See --loss-vocab."),
    kl_weight: float = typer.Option(
        0.0,
        "--kl-weight",
        min=0.0,
        max=1.0,
        help="Distillation: weight of the target's own top-k distribution (kept while "
        "answering with --cache-taps) against the answer token in each slot's loss.",
    ),
    precondition: bool = typer.Option(
        True, "--precondition/--no-precondition", help="Scale tap features to equal size for fc."
    ),
    num_prompts: int = typer.Option(0, "--num-prompts", min=0, help="Use the first N (0: all)."),
    story_words: int = typer.Option(
        6, "--story-words", min=2, help="No --data, no chat template: openings of 2..N words."
    ),
    gen_temps: str = typer.Option("0,0.7", "--gen-temps", help="Answer temperatures, cycled."),
    gen_max_tokens: int = typer.Option(256, "--gen-max-tokens", min=1),
    gen_batch: int = typer.Option(32, "--gen-batch", min=1),
    gen_only: bool = typer.Option(False, "--gen-only", help="Only answer prompts, no training."),
    gen: bool = typer.Option(
        True, "--gen/--no-gen", help="--no-gen: train on the answers already in OUT, answer none."
    ),
    answers: list[Path] = typer.Option(
        [],
        "--answers",
        help="Another run's answers (answers.jsonl or .jsonl.gz) to train on too; repeatable.",
    ),
    eval_set: list[str] = typer.Option(
        [],
        "--eval-set",
        help="NAME[:N]: also measure tau on the first N (default 4) prompts of a bench set "
        "(gsm8k, humaneval, mt-bench, mixed, ... or a .jsonl file) at every evaluation; "
        "repeatable. The curve goes to OUT/curve.jsonl.",
    ),
    dequantize: bool = typer.Option(True, "--dequantize/--keep-quantized"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Train a DFlash drafter for a target on prompts answered by the target itself."""
    target = load_training_target(model, dequantize)
    prompts = prepare_prompts(target, data, out, num_prompts, seed, story_words)
    if eval_prompts >= len(prompts):
        raise DFlashError(f"Only {len(prompts)} prompts: fewer than --eval-prompts + 1.")
    train_prompts = prompts[: len(prompts) - eval_prompts]
    held_out = prompts[len(prompts) - eval_prompts :]
    for path in answers:
        if not path.is_file():
            raise DFlashError(f"--answers {path}: no such file.")
    sets = {name: [encode(target.tokenizer, p) for p in ps] for name, ps in _eval_sets(eval_set)}
    # The drafter comes first: its tapped layers are what answering keeps for training.
    opt_state, step, fresh, seen = None, 0, False, 0
    if resume and (out / "model.safetensors").exists():
        drafter, opt_state, step = load_checkpoint(out, target.num_layers)
        seen = saved_seen_tokens(out)
    elif init is not None:
        for flag, value in [("--taps", taps), ("--heads", heads), ("--window", window),
                            ("--mask-token-id", mask_token_id)]:  # fmt: skip
            if value is not None:
                raise DFlashError(f"{flag} shapes a new drafter; --init {init} keeps its own.")
        drafter = load_drafter(init, num_target_layers=target.num_layers)
        c = drafter.cfg
        old = (c.num_hidden_layers, c.block_size, c.intermediate_size)
        new = (layers or old[0], block_size or old[1], intermediate_size or old[2])
        if new != old:
            drafter = reshape_drafter(drafter, new[0], new[1], seed, intermediate_size=new[2])
    else:
        dcfg = new_drafter_config(
            target, layers or 2, _parse_ints(taps), block_size or 16, mask_token_id, heads, window,
            intermediate_size,
        )  # fmt: skip
        drafter = init_drafter(dcfg, seed=seed)
        fresh = True
    check_pair(drafter.cfg, target.config)
    tap_bytes = drafter.cfg.num_taps * target.hidden_size * 2  # per token, float16

    def taps_fit(n_tokens: int) -> bool:  # the default of --cache-taps: all of it under 2 GB
        return n_tokens * tap_bytes < 2**31

    shard = out / "answers.jsonl"
    if gen:
        temps = _parse_floats(gen_temps)
        keep = cache_taps
        if keep is None:
            keep = taps_fit(len(train_prompts) * (gen_max_tokens + 128))
        tap_ids = drafter.cfg.target_layer_ids if keep else None
        answer(target, train_prompts, shard, temps, gen_max_tokens, gen_batch, seed, tap_ids)
    elif not shard.exists():
        raise DFlashError(f"--no-gen needs answers in {shard}; run without it first.")
    if gen_only:
        typer.echo(f"Answers in {shard}")
        return
    cfg = TrainConfig(
        steps=steps,
        lr=lr,
        warmup=warmup,
        batch=batch,
        anchors=anchors,
        gamma=gamma,
        max_len=max_len,
        clip=clip,
        seed=seed,
        eval_every=eval_every,
        eval_tokens=eval_tokens,
        save_every=save_every,
        loss_vocab=loss_vocab,
        negatives=negatives,
        precondition=precondition,
        kl_weight=kl_weight,
    )
    records = load_records([shard, *answers], own=shard)
    if cache_taps is None:
        n_tok = sum(min(len(r["tokens"]), max_len) for r in records)
        cache_taps = taps_fit(n_tok)
    cfg.cache_taps = cache_taps
    trainer = Trainer(
        target,
        drafter,
        records,
        cfg,
        out=out,
        eval_prompts=[encode(target.tokenizer, p) for p in held_out],
        step=step,
        opt_state=opt_state,
        fresh=fresh,
        eval_sets=sets,
        seen_tokens=seen,
    )
    t0 = time.perf_counter()
    trainer.run()
    ev = trainer.evaluate()
    if ev is not None:
        typer.echo(
            f"final eval tau {ev['tau']:.2f} (per response {ev['tau_per_response']:.2f}) "
            f"over {len(held_out)} held-out prompts"
        )
    typer.echo(f"Trained {trainer.step} steps in {time.perf_counter() - t0:.0f}s; wrote {out}")
