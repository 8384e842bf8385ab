"""Published target -> drafter pairs, so `--model Qwen/Qwen3-8B` needs no --drafter, and
`dflash-mlx models` can say which of them this build runs.

Users rarely pass the exact upstream id: they pass re-quantised copies (mlx-community/Qwen3-8B-4bit,
Qwen/Qwen3-8B-MLX-bf16, Meta-Llama-3.1-8B-Instruct-4bit) or a local folder named after one. Those
share the base model's weights up to quantisation, hence its drafter, so lookups compare
normalised base names rather than ids.

Whether a pair runs is never written down here: `refusal` asks the code that loads targets
(models/families.py ARCHITECTURES) and drafters (models/drafter_config.py) at call time, so a
family added there flips its rows without an edit here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import DFlashError, NoDrafterKnown
from ..paths import ASSETS

# Where the facts below were read (the ids, the drafter kind, the target's model_type).
ZLAB = "z-lab/dflash README 'Supported Models' (github)"
ZLAB_ZH = "z-lab/dflash README.zh-CN.md and a later README copy (gemma-4, MiniMax, Kimi-K2.6 rows)"
SHARED = "../shared/data/configs (published config.json copies, SOURCES.md)"


@dataclass(frozen=True)
class Pair:
    """One published pair. `model_type` is the target config.json's own, and `config` any other
    field of it the loader checks before it runs a family (together they decide whether this
    build runs the target); `default` marks the drafter `find_drafter` picks for the target."""

    target: str
    drafter: str
    model_type: str
    source: str = ZLAB
    config: tuple[tuple[str, object], ...] = ()
    kind: str = "dflash"  # | "dflash2" | "assistant"
    default: bool = True


# Gemma 4's large models, as their published text_config says: no KV sharing between layers and
# no per-layer inputs (mlx-lm's defaults are the small E2B / E4B models', which share both).
_GEMMA4_DENSE = (("num_kv_shared_layers", 0), ("hidden_size_per_layer_input", 0))
_GEMMA4_MOE = (("num_kv_shared_layers", 0), ("hidden_size_per_layer_input", None))


PAIRS: tuple[Pair, ...] = (
    Pair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "qwen3"),
    Pair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3", f"{ZLAB}; {SHARED}"),
    Pair("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", "qwen3_moe"),
    # z-lab's only Llama-3.1 drafter is the UltraChat one (block size 10): every README version
    # and every third-party reference names it so; no repo without the suffix was ever seen.
    Pair(
        "meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "llama"
    ),
    Pair("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", "qwen3_5", f"{ZLAB}; {SHARED}"),
    Pair("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", "qwen3_5"),
    Pair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", "qwen3_5"),
    Pair("Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", "qwen3_5_moe"),
    Pair("Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash", "qwen3_5_moe"),
    # Listed "coming soon" by z-lab; the repo is named by SOURCES.md and by hipfire's
    # docs/model induction (converted "from the published z-lab safetensors").
    Pair("Qwen/Qwen3.5-397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash", "qwen3_5_moe", SHARED),
    # Qwen3.6 keeps Qwen3.5's wrapper types (models/target.py, SOURCES.md).
    Pair("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", "qwen3_5"),
    Pair("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", "qwen3_5_moe"),
    Pair(
        "Qwen/Qwen3.6-35B-A3B",
        "incoai/Qwen3.6-35B-A3B-DFlash2",
        "qwen3_5_moe",
        f"{SHARED} (no config seen)",
        kind="dflash2",
        default=False,
    ),
    Pair("Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash", "qwen3_next"),
    # DFlash 2 (models/dflash2.py); z-lab mirrors incoai's Qwen3.8 drafter (same config sha256).
    Pair("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", "qwen3_5", SHARED, kind="dflash2"),
    Pair(
        "Qwen/Qwen3.8-27B",
        "incoai/Qwen3.8-27B-DFlash2",
        "qwen3_5",
        SHARED,
        kind="dflash2",
        default=False,
    ),
    Pair(
        "meta-models/Muse-Glimmer-30B",
        "z-lab/Muse-Glimmer-30B-DFlash2",
        "muse_glimmer",
        SHARED,
        kind="dflash2",
    ),
    # Meta's own v1 drafter (MuseGlimmerAssistantModel); DFlash 2 above is the default.
    Pair(
        "meta-models/Muse-Glimmer-30B",
        "meta-models/Muse-Glimmer-30B-assistant",
        "muse_glimmer",
        SHARED,
        kind="assistant",
        default=False,
    ),
    Pair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", "gemma4", ZLAB_ZH, _GEMMA4_DENSE),
    Pair(
        "google/gemma-4-26B-A4B-it",
        "z-lab/gemma-4-26B-A4B-it-DFlash",
        "gemma4",
        ZLAB_ZH,
        _GEMMA4_MOE,
    ),
    # Spelled "gemma4-" (no dash) by z-lab for the 12B; the target is Gemma 4's unified
    # (encoder-free multimodal) type, per the HF model API as quoted in public repositories.
    Pair(
        "google/gemma-4-12B-it",
        "z-lab/gemma4-12B-it-DFlash",
        "gemma4_unified",
        "public deployment guides and DFlash ports naming z-lab/gemma4-12B-it-DFlash "
        "(not in z-lab's README)",
        _GEMMA4_DENSE,
    ),
    Pair("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "gpt_oss", f"{ZLAB}; {SHARED}"),
    Pair("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", "gpt_oss"),
    # Gated previews; M2.5 / M2.7 keep MiniMax-M2's architecture (transformers: minimax_m2).
    Pair("MiniMaxAI/MiniMax-M2.5", "z-lab/MiniMax-M2.5-DFlash", "minimax_m2", ZLAB_ZH),
    Pair("MiniMaxAI/MiniMax-M2.7", "z-lab/MiniMax-M2.7-DFlash", "minimax_m2", ZLAB_ZH),
    # Gated; published as "-FP8-DFlash" (trained on GLM-5.1-FP8), GLM-5's architecture.
    Pair(
        "zai-org/GLM-5.1",
        "z-lab/GLM-5.1-FP8-DFlash",
        "glm_moe_dsa",
        "huggingface.co/z-lab/GLM-5.1-FP8-DFlash (gated; z-lab's README: coming soon)",
    ),
    Pair("zai-org/GLM-5.3", "incoai/GLM-5.3-DFlash2", "glm_moe_dsa", SHARED, kind="dflash2"),
    Pair(
        "zai-org/GLM-5.3-Flash", "incoai/GLM-5.3-Flash-DFlash2", "glm5_next", SHARED, kind="dflash2"
    ),
    # About a trillion parameters: several Macs (mlx.launch, README "Several Macs"). K2.6 and
    # K2.7-Code keep K2.5's architecture (ROCm/ATOM#781, vllm-project/recipes#533).
    Pair("moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", "kimi_k25"),
    Pair("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", "kimi_k25", f"{ZLAB_ZH}; {SHARED}"),
    Pair("moonshotai/Kimi-K2.7-Code", "nvidia/Kimi-K2.7-Code-DFlash", "kimi_k25", SHARED),
    # The repo holds Xiaomi's FP4 checkpoint of the target beside the drafter; MiMo-V2.5-Pro is
    # MiMoV2ForCausalLM, model_type mimo_v2 (70 layers: the drafter's num_target_layers).
    Pair("XiaomiMiMo/MiMo-V2.5-Pro", "XiaomiMiMo/MiMo-V2.5-Pro-FP4-DFlash", "mimo_v2", SHARED),
    # FlashDrive (z-lab/flashdrive README): vision-language-action targets; model types as
    # NVIDIA's configs spell them in public test fixtures (not read from z-lab's copies).
    Pair(
        "z-lab/Alpamayo-1.5-10B",
        "z-lab/Alpamayo-1.5-10B-DFlash",
        "alpamayo1_5",
        "z-lab/flashdrive README",
    ),
    Pair(
        "z-lab/Alpamayo-R1-10B",
        "z-lab/Alpamayo-R1-10B-DFlash",
        "alpamayo_r1",
        "z-lab/flashdrive README",
    ),
)

# Target id -> the drafter found for it (the default pair of each target).
DRAFTERS: dict[str, str] = {p.target: p.drafter for p in PAIRS if p.default}

# Drafters trained here (`dflash-mlx train`, training/README.md), shipped in mlx_dflash/assets.
SHIPPED: dict[str, str] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct-dflash",
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": "qwen2.5-coder-0.5b-instruct-dflash",
}

# The `architectures` entry each drafter kind publishes in its config.json.
KIND_ARCHITECTURES = {
    "dflash": "DFlashDraftModel",
    "dflash2": "DFlash2DraftModel",
    "assistant": "MuseGlimmerAssistantModel",
}

# Trailing tags that re-quantised or re-packaged copies add to the base model's name:
# -MLX, -GGUF, -4bit, -bf16, -DWQ, -4bit-DWQ-053125, -mxfp4, -q4_K_M, -FP8, ...
_TAG = (
    r"mlx|gguf|\d+bit|\d+-bit|bf16|fp\d+|float16|float32|f16|f32|dwq|awq|gptq|mxfp\d|nvfp\d"
    r"|q\d(_[a-z0-9]+)*|v\d+|\d{6}"
)
_SUFFIX = re.compile(rf"([-_.]({_TAG}))+$", re.IGNORECASE)
# mlx-community calls Llama 3.1 "Meta-Llama-3.1-8B-Instruct".
_PREFIX = re.compile(r"^meta-(?=llama)", re.IGNORECASE)


def base_name(model: str | Path) -> str:
    """The lower-case model name without org, quantisation tags or packaging prefixes."""
    name = Path(str(model).rstrip("/")).name
    return _PREFIX.sub("", _SUFFIX.sub("", name)).lower()


def find_drafter(model: str | Path) -> str:
    """The drafter id (or shipped folder) for a target id or folder name; else a clear error."""
    known = {**DRAFTERS, **{t: str(ASSETS / d) for t, d in SHIPPED.items()}}
    for target, drafter in known.items():
        if str(model).lower() == target.lower():
            return drafter
    name = base_name(model)
    for target, drafter in known.items():
        if base_name(target) == name:
            return drafter
    raise NoDrafterKnown(f"No published DFlash drafter is known for '{model}'; pass --drafter.")


def refusal(pair: Pair) -> str | None:
    """Why this build cannot run `pair` (the loaders' own sentence), or None when it can.

    Asked at call time of the code that loads targets and drafters, so it follows whatever
    they support; nothing here says which families run."""
    from ..models.drafter_config import DRAFTER_ARCHITECTURES, architecture_of
    from ..models.families import architecture

    try:
        architecture({"model_type": pair.model_type, **dict(pair.config)})
    except DFlashError as e:
        return str(e)
    arch = KIND_ARCHITECTURES[pair.kind]
    if architecture_of({"architectures": [arch]}) is None:
        supported = ", ".join(DRAFTER_ARCHITECTURES)
        return f"Drafter architecture '{arch}' is not supported (supported: {supported})."
    return None


# Parameters (billions: total, active) of the targets whose id does not say them, from their
# publishers' model cards; the rest are read from the id ("30B-A3B"). Unknown: no size shown.
PARAMS: dict[str, tuple[float, float | None]] = {
    "Qwen/Qwen3-Coder-Next": (80.0, 3.0),
    "openai/gpt-oss-20b": (21.0, 3.6),
    "openai/gpt-oss-120b": (117.0, 5.1),
    "MiniMaxAI/MiniMax-M2.5": (230.0, 10.0),
    "MiniMaxAI/MiniMax-M2.7": (230.0, 10.0),
    "zai-org/GLM-5.1": (744.0, 40.0),
    "moonshotai/Kimi-K2.5": (1040.0, 32.0),
    "moonshotai/Kimi-K2.6": (1040.0, 32.0),
    "moonshotai/Kimi-K2.7-Code": (1040.0, 32.0),
}
_SIZE = re.compile(r"(?:^|[-_])(\d+(?:\.\d+)?)[bB](?=$|[-_])")
_ACTIVE = re.compile(r"[-_][aA](\d+(?:\.\d+)?)[bB](?=$|[-_])")


def params(target: str) -> tuple[float, float | None] | None:
    """(total, active) parameters of a target in billions (active: None where dense), or None
    where neither its id nor PARAMS says."""
    if target in PARAMS:
        return PARAMS[target]
    name = target.rsplit("/", 1)[-1]
    total, active = _SIZE.search(name), _ACTIVE.search(name)
    if total is None:
        return None
    return float(total.group(1)), None if active is None else float(active.group(1))


def weights_gb(billions: float, bits: int | None, group_size: int = 64) -> float:
    """Gigabytes of a target's weights: bf16 (bits None), or MLX's affine quantization at
    `bits` with a float16 scale and bias per group. That is both what a download of such a copy
    weighs and what the weights take in memory (the KV cache and the drafter come on top)."""
    bits_per_weight = 16.0 if bits is None else bits + 32 / group_size
    return billions * bits_per_weight / 8


# What `dflash-mlx models` says a target's weights take, by precision (bits None: bf16).
_PRECISIONS = {"bf16": None, "8bit": 8, "4bit": 4}


def support_rows() -> list[dict]:
    """Every published pair with whether it runs here, its size and the command that runs it
    (the drafter found for the target by default): what `dflash-mlx models` and `doctor` print."""
    rows: list[dict] = []
    for p in PAIRS:
        why = refusal(p)
        total, active = params(p.target) or (None, None)
        drafter = "" if p.default else f" -d {p.drafter}"
        rows.append(
            {
                "target": p.target,
                "drafter": p.drafter,
                "kind": p.kind,
                "model_type": p.model_type,
                "default": p.default,
                "runs": why is None,
                "refused": why,
                "source": p.source,
                "params_b": total,
                "active_params_b": active,
                "weights_gb": None
                if total is None
                else {k: round(weights_gb(total, bits), 1) for k, bits in _PRECISIONS.items()},
                "command": f"dflash-mlx chat -m {p.target}{drafter}" if why is None else None,
            }
        )
    return rows
