"""The engine: the decoding loop (loop.py), its rounds (rounds.py: prefill, DFlash, plain step;
ddtree.py: the tree round), draft trees (tree.py), `--budget auto` (budget.py), lossless
sampling (sampling.py), and what callers consume (stream.py, stats.py)."""

from .loop import generate_rounds
from .sampling import SamplingParams
from .session import MODES, GenerationConfig, Round, Session, parse_budget
from .stats import Stats
from .stream import Chunk, stream_generate

__all__ = [
    "MODES",
    "Chunk",
    "GenerationConfig",
    "Round",
    "SamplingParams",
    "Session",
    "Stats",
    "generate_rounds",
    "parse_budget",
    "stream_generate",
]
