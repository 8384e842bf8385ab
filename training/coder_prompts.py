"""Build the fixed prompt list for drafter-training data on a code target
(Qwen2.5-Coder-0.5B-Instruct: training/data/coder05/README.md).

    .venv/bin/python training/coder_prompts.py --out training/data/coder05/coder_prompts.jsonl.gz
    .venv/bin/python training/coder_prompts.py --check   # the functions' examples pass

Four sources, each line `{"prompt", "source", "id"}`:

- `mbpp-validation`, `mbpp-train`: the sanitized MBPP tasks of the validation (511-600) and
  training (601-974) splits, with their first test. The `mbpp` bench set is the test split
  (ids 11-510) on the hub, and the local file puts the prompt (2-10) and test splits first, so
  a bench run with --limit reads none of these; the packaged `mixed` set uses test tasks too.
- `function`: HumanEval-style prompts written for this repo (`functions.jsonl` beside the list:
  a signature and a docstring with examples, the body left to the target; `solution` holds a
  reference body the examples were checked against).
- `sharegpt-code`: ShareGPT prompts of 20-1200 characters with a code signal (CODE below), in
  file order; `sharegpt`: plain chat, the first ones with no signal at all (CODE or SOFT).
  Like extend_prompts.py, none is in a bench set and none comes from a conversation a packaged
  bench set takes a turn from.

The held-out tail (--held-out, default 16: what `dflash-mlx train --eval-prompts 16` holds out)
is taken from every source in proportion; the rest is shuffled with --seed, so the list mixes
the sources throughout. (The trainer answers shortest prompts first whatever the order.)
"""

from __future__ import annotations

import argparse
import ast
import doctest
import gzip
import json
import random
import re
import sys
import types
from pathlib import Path

from extend_prompts import SHAREGPT, bench_texts  # training/ is the script's own folder

from mlx_dflash.errors import DFlashError
from mlx_dflash.prompt_files import read_records

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "training" / "data" / "coder05"
FUNCTIONS = DATA / "functions.jsonl"
MBPP = ROOT.parent / "shared" / "data" / "bench" / "mbpp_sanitized.json"
MBPP_SPLITS = {"mbpp-validation": range(511, 601), "mbpp-train": range(601, 975)}

# A prompt about code: a fence or inline code, a Python/JS keyword, or a language, tool or
# programming word ("script", "program", "method", "variable" and "compile" are not: in
# ShareGPT they are as often about films, TV, essays and maths). SOFT words lean technical
# without being about code, or are those ambiguous ones; chat has neither.
CODE = re.compile(
    r"```|`[^`\n]+`|\bdef \w+\(|\bclass \w+|\bimport \w+|\bc(\+\+|#)(?!\w)|"
    r"\b(python|javascript|typescript|java|golang|rust|kotlin|swift|php|ruby|"
    r"scala|haskell|perl|bash|powershell|sql|mysql|postgres\w*|sqlite|html|css|json|yaml|"
    r"regex|react|vue|angular|node\.?js|django|flask|fastapi|pandas|numpy|pytorch|"
    r"tensorflow|matlab|vba|excel formula|dockerfile|kubernetes|terraform|git|"
    r"code|coding|programming|compiler|debug|bug|error|exception|stack ?trace|api|"
    r"endpoint|algorithm|function|array|query|database|schema|snippet|unit tests?|"
    r"refactor)\b",
    re.I,
)
SOFT = re.compile(
    r"\b(software|app|website|web|server|cloud|aws|azure|linux|windows|computer|data|"
    r"model|machine learning|ai|chatgpt|gpt|prompt|tech|developer|engineer|script|"
    r"program|method|variable|compiled?)\b",
    re.I,
)


