"""Checkpoint -> loaded target + drafter: the first step of every command and of the server."""

from __future__ import annotations

from ..checkpoints.registry import find_drafter
from ..checkpoints.resolve import resolve_model
from ..distributed import LOCAL, LocalWorld, World, split
from ..engine.session import uses_drafter
from ..errors import NoDrafterKnown
from ..paths import DEFAULT_DRAFTER, DEFAULT_TARGET
from .drafter import DrafterRunner, load_drafter
from .target import Target, load_target


def load_pair(
    model: str | None = None,
    drafter: str | None = None,
    mode: str | None = "ddtree",
    world: World | LocalWorld = LOCAL,
) -> tuple[Target, DrafterRunner | None]:
    """Target and drafter from folders or hub ids (the embedded default pair when neither is
    given); a known target finds its published drafter without `drafter`. Modes that need no
    drafter ("ar", "lookup") load the target alone unless a drafter is named; mode None (the
    commands' default, engine/choice.py) loads the drafter where one is known, and none where
    none is.

    `world` (mlx_dflash.distributed): a sharded one loads the target lazily and keeps this
    rank's shard."""
    if model is None:
        model = str(DEFAULT_TARGET)
        drafter = drafter or str(DEFAULT_DRAFTER)
    target_path = resolve_model(model, "target")
    target = load_target(target_path, lazy=world.sharded)
    split(target, world)
    if mode is not None and not uses_drafter(mode) and drafter is None:
        return target, None
    if drafter is None:
        try:
            drafter = find_drafter(model)
        except NoDrafterKnown:
            if mode is not None:
                raise
            return target, None
    drafter_path = resolve_model(drafter, "drafter", target=target_path)
    draft_model = load_drafter(drafter_path, target_config=target.config)
    target.set_taps(draft_model.cfg.target_layer_ids)
    return target, DrafterRunner(draft_model, target)
