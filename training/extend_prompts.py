"""Add a chunk of new ShareGPT prompts to a drafter-training prompt list, keeping every id.

    .venv/bin/python training/extend_prompts.py LIST.jsonl[.gz] --add N --out NEW.jsonl

Answering is the slow part of the drafter recipe (~20 prompts a minute on 2 cores), so the data
grows a chunk per session. `dflash-mlx train` numbers answers by their line in the prompt list
and holds out its last lines, so the new list keeps the old training prompts at the same lines,
puts the N new ones after them and the held-out tail (--held-out, default 16) last. The old
run's answers and stored taps then stay valid in a run on the new list (same ids), and the
held-out prompts stay the same.

New prompts: the next N ShareGPT prompts of 20-1200 characters in file order that the list
does not have (by id or text), no bench set contains and no packaged bench set takes a turn of
the same conversation from, shuffled with --seed so a partly answered chunk is not all of one
conversation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from mlx_dflash.benchmark.datasets import PACKAGED, load_prompts
from mlx_dflash.errors import DFlashError
from mlx_dflash.prompt_files import read_records

ROOT = Path(__file__).resolve().parents[1]

SHAREGPT = ROOT.parent / "shared" / "data" / "train" / "sharegpt_prompts.jsonl"


def bench_texts() -> tuple[set[str], set[str]]:
    """Every prompt of the bench sets this repo measures on, and the ShareGPT conversations the
    packaged sets take prompts from: none may be trained on."""
    convs = {
        p["id"].rsplit("_", 1)[0]
        for path in PACKAGED.values()
        for p in read_records(path)
        if p.get("source") == "sharegpt"
    }
    texts = set()
    for name in ("gsm8k", "humaneval", "mt-bench", "mixed", "mbpp", "math500"):
        try:
            texts.update(p.strip() for p in load_prompts(name))
        except DFlashError as e:  # a set absent here cannot leak into training either
            print(f"note: bench set {name} not read ({e})", file=sys.stderr)
    return texts, convs


def extend(old: list[dict], sharegpt: list[dict], add: int, held_out: int, seed: int,
           exclude: tuple[set[str], set[str]]) -> list[dict]:  # fmt: skip
    texts, convs = exclude
    have_ids = {(p.get("source"), p.get("id")) for p in old}
    have_text = {p["prompt"].strip() for p in old} | texts
    new = []
    for p in sharegpt:
        text = p["prompt"]
        if not 20 <= len(text) <= 1200 or ("sharegpt", p["id"]) in have_ids:
            continue
        if p["id"].rsplit("_", 1)[0] in convs:
            continue
        if text.strip() in have_text:
            continue
        have_text.add(text.strip())
        new.append({"prompt": text, "source": "sharegpt", "id": p["id"]})
        if len(new) == add:
            break
    if len(new) < add:
        raise SystemExit(f"Only {len(new)} new ShareGPT prompts are left; asked for {add}.")
    random.Random(seed).shuffle(new)
    return old[: len(old) - held_out] + new + old[len(old) - held_out :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("old", type=Path, help="The current list (mix_prompts.jsonl or .jsonl.gz).")
    ap.add_argument("--add", type=int, required=True, help="New prompts to add.")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharegpt", type=Path, default=SHAREGPT)
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; not overwriting it.")
    try:
        old, sharegpt = read_records(args.old), read_records(args.sharegpt)
    except DFlashError as e:
        raise SystemExit(str(e)) from None
    new = extend(old, sharegpt, args.add, args.held_out, args.seed, bench_texts())
    args.out.write_text("".join(json.dumps(p) + "\n" for p in new))
    print(f"{len(old)} -> {len(new)} prompts ({args.add} new) in {args.out}")


if __name__ == "__main__":
    main()
