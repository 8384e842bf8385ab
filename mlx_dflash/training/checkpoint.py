"""Training checkpoints: a z-lab-layout drafter folder (what `convert` and the engine load)
plus the optimizer state and step, each file written beside and renamed into place."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import atomic_file
from ..models.drafter import (
    DRAFT_VOCAB_FILE,
    DFlashDrafter,
    checkpoint_weights,
    load_drafter,
    write_draft_vocab,
)

STATE_FILE = "trainer_state.json"
OPT_FILE = "optimizer.npz"  # not *.safetensors: load_drafter reads those
CURVE_FILE = "curve.jsonl"  # tau per evaluation set against training tokens
TAPS_DIR = "cache/taps"  # in a subfolder: load_drafter reads OUT/*.safetensors


def save_checkpoint(out: Path, drafter: DFlashDrafter, opt, step: int, meta: dict) -> None:
    """z-lab layout (config.json + model.safetensors) plus the optimizer state to resume, and
    the draft vocabulary when the drafter has one (see drafter.DRAFT_VOCAB_FILE)."""
    out.mkdir(parents=True, exist_ok=True)
    if drafter.draft_vocab is not None:
        write_draft_vocab(out, drafter.draft_vocab)
    elif (out / DRAFT_VOCAB_FILE).exists():
        (out / DRAFT_VOCAB_FILE).unlink()
    cfg = drafter.cfg.to_dict()
    cfg["torch_dtype"] = "float32"
    weights = checkpoint_weights(drafter)
    atomic_file(
        out / "model.safetensors",
        lambda p: mx.save_safetensors(p, weights, metadata={"format": "pt"}),
    )
    if opt is not None:
        state = dict(tree_flatten(opt.state))
        atomic_file(out / OPT_FILE, lambda p: mx.savez(p, **state))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / STATE_FILE).write_text(json.dumps({"step": step, **meta}, indent=2))


def load_checkpoint(out: Path, num_target_layers: int):
    """(drafter, optimizer state or None, step, response tokens trained on) from a folder
    `save_checkpoint` wrote (0 for what its state does not record)."""
    drafter = load_drafter(out, num_target_layers=num_target_layers)
    state_file = out / STATE_FILE
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    opt_state = None
    if (out / OPT_FILE).exists():
        opt_state = tree_unflatten(list(mx.load(str(out / OPT_FILE)).items()))
    return drafter, opt_state, state.get("step", 0), state.get("seen_tokens", 0)
