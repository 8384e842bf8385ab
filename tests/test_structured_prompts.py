"""training/structured_prompts.py: the committed JSON-schema prompts are the script's, none is
a bench prompt, and the committed answers (the coder's lookup corpus) are valid and are theirs."""

import gzip
import importlib.util
import json
from pathlib import Path

from mlx_dflash.benchmark.datasets import PACKAGED
from mlx_dflash.engine.grammar import GrammarSpec
from mlx_dflash.paths import ASSETS
from mlx_dflash.prompt_files import read_records

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "training" / "data" / "coder05"
spec = importlib.util.spec_from_file_location(
    "structured_prompts", ROOT / "training" / "structured_prompts.py"
)
structured_prompts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(structured_prompts)


def test_committed_prompts_are_the_scripts_and_none_is_a_bench_prompt():
    committed = list(read_records(DATA / "structured_prompts.jsonl"))
    assert committed == structured_prompts.build(len(committed), 0)
    bench = list(read_records(PACKAGED["structured"]))
    assert not {r["prompt"] for r in committed} & {b["prompt"] for b in bench}
    assert all(r["schema"] != b["schema"] for r in committed for b in bench)
    assert len({r["kind"] for r in committed}) == len(structured_prompts.KINDS)
    for r in committed:
        GrammarSpec.json_schema(r["schema"])  # each one is a schema the engine takes


def test_the_coder_corpus_holds_the_valid_answers_to_them():
    with gzip.open(DATA / "structured_answers.jsonl.gz", "rt") as f:
        answers = [json.loads(x) for x in f]
    ids = [r["id"] for r in read_records(DATA / "structured_prompts.jsonl")]
    assert [a["id"] for a in answers] == ids and all(a["valid"] for a in answers)
    for a in answers:
        json.loads(a["text"])
    shipped = ASSETS / "qwen2.5-coder-0.5b-instruct-dflash" / "lookup-corpus.jsonl.gz"
    with gzip.open(shipped, "rt") as f:
        tails = [json.loads(x)["tokens"] for x in f][-len(answers) :]
    assert tails == [a["tokens"] for a in answers]
