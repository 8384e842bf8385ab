"""The benchmark prompt sets: the standard speculative-decoding sets by name (from
../shared/data/bench, --data-dir or the hub) or any prompt file."""

from __future__ import annotations

from pathlib import Path

from ..errors import DFlashError
from ..prompt_files import read_prompt_file, read_records
from ..settings import SETTINGS

# name -> (local file under --data-dir, field holding the prompt)
DATASETS: dict[str, tuple[str, str]] = {
    "humaneval": ("HumanEval.jsonl.gz", "prompt"),
    "gsm8k": ("gsm8k_test.jsonl", "question"),
    "math500": ("math500_test.jsonl", "problem"),
    "mbpp": ("mbpp_sanitized.json", "prompt"),
    "mt-bench": ("mt_bench_question.jsonl", "turns"),
}
# A set's test split, for files holding more: the sanitized MBPP file holds every split; the
# hub's parquet (below) is its test split, tasks 11-510, which this keeps whole. Past its first 264 records the file reaches the train and validation tasks the
# shipped Qwen2.5-Coder drafter was trained on (training/README.md).
TEST_SPLIT = {"mbpp": lambda r: isinstance(r, dict) and 11 <= int(r.get("task_id", 0)) <= 510}
# Where the same sets live on the Hugging Face hub, for machines without ../shared.
HUB_DATASETS: dict[str, tuple[str, str]] = {
    "humaneval": ("openai/openai_humaneval", "openai_humaneval/test-00000-of-00001.parquet"),
    "gsm8k": ("openai/gsm8k", "main/test-00000-of-00001.parquet"),
    "math500": ("HuggingFaceH4/MATH-500", "test.jsonl"),
    "mbpp": ("google-research-datasets/mbpp", "sanitized/test-00000-of-00001.parquet"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", "raw/question.jsonl"),
}


def default_data_dir() -> Path | None:
    """$DFLASH_SHARED/data/bench, else the repo's ../shared/data/bench, when it exists."""
    roots = [SETTINGS.shared, Path(__file__).resolve().parents[3] / "shared"]
    for root in roots:
        if root and (Path(root) / "data" / "bench").is_dir():
            return Path(root) / "data" / "bench"
    return None


def _hub_file(name: str) -> Path:
    from huggingface_hub import hf_hub_download

    repo, filename = HUB_DATASETS[name]
    try:
        return Path(hf_hub_download(repo, filename, repo_type="dataset"))
    except Exception as e:  # offline, DNS, gated, moved: the user's remedy is the same
        raise DFlashError(
            f"The {name} prompts are not on this machine (no --data-dir, no ../shared/data/bench) "
            f"and could not be fetched from the Hugging Face hub ({repo}); pass --data-dir."
        ) from e


# Sets written for this project, shipped in the package.
PACKAGED: dict[str, Path] = {
    # Code edits, quotes, corrections, conversions and chat turns that repeat earlier text:
    # where prompt lookup (--mode lookup, ddtree+lookup) should pay.
    "copy": Path(__file__).parent / "data" / "copy_heavy.jsonl",
    # Chat, code and math in turn (ShareGPT prompts from the end of the file, MBPP test tasks,
    # MATH-500), none of them in any training data of the shipped drafters: does a drafter
    # generalise?
    "mixed": Path(__file__).parent / "data" / "mixed.jsonl",
    # Structured output (issue 31): extraction into a schema, function arguments, nested
    # objects; each line carries the JSON schema its answer must follow.
    "structured": Path(__file__).parent / "data" / "structured.jsonl",
    # Story openings in TinyStories' style: the home ground of the embedded stories260K pair
    # (a 1 MB model knows nothing else; its tau on GSM8K says nothing about the engine).
    "stories": Path(__file__).parent / "data" / "stories.jsonl",
}


def load_grammars(dataset: str, count: int) -> list:
    """Per prompt of a set, the grammar its answer must follow (a line's "schema"), or None:
    only sets whose lines carry schemas (the packaged `structured`, or such a .jsonl) have any."""
    from ..engine.grammar import GrammarSpec

    path = PACKAGED.get(dataset) or Path(dataset).expanduser()
    if dataset in DATASETS or not path.is_file() or path.suffix != ".jsonl":
        return [None] * count
    specs = []
    for r in read_records(path):
        text = r.get("prompt") if isinstance(r, dict) else None
        if isinstance(text, str) and text.strip():
            schema = r.get("schema")
            specs.append(GrammarSpec.json_schema(schema) if isinstance(schema, dict) else None)
    return specs[:count]


def load_prompts(dataset: str, data_dir: str | Path | None = None, limit: int | None = None):
    """The prompts of a named set (from `data_dir`, else the hub) or of a .jsonl/.json file."""
    if dataset in PACKAGED:
        path, field = PACKAGED[dataset], "prompt"
    elif dataset in DATASETS:
        filename, field = DATASETS[dataset]
        folder = Path(data_dir) if data_dir is not None else default_data_dir()
        if folder is not None:
            path = folder / filename
            if not path.is_file():
                raise DFlashError(f"{path} does not exist (the {dataset} prompts).")
        else:
            path = _hub_file(dataset)
    else:
        path, field = Path(dataset).expanduser(), None
        if not path.is_file():
            names = ", ".join([*DATASETS, *PACKAGED])
            raise DFlashError(f"Unknown dataset '{dataset}': use one of {names} or a .jsonl file.")
    prompts = read_prompt_file(path, field, TEST_SPLIT.get(dataset))
    if not prompts:
        raise DFlashError(f"{path} holds no prompts.")
    return prompts[:limit] if limit else prompts


def eval_sets(specs: list[str]) -> list[tuple[str, list[str]]]:
    """NAME[:N] -> (NAME, its first N prompts): the per-set evaluations of `train --eval-set`
    and training/eval_checkpoints.py."""
    out = []
    for spec in specs:
        name, _, n = spec.partition(":")
        try:
            limit = int(n) if n else 4
        except ValueError:
            raise DFlashError(f"--eval-set {spec}: N must be a whole number.") from None
        out.append((name, load_prompts(name, limit=limit)))
    return out
