"""Published target -> z-lab DFlash drafter pairs, so `--model Qwen/Qwen3-8B` needs no --drafter.

Users rarely pass the exact upstream id: they pass re-quantised copies (mlx-community/Qwen3-8B-4bit,
Qwen/Qwen3-8B-MLX-bf16, Meta-Llama-3.1-8B-Instruct-4bit) or a local folder named after one. Those
share the base model's weights up to quantisation, hence its drafter, so lookups compare
normalised base names rather than ids.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import DFlashError
from ..paths import ASSETS

DRAFTERS: dict[str, str] = {
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash",
    "Qwen/Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash",
    "Qwen/Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen/Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash",
    "Qwen/Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    # DFlash 2 drafters (models/dflash2.py): a candidate selector over the block.
    "Qwen/Qwen3.8-27B": "z-lab/Qwen3.8-27B-DFlash2",
    "meta-models/Muse-Glimmer-30B": "z-lab/Muse-Glimmer-30B-DFlash2",
    # About a trillion parameters: several Macs (mlx.launch, README "Several Macs").
    "moonshotai/Kimi-K2.5": "z-lab/Kimi-K2.5-DFlash",
}

# Drafters trained here (`dflash-mlx train`, training/README.md), shipped in mlx_dflash/assets.
SHIPPED: dict[str, str] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct-dflash",
}

# Trailing tags that re-quantised or re-packaged copies add to the base model's name:
# -MLX, -4bit, -bf16, -DWQ, -4bit-DWQ-053125, -mxfp4, -q4_K_M, ...
_TAG = (
    r"mlx|\d+bit|\d+-bit|bf16|fp16|fp32|float16|float32|f16|f32|dwq|awq|gptq|mxfp\d|nvfp\d"
    r"|q\d(_[a-z0-9]+)*|v\d+|\d{6}"
)
_SUFFIX = re.compile(rf"([-_.]({_TAG}))+$", re.IGNORECASE)
# mlx-community calls Llama 3.1 "Meta-Llama-3.1-8B-Instruct".
_PREFIX = re.compile(r"^meta-(?=llama)", re.IGNORECASE)


def base_name(model: str | Path) -> str:
    """The lower-case model name without org, quantisation tags or packaging prefixes."""
    name = Path(str(model).rstrip("/")).name
    return _PREFIX.sub("", _SUFFIX.sub("", name)).lower()


def known_drafters() -> dict[str, str]:
    """Target id -> drafter hub id, or the folder of a drafter shipped with the package."""
    return {**DRAFTERS, **{t: str(ASSETS / d) for t, d in SHIPPED.items()}}


def find_drafter(model: str | Path) -> str:
    """The drafter id (or shipped folder) for a target id or folder name; else a clear error."""
    known = known_drafters()
    for target, drafter in known.items():
        if str(model).lower() == target.lower():
            return drafter
    name = base_name(model)
    for target, drafter in known.items():
        if base_name(target) == name:
            return drafter
    raise DFlashError(f"No published DFlash drafter is known for '{model}'; pass --drafter.")
