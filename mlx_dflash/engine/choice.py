"""The default configuration: what runs when nobody names a mode (README, "The default
configuration", has the measurements behind it).

- DDTree trees sized by `--budget auto`, with prompt-lookup branches and the drafter's corpus
  (GenerationConfig's defaults): the fastest setting measured on every pair and case where
  speculation can pay;
- prompt lookup alone (`--mode lookup`) where no drafter is known for the target;
- plain decoding (`--mode ar`) where this machine's verify of a few tokens costs about as many
  plain steps (budget.speculation_pays, measured once per model and machine): there no draft
  can pay, and trying costs a drafter pass, probes and the host work around them. That is a
  quantized target on a CPU today (MLX's CPU quantized matmul is linear in the rows); on
  Apple GPUs stock MLX's small-M verify still pays.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .budget import PROBE_TOKENS, speculation_pays, verify_steps
from .corpus import lookup_corpus
from .session import GenerationConfig


@dataclass(frozen=True)
class Choice:
    mode: str
    note: str | None = None  # one line for the user where the default is not DDTree


def default_mode(target, drafter, name: str | None = None) -> Choice:
    """The mode to run when the user named none, for this target (and drafter, or None where
    none is known) on this machine."""
    name = name or "the target"
    if not speculation_pays(target):
        steps = verify_steps(target)
        return Choice(
            "ar",
            f"plain decoding (--mode ar): on this machine a verify of {PROBE_TOKENS} tokens of "
            f"{name} costs {steps:.1f} plain steps (measured), so no draft can pay; "
            "--mode ddtree --budget 16 speculates anyway.",
        )
    if drafter is None:
        return Choice(
            "lookup",
            f"prompt lookup alone (--mode lookup): no DFlash drafter is known for {name}; "
            "--drafter names one.",
        )
    return Choice("ddtree")


def describe(cfg: GenerationConfig, drafter=None) -> str:
    """What a generation runs, in the flags' words: 'ddtree --budget auto, lookup 10 + corpus
    lookup-corpus.jsonl.gz'."""
    if cfg.round_kind == "plain":
        return "ar (plain decoding)"
    if cfg.round_kind == "block" and cfg.budget is None:
        parts = ["dflash (the drafter's whole block)"]
    else:
        parts = [f"{cfg.mode} --budget {cfg.budget}"]
    if cfg.lookup:
        corpus = lookup_corpus(cfg, drafter)
        if isinstance(corpus, str) and corpus:
            parts.append(f"lookup {cfg.lookup} + corpus {Path(corpus).name}")
        elif corpus is not None and corpus != "":
            parts.append(f"lookup {cfg.lookup} + the answers served")
        else:
            parts.append(f"lookup {cfg.lookup}")
    return ", ".join(parts)