def function_prompt(solution: str) -> str:
    """A function's prompt from its reference code: every function or method with a
    docstring loses what follows the docstring (a class keeps its other lines; a helper
    without a docstring is given whole)."""
    lines = solution.splitlines(keepends=True)
    drop: set[int] = set()
    for node in ast.walk(ast.parse(solution)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            doc_end = node.body[0].end_lineno
            drop.update(range(doc_end, node.end_lineno))  # 0-based lines after the docstring
    return "".join(line for i, line in enumerate(lines) if i not in drop).rstrip() + "\n"


def check_functions(path: Path = FUNCTIONS) -> int:
    """Each function's examples pass on its reference code, and its prompt is that code
    without the bodies; returns how many failed."""
    bad = 0
    for f in read_records(path):
        module = types.ModuleType(f"coder05_{f['id']}")
        sys.modules[module.__name__] = module  # dataclasses look their module up
        try:
            exec(compile(f["solution"], module.__name__, "exec"), module.__dict__)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            for test in doctest.DocTestFinder(exclude_empty=True).find(module, module.__name__):
                runner.run(test, out=lambda s: None)
        finally:
            del sys.modules[module.__name__]
        failed = runner.failures if runner.tries else "no examples, so 0"
        if failed or function_prompt(f["solution"]) != f["prompt"]:
            bad += 1
            print(f"{f['id']} {f['entry_point']}: {failed} failed examples"
                  f"{'' if function_prompt(f['solution']) == f['prompt'] else ', prompt differs'}",
                  file=sys.stderr)  # fmt: skip
    return bad


def mbpp_prompts(path: Path = MBPP) -> list[dict]:
    out = []
    for task in read_records(path):
        for source, ids in MBPP_SPLITS.items():
            if task["task_id"] in ids:
                text = f"{task['prompt']}\nYour code should pass this test:\n{task['test_list'][0]}"
                out.append({"prompt": text, "source": source, "id": task["task_id"]})
    return out


def sharegpt_prompts(rows: list[dict], n_code: int, n_chat: int, exclude) -> list[dict]:
    """The first n_code code prompts and the first n_chat chat prompts (file order) of 20-1200
    characters, in no bench set, from no conversation a packaged set uses, none twice."""
    texts, convs = exclude
    seen = set(texts)
    code, chat = [], []
    for p in rows:
        text = p["prompt"]
        if not 20 <= len(text) <= 1200 or p["id"].rsplit("_", 1)[0] in convs:
            continue
        if text.strip() in seen:
            continue
        if CODE.search(text) and len(code) < n_code:
            code.append({"prompt": text, "source": "sharegpt-code", "id": p["id"]})
        elif not CODE.search(text) and not SOFT.search(text) and len(chat) < n_chat:
            chat.append({"prompt": text, "source": "sharegpt", "id": p["id"]})
        else:
            continue
        seen.add(text.strip())
    if len(code) < n_code or len(chat) < n_chat:
        raise SystemExit(f"Only {len(code)} code and {len(chat)} chat ShareGPT prompts qualify.")
    return code + chat


def build(sources: dict[str, list[dict]], held_out: int, seed: int) -> list[dict]:
    """Every source shuffled with `seed`, `held_out` prompts taken from their ends in
    proportion to their sizes (largest remainders first), the rest shuffled together, the
    held-out ones last."""
    rng = random.Random(seed)
    total = sum(len(ps) for ps in sources.values())
    shares = {s: held_out * len(ps) / total for s, ps in sources.items()}
    take = {s: int(x) for s, x in shares.items()}
    for s in sorted(shares, key=lambda s: take[s] - shares[s])[: held_out - sum(take.values())]:
        take[s] += 1
    train, held = [], []
    for s, ps in sources.items():
        ps = list(ps)
        rng.shuffle(ps)
        train += ps[: len(ps) - take[s]]
        held += ps[len(ps) - take[s] :]
    rng.shuffle(train)
    rng.shuffle(held)
    return train + held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, help="The list (.jsonl or .jsonl.gz).")
    ap.add_argument("--check", action="store_true", help="Check functions.jsonl and stop.")
    ap.add_argument("--code", type=int, default=910, help="ShareGPT code prompts.")
    ap.add_argument("--chat", type=int, default=300, help="ShareGPT chat prompts.")
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharegpt", type=Path, default=SHAREGPT)
    ap.add_argument("--mbpp", type=Path, default=MBPP)
    args = ap.parse_args()
    if args.check:
        bad = check_functions()
        print(f"{len(read_records(FUNCTIONS)) - bad} functions pass, {bad} fail")
        raise SystemExit(1 if bad else 0)
    if args.out is None:
        raise SystemExit("--out is needed (or --check).")
    try:
        funcs = read_records(FUNCTIONS)
        mbpp = mbpp_prompts(args.mbpp)
        rows = read_records(args.sharegpt)
    except DFlashError as e:
        raise SystemExit(str(e)) from None
    exclude = bench_texts()
    shared = sharegpt_prompts(rows, args.code, args.chat, exclude)
    sources = {"mbpp": mbpp, "function": [
        {"prompt": f["prompt"], "source": "function", "id": f["id"]} for f in funcs]}  # fmt: skip
    sources["sharegpt-code"] = [p for p in shared if p["source"] == "sharegpt-code"]
    sources["sharegpt"] = [p for p in shared if p["source"] == "sharegpt"]
    leaked = [p for ps in sources.values() for p in ps if p["prompt"].strip() in exclude[0]]
    if leaked:
        raise SystemExit(f"{len(leaked)} prompts are bench prompts, e.g. {leaked[0]['id']}.")
    out = build(sources, args.held_out, args.seed)
    text = "".join(json.dumps(p) + "\n" for p in out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix == ".gz":  # no name, mtime 0: the same list, the same bytes
        with open(args.out, "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as f:
            f.write(text.encode())
    else:
        args.out.write_text(text)
    counts = {s: len(ps) for s, ps in sources.items()}
    print(f"{len(out)} prompts ({len(out) - args.held_out} + {args.held_out} held out): {counts}")


if __name__ == "__main__":
    main()
