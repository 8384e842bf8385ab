"""Build the embedded default pair shipped inside the package (mlx_dflash/assets/).

    python -m convert.build_default --shared ../shared [--drafter DIR] [--force]   # from the repo root

Target: stories260K (llama2.c, MIT) converted by `convert/llama2c.py`, then by `dflash-mlx
convert` to an MLX float32 folder. Drafter: a trained checkpoint in z-lab layout when --drafter
is given (see `dflash-mlx train`), else a randomly initialised one of the same shape, so that
`dflash-mlx generate --prompt ...` works offline with no model arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from convert import llama2c
from mlx_dflash.checkpoints.convert import convert

ASSETS = Path(__file__).resolve().parents[1] / "mlx_dflash" / "assets"

# A small drafter for a 5-layer, 64-wide target: 2 layers tapping target layers 1 and 3.
DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 192,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "num_target_layers": 5,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 3]},
    "torch_dtype": "float32",
}


def write_random_drafter(out: Path, seed: int = 0) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_dflash.models.drafter import init_drafter
    from mlx_dflash.models.drafter_config import DrafterConfig

    model = init_drafter(DrafterConfig.from_dict(DRAFTER_CONFIG), seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    flat = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), flat, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(DRAFTER_CONFIG, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=Path("../shared"))
    ap.add_argument("--drafter", type=Path, help="trained drafter checkpoint (z-lab layout)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    src = args.shared / "models" / "stories260K"
    with tempfile.TemporaryDirectory() as tmp:
        hf = llama2c.convert(src / "stories260K.bin", src / "tok512.bin", Path(tmp) / "hf")
        convert(hf, ASSETS / "stories260K", kind="target", dtype="float32", force=args.force)
        drafter = args.drafter or write_random_drafter(Path(tmp) / "drafter")
        convert(
            drafter,
            ASSETS / "stories260K-dflash",
            kind="drafter",
            dtype="float32",
            target=ASSETS / "stories260K",
            force=args.force,
        )
    print(f"wrote {ASSETS / 'stories260K'} and {ASSETS / 'stories260K-dflash'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
