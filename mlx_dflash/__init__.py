"""dflash-mlx: lossless DFlash / DDTree speculative decoding on MLX.

The library facade (every command, and the server, builds on it):

    from mlx_dflash import GenerationConfig, Session, encode_prompt, load_pair, stream_generate

    target, drafter = load_pair("Qwen/Qwen3-8B")          # the registry finds its drafter
    session = Session(target, drafter)                     # caches outlive one call
    ids = encode_prompt(target.tokenizer, "Why is the sky blue?")
    for chunk in stream_generate(session, ids, GenerationConfig(max_tokens=200, mode="ddtree")):
        print(chunk.text, end="", flush=True)

Data path: checkpoint -> `load_pair` (models/: target + drafter) -> `Session` ->
`generate_rounds` (engine/: draft, verify, accept, commit) -> `stream_generate` (text) -> CLI.
"""

from ._blas import load_openblas

# Must happen before anything imports mlx (see _blas.py).
load_openblas()

__version__ = "0.1.0"

from .conversation import Conversation  # noqa: E402
from .engine import (  # noqa: E402
    MODES,
    Chunk,
    GenerationConfig,
    Round,
    SamplingParams,
    Session,
    Stats,
    generate_rounds,
    stream_generate,
)
from .errors import DFlashError  # noqa: E402
from .models.drafter import DrafterRunner, load_drafter  # noqa: E402
from .models.pair import load_pair  # noqa: E402
from .models.target import Target, load_target  # noqa: E402
from .prompts import encode_prompt, render, stop_ids  # noqa: E402
from .settings import SETTINGS, Settings  # noqa: E402

__all__ = [
    "MODES",
    "Chunk",
    "Conversation",
    "DFlashError",
    "DrafterRunner",
    "GenerationConfig",
    "Round",
    "SETTINGS",
    "SamplingParams",
    "Settings",
    "Session",
    "Stats",
    "Target",
    "__version__",
    "encode_prompt",
    "generate_rounds",
    "load_drafter",
    "load_pair",
    "load_target",
    "render",
    "stop_ids",
    "stream_generate",
]
