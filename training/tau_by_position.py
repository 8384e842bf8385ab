"""Tau by position in the answer: real DFlash decoding against the training forward's blocks.

    .venv/bin/python training/tau_by_position.py -m TARGET --drafter DIR \
        --prompts OUT/prompts.jsonl --last 16 --max-tokens 256 [--buckets 0,48,128,256]
    (--prompts also takes a bench set name: gsm8k, humaneval, mt-bench, mixed, ...;
    --skip N --first M then picks prompts N..N+M, e.g. past the ones the trainer evaluates on)

Why: the trainer's evaluation decodes only the first 48 tokens of a few held-out answers,
while its batches draw anchors anywhere in answers of up to 256 tokens, and the two disagree
(held-out decoding tau ~1.25 against block tau ~1.5 on answers not yet trained on). This
decodes whole answers greedily with the real engine (so the text is the target's own), then
runs the training forward (`drafter_blocks`: many blocks in one batched pass) over the same
tokens at every anchor, and reports both by position bucket:
- "decoded": tau of the engine's rounds, by where each round starts;
- "forced, decode anchors": the training forward at exactly those round starts. It must equal
  "decoded" (the same drafter on the same context); a gap would be a train/inference mismatch;
- "forced, every anchor": the training forward at every position, as the batches see them.
"""

from __future__ import annotations

import argparse
import sys

# isort: off
import mlx_dflash  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_dflash.benchmark.datasets import load_prompts
from mlx_dflash.errors import DFlashError
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.models.drafter import DrafterRunner, drafter_logits, load_drafter
from mlx_dflash.models.target import load_target
from mlx_dflash.prompts import stop_ids
from mlx_dflash.training.data import encode
from mlx_dflash.training.forward import drafter_blocks, target_taps
# isort: on


def decode(target, drafter, ids: list[int], max_tokens: int):
    """The answer's tokens and (anchor offset, accepted, not the last round) of every DFlash round."""
    cfg = GenerationConfig(
        max_tokens=max_tokens, mode="dflash", stop_ids=stop_ids(target.tokenizer)
    )
    session = Session(target, DrafterRunner(drafter, target))
    out, rounds = [], []
    for rnd in generate_rounds(session, ids, cfg):
        if not rnd.prefill:
            # The round's block starts at the last committed token (answer offset len(out)-1).
            rounds.append((len(out) - 1, rnd.accepted, rnd.finished is None))
        out.extend(rnd.tokens)
    return out, rounds


def forced_accepts(target, drafter, ids: list[int], answer: list[int]) -> np.ndarray:
    """Accepted length (drafts matched + 1) of the block at every answer offset, teacher-forced.

    Offsets whose block would run past the answer's end are -1 (not comparable)."""
    cfg = drafter.cfg
    bs = cfg.block_size
    seq = ids + answer
    P = len(ids)
    tokens = mx.array(seq)[None]
    taps = target_taps(target, tokens)
    vocab = (
        mx.array(drafter.draft_vocab.astype(np.int32)) if drafter.draft_vocab is not None else None
    )
    out = np.full(len(answer), -1, dtype=np.int64)
    offsets = np.arange(0, len(answer) - bs + 1)
    for lo in range(0, len(offsets), 64):
        chunk = offsets[lo : lo + 64]
        anchors = mx.array(P + chunk)[None]
        h = drafter_blocks(drafter, target, taps, tokens, anchors)
        logits = drafter_logits(cfg, target, h[:, :, 1:], vocab)
        pred = mx.argmax(logits, axis=-1)
        if vocab is not None:
            pred = vocab[pred]
        labels = mx.array(np.stack([seq[P + o + 1 : P + o + bs] for o in chunk]))[None]
        hits = (pred == labels).astype(mx.int32)
        acc = mx.cumprod(hits, axis=-1).sum(axis=-1) + 1
        out[chunk] = np.array(acc[0])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True, help="a prompt file or a bench set name")
    ap.add_argument("--last", type=int, help="the last N prompts (a train run's held-out split)")
    ap.add_argument("--skip", type=int, default=0, help="with --first: prompts skipped first")
    ap.add_argument("--first", type=int, help="the first N prompts (after --skip)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--buckets", default="0,48,128,256", help="answer-offset bucket edges")
    args = ap.parse_args(argv)
    try:
        target = load_target(args.model)
        drafter = load_drafter(args.drafter, num_target_layers=target.num_layers)
        prompts = load_prompts(args.prompts)
    except DFlashError as e:  # one sentence, as the CLI ends bad input
        raise SystemExit(str(e)) from None
    target.set_taps(drafter.cfg.target_layer_ids)
    if args.last:
        prompts = prompts[-args.last :]
    else:
        prompts = prompts[args.skip : args.skip + args.first if args.first else None]
    edges = [int(x) for x in args.buckets.split(",")]
    names = [f"[{a},{b})" for a, b in zip(edges, edges[1:], strict=False)]
    dec = {n: [] for n in names}
    fdec = {n: [] for n in names}
    fall = {n: [] for n in names}
    mismatched = 0

    def bucket(o: int) -> str | None:
        for n, a, b in zip(names, edges, edges[1:], strict=False):
            if a <= o < b:
                return n
        return None

    for i, p in enumerate(prompts):
        ids = encode(target.tokenizer, p)
        answer, rounds = decode(target, drafter, ids, args.max_tokens)
        forced = forced_accepts(target, drafter, ids, answer)
        for o, acc, whole in rounds:
            b = bucket(o)
            # Rounds cut short by the answer's end (max tokens, stop) are not comparable.
            if b is None or not whole or forced[o] < 0:
                continue
            dec[b].append(acc)
            fdec[b].append(int(forced[o]))
            mismatched += int(forced[o] != acc)
        for o, acc in enumerate(forced):
            b = bucket(o)
            if b is not None and acc > 0:
                fall[b].append(int(acc))
        print(
            f"prompt {i + 1}/{len(prompts)}: {len(answer)} tokens, {len(rounds)} rounds", flush=True
        )

    def fmt(xs):
        return f"{np.mean(xs):.2f} ({len(xs)})" if xs else "-"

    print(f"\n{args.drafter}: tau by answer offset (count), {len(prompts)} prompts")
    print("| offset | decoded | forced, decode anchors | forced, every anchor |")
    print("|---|---|---|---|")
    for n in names:
        print(f"| {n} | {fmt(dec[n])} | {fmt(fdec[n])} | {fmt(fall[n])} |")
    alld = [x for n in names for x in dec[n]]
    allf = [x for n in names for x in fall[n]]
    print(f"| all | {fmt(alld)} | {fmt([x for n in names for x in fdec[n]])} | {fmt(allf)} |")
    print(f"rounds where the forced block differs from the decoded one: {mismatched}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
