"""Against z-lab's own MLX implementation (PyPI `dflash` 0.1.0, MIT; `make test` installs it with
--no-deps): a drafter folder this project writes loads in z-lab's loader, its logits for a
block equal ours, and z-lab's whole loop decodes the same tokens as our engine and mlx-lm."""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from oracle import diversify

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.contract import Pass
from mlx_dflash.models.drafter import DrafterRunner, init_drafter, load_drafter
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target
from mlx_dflash.training.checkpoint import save_checkpoint
from mlx_dflash.training.trainer import new_drafter_config

zlab = pytest.importorskip(
    "dflash.model_mlx", reason="z-lab's reference needs `pip install --no-deps dflash==0.1.0`"
)

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny qwen3 target and a random 2-layer drafter saved the way `train` saves one, each
    loaded by us and by z-lab (its own copy of the target: it wraps the tapped layers)."""
    root = tmp_path_factory.mktemp("pair")
    folder = write_tiny_target(root / "target", "qwen3")
    target = load_target(folder)
    diversify(target.model)
    target.model.save_weights(str(folder / "model.safetensors"))
    drafter = init_drafter(new_drafter_config(target, 2, [1, 3], 8, 0), seed=4)
    save_checkpoint(root / "drafter", drafter, None, 0, {})
    target.set_taps([1, 3])
    ours = DrafterRunner(
        load_drafter(root / "drafter", num_target_layers=target.num_layers), target
    )
    from mlx_lm import load

    model, tokenizer = load(str(folder))
    # z-lab's load_draft sends any argument to the hub; a local folder is handed to it directly.
    with mock.patch.object(zlab, "snapshot_download", lambda path, **_: path):
        theirs = zlab.load_draft(str(root / "drafter"))
    return target, ours, model, tokenizer, theirs


def test_our_drafter_folder_loads_in_zlabs_loader(pair, tmp_path):
    *_, theirs = pair
    assert theirs.config.target_layer_ids == (1, 3) and theirs.config.block_size == 8


def test_block_logits_equal_zlabs(pair):
    """The same prompt's taps as context, the same block: the drafter's logits for every slot
    agree with the reference's (float32, to rounding)."""
    target, ours, model, _, theirs = pair
    session = Session(target, ours)
    _, taps = target.forward([Pass(mx.array(PROMPT[:-1]), session.cache, 0)])[0]
    session.commit(PROMPT[:-1], taps)
    last, start, n = PROMPT[-1], len(PROMPT) - 1, ours.block_size - 1
    mine = ours.propose(last, start, n).logits
    theirs.bind(model)
    cache = theirs.make_cache()
    block = mx.array([[last] + [theirs.config.mask_token_id] * n])
    ref = theirs(block, taps[None], cache, logits_start=1)[0]
    np.testing.assert_allclose(np.array(mine), np.array(ref), rtol=1e-4, atol=1e-4)


def test_zlabs_loop_decodes_what_our_engine_does(pair):
    target, ours, model, tokenizer, theirs = pair
    cfg = GenerationConfig(max_tokens=40, stop_ids=frozenset(tokenizer.eos_token_ids))
    rounds = generate_rounds(Session(target, ours), PROMPT, cfg)
    mine = [t for r in rounds for t in r.tokens]
    ref = [t for r in zlab.stream_generate(model, theirs, tokenizer, PROMPT, max_tokens=40)
           for t in r.tokens]  # fmt: skip
    assert mine == ref
