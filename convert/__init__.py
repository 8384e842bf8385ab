"""Recipes that turn foreign checkpoints into Hugging Face-style folders `mlx_lm.load` reads.

`llama2c` converts Karpathy's llama2.c legacy `.bin` checkpoints and tokenizers, `gguf` converts
llama.cpp GGUF files (llama, qwen2), `build_models` builds the project's test models.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# Importing mlx_dflash first loads OpenBLAS before any recipe imports mlx (see mlx_dflash/_blas.py).
from mlx_dflash.atomic import atomic_folder
from mlx_dflash.errors import DFlashError

__all__ = ["DFlashError", "atomic_folder", "file_sha256", "interleaved_to_half", "write_json"]


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, for provenance notes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: Path, obj: dict) -> None:
    """Write JSON the way Hugging Face folders do (indented, UTF-8, trailing newline)."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def interleaved_to_half(w, n_heads: int):
    """Reorder q/k projection rows from interleaved RoPE pairs to Hugging Face's rotate_half halves.

    llama2.c and Meta checkpoints rotate adjacent pairs (x0, x1), (x2, x3), ... of each head, and
    llama.cpp stores GGUF llama weights permuted the same way. mlx-lm's llama (like HF) rotates the
    first half of a head against the second, so each head's rows go (pair i, half s) -> (half s, i),
    exactly HF's convert_llama_weights_to_hf `permute`. Works on numpy and MLX arrays, on weights,
    biases and on the rows of MLX quantized weight/scales/biases (their groups run along columns).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise DFlashError(f"Cannot split {rows} projection rows into {n_heads} RoPE heads.")
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
