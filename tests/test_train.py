"""`dflash-mlx train`: the training forward is the inference forward, loss falls, tau rises,
checkpoints load everywhere and resume at the right step."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.drafter import DrafterRunner, init_drafter, load_drafter
from mlx_dflash.generate import DEFAULT_TARGET
from mlx_dflash.target import load_target
from mlx_dflash.train import (
    TrainConfig,
    Trainer,
    drafter_blocks,
    drafter_logits,
    eval_tau,
    load_checkpoint,
    new_drafter_config,
    target_taps,
)
from mlx_dflash.train_data import answer_prompts, encode, load_records, story_prompts


@pytest.fixture(scope="module")
def target():
    return load_target(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """Story openings answered by stories260K itself (greedy and sampled), plus held-out ones."""
    prompts = story_prompts(target, 72, seed=1)
    shard = tmp_path_factory.mktemp("data") / "answers.jsonl"
    answer_prompts(target, prompts[:64], shard, temps=(0.0, 0.7), max_tokens=96, batch=64)
    held_out = [encode(target.tokenizer, p) for p in prompts[64:]]
    return load_records([shard]), held_out, shard


def small_cfg(target, **kw):
    return new_drafter_config(target, layers=2, taps=[1, 3], block_size=8, heads=4, **kw)


def test_training_forward_matches_propose(target):
    """Logits of a block at anchor a in training == DrafterRunner.propose with taps < a."""
    cfg = new_drafter_config(target, layers=2, taps=[1, 3], block_size=16, mask_token_id=0)
    drafter = init_drafter(cfg, seed=3)
    target.set_taps(cfg.target_layer_ids)
    rng = np.random.default_rng(0)
    toks = [1] + [int(x) for x in rng.integers(3, 500, size=70)]
    _, taps = target.forward(mx.array(toks), target.make_cache(), 0)
    batch_taps = target_taps(target, mx.array([toks]))
    assert mx.allclose(batch_taps[0], taps, atol=1e-5)
    anchors = [4, 33, 60, 12]
    h = drafter_blocks(drafter, target, batch_taps, mx.array([toks]), mx.array([anchors]))
    logits = drafter_logits(cfg, target, h)
    for j, a in enumerate(anchors):
        runner = DrafterRunner(drafter, target)
        runner.add_context(taps[:a])
        ref = runner.propose(toks[a], a, cfg.block_size - 1)
        assert mx.allclose(logits[0, j, 1:], ref, atol=1e-4), a


def test_few_steps_reduce_loss(target, data):
    recs, _, _ = data
    drafter = init_drafter(small_cfg(target), seed=0)
    cfg = TrainConfig(steps=12, lr=3e-3, warmup=2, batch=4, anchors=8, seed=0)
    trainer = Trainer(target, drafter, recs, cfg)
    first = trainer.train_step()["loss"]
    for _ in range(10):
        last = trainer.train_step()["loss"]
    assert last < first - 0.5


def test_short_run_raises_tau(target, data):
    """A ~20 s run on stories260K beats a random drafter's tau (about 1.0) clearly."""
    recs, held_out, _ = data
    drafter = init_drafter(small_cfg(target), seed=0)
    before = eval_tau(drafter, target, held_out[:4], 48)["tau"]
    cfg = TrainConfig(steps=60, lr=3e-3, warmup=5, batch=8, anchors=8, cache_taps=True)
    Trainer(target, drafter, recs, cfg).run(show=False)
    after = eval_tau(drafter, target, held_out[:4], 48)["tau"]
    assert before < 1.3
    assert after > before + 0.3, (before, after)


def test_checkpoint_converts_loads_and_resumes(target, data, tmp_path):
    from mlx_dflash.convert import convert

    recs, _, _ = data
    out = tmp_path / "ckpt"
    drafter = init_drafter(small_cfg(target), seed=0)
    cfg = TrainConfig(steps=4, warmup=1, batch=2, anchors=4)
    trainer = Trainer(target, drafter, recs, cfg, out=out)
    trainer.run(show=False)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"]["target_layer_ids"] == [1, 3]
    assert raw["dflash_config"]["block_size"] == 8
    assert raw["num_target_layers"] == target.num_layers

    converted = convert(out, tmp_path / "mlx", kind="drafter", target=DEFAULT_TARGET)
    for folder in (out, converted):
        loaded = load_drafter(folder, num_target_layers=target.num_layers)
        for (k, v), (k2, v2) in zip(
            sorted(_flat(loaded).items()), sorted(_flat(drafter).items()), strict=True
        ):
            assert k == k2 and mx.array_equal(v, v2), k

    # Resume: the step, the weights and the optimizer state continue; the schedule with them.
    drafter2, opt_state, step = load_checkpoint(out, target.num_layers)
    assert step == 4
    cfg2 = TrainConfig(steps=6, warmup=1, batch=2, anchors=4)
    resumed = Trainer(target, drafter2, recs, cfg2, out=out, step=step, opt_state=opt_state)
    assert int(resumed.opt.state["step"]) == 4
    resumed.run(show=False)
    assert resumed.step == 6
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 6


def test_answers_resume(target, tmp_path):
    """A second call answers only the prompts missing from the shard."""
    shard = tmp_path / "a.jsonl"
    prompts = ["Once upon a time", "One day", "Tom was a"]
    answer_prompts(target, prompts[:2], shard, max_tokens=8)
    answer_prompts(target, prompts, shard, max_tokens=8)
    ids = sorted(json.loads(line)["id"] for line in shard.read_text().splitlines())
    assert ids == [0, 1, 2]
    rec = json.loads(shard.read_text().splitlines()[0])
    assert rec["tokens"][: rec["prompt_len"]] == encode(target.tokenizer, prompts[rec["id"]])


def _flat(model):
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))
