"""Published target -> z-lab DFlash drafter pairs, so `--model Qwen/Qwen3-8B` needs no --drafter."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import DFlashError

DRAFTERS: dict[str, str] = {
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash",
    "Qwen/Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash",
    "Qwen/Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen/Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash",
    "Qwen/Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "moonshotai/Kimi-K2.5": "z-lab/Kimi-K2.5-DFlash",
}

# Re-quantised copies (mlx-community/Qwen3-8B-4bit, ...) share the base model's drafter.
_SUFFIX = re.compile(r"(-(mlx|MLX|\d+bit|bf16|fp16|float16|DWQ|dwq|q\d|Q\d\w*))+$")


def base_name(model: str) -> str:
    return _SUFFIX.sub("", Path(model.rstrip("/")).name).lower()


def find_drafter(model: str) -> str:
    """The drafter id for a target id or folder name; a clear error when none is known."""
    name = base_name(model)
    for target, drafter in DRAFTERS.items():
        if base_name(target) == name:
            return drafter
    raise DFlashError(f"No published DFlash drafter is known for '{model}'; pass --drafter.")
