"""Answer JSON-schema prompts with a target, under each prompt's grammar, for its lookup corpus.

    .venv/bin/python training/answer_structured.py -m models/qwen2.5-coder-0.5b-instruct-f32 \
        --prompts training/data/coder05/structured_prompts.jsonl \
        --out training/data/coder05/structured_answers.jsonl

Greedy, with the chat template, as `bench --dataset structured` asks; every answer is the
target's own (the engine is exact, so the mode only sets the time it takes). Each line:
`{"id", "tokens", "text", "valid"}`, the corpus format (`{"tokens": [...]}`) plus what a reader
checks: `valid` is true when the answer ended with its grammar complete.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx)
from mlx_dflash import GenerationConfig, Session, encode_prompt, load_pair, stop_ids
from mlx_dflash.benchmark.runner import check_valid
from mlx_dflash.engine import generate_rounds
from mlx_dflash.engine.grammar import GrammarSpec
from mlx_dflash.prompt_files import read_records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-d", "--drafter", default=None)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=640)
    a = ap.parse_args()
    target, runner = load_pair(a.model, a.drafter)
    tok = target.tokenizer
    session = Session(target, runner)
    records = list(read_records(a.prompts))
    done = set()
    if a.out.exists():  # resume: answered ids are kept
        done = {json.loads(x)["id"] for x in a.out.read_text().splitlines() if x.strip()}
    with open(a.out, "a", encoding="utf-8") as f:
        for i, r in enumerate(records):
            if r["id"] in done:
                continue
            spec = GrammarSpec.json_schema(r["schema"])
            cfg = GenerationConfig(max_tokens=a.max_tokens, mode="ddtree", budget="auto",
                                   lookup=8, stop_ids=stop_ids(tok), grammar=spec)  # fmt: skip
            t0 = time.perf_counter()
            tokens: list[int] = []
            for rnd in generate_rounds(session, encode_prompt(tok, r["prompt"]), cfg):
                tokens += rnd.tokens
            valid = bool(check_valid(target, cfg, tokens))
            answer = [t for t in tokens if t not in cfg.stop_ids]
            f.write(json.dumps({"id": r["id"], "tokens": answer, "text": tok.decode(answer),
                                "valid": valid}) + "\n")  # fmt: skip
            f.flush()
            print(f"{i + 1}/{len(records)} {r['id']} {len(answer)} tokens "
                  f"{time.perf_counter() - t0:.1f}s valid={valid}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
