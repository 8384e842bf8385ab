"""Prompt sets on disk (JSONL, JSON, gzip, parquet) to prompt strings: one reader for bench,
train and anything else that takes a prompt file."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import DFlashError

# Fields tried, in order, for a record's prompt; chat records take their first turn.
PROMPT_FIELDS = ("prompt", "question", "problem", "instruction", "input", "text", "turns")
CHAT_FIELDS = ("conversations", "messages")


def read_records(path: Path) -> list[Any]:
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DFlashError(
                    f"Reading {path.name} needs pyarrow: pip install pyarrow."
                ) from None
            return pq.read_table(path).to_pylist()
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
        if name.endswith((".json", ".json.gz")):
            data = json.loads(text)
            return data if isinstance(data, list) else [data]
        # "\n" only: str.splitlines also breaks at U+2028 and other separators that JSON
        # strings may hold raw (ShareGPT has them).
        return [json.loads(line) for line in text.split("\n") if line.strip()]
    except (OSError, ValueError, UnicodeDecodeError, EOFError) as e:
        raise DFlashError(f"Could not read prompts from {path}: {e}.") from e


def prompt_of(record: Any, field: str | None = None, source: str = "the prompt file") -> str:
    """The prompt of one record: `field` when it has it, else the first known field holding
    text (a list holds turns: the first one)."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise DFlashError(f"{source} holds a {type(record).__name__}, not prompt records.")
    for key in ([field] if field in record else []) + [f for f in PROMPT_FIELDS if f in record]:
        value = record[key]
        if isinstance(value, list):  # multi-turn sets: the first turn
            value = value[0] if value else ""
        if isinstance(value, str) and value.strip():
            return value
    for key in CHAT_FIELDS:
        turns = record.get(key)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict):
            text = turns[0].get("value") or turns[0].get("content")
            if isinstance(text, str) and text.strip():
                return text
    raise DFlashError(
        f"{source} has records without any of the fields {', '.join(PROMPT_FIELDS + CHAT_FIELDS)}."
    )


def read_prompt_file(
    path: str | Path, field: str | None = None, keep: Callable[[Any], bool] | None = None
) -> list[str]:
    """Every non-empty prompt of a file (of the records `keep` accepts, when given)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DFlashError(f"The prompt file {path} does not exist.")
    records = [r for r in read_records(path) if keep is None or keep(r)]
    prompts = [prompt_of(r, field, str(path)) for r in records]
    return [p for p in prompts if p.strip()]
