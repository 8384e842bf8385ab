"""`dflash-mlx train`: the training forward is the inference forward, loss falls, tau rises,
checkpoints load everywhere and resume at the right step."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.engine.contract import Pass
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.drafter import (
    DrafterRunner,
    drafter_logits,
    init_drafter,
    load_drafter,
    reshape_drafter,
)
from mlx_dflash.models.target import load_target
from mlx_dflash.paths import DEFAULT_TARGET
from mlx_dflash.training.batches import (
    cache_all_taps,
    loss_vocabulary,
    make_batch,
    tap_scale,
)
from mlx_dflash.training.checkpoint import CURVE_FILE, TAPS_DIR, load_checkpoint
from mlx_dflash.training.data import (
    answer_prompts,
    batch_generate,
    encode,
    load_records,
    story_prompts,
)
from mlx_dflash.training.forward import block_loss, drafter_blocks, target_taps
from mlx_dflash.training.tapstore import (
    SOFT_IDS,
    SOFT_LOGP,
    SOFT_TOP_K,
    TapStore,
    record_key,
    soft_targets,
)
from mlx_dflash.training.trainer import TrainConfig, Trainer, eval_tau, new_drafter_config


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
    _, taps = target.forward([Pass(mx.array(toks), target.make_cache(), 0)])[0]
    batch_taps = target_taps(target, mx.array([toks]))
    assert mx.allclose(batch_taps[0], taps, atol=1e-5)
    anchors = [4, 33, 60, 12]
    h = drafter_blocks(drafter, target, batch_taps, mx.array([toks]), mx.array([anchors]))
    logits = drafter_logits(cfg, target, h)
    for j, a in enumerate(anchors):
        runner = DrafterRunner(drafter, target)
        runner.add_context(taps[:a])
        ref = runner.propose(toks[a], a, cfg.block_size - 1).logits
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


def _assert_same_drafts(target, a, b, toks: list[int]) -> None:
    """Drafters `a` and `b` propose the same block after `toks` (a grown drafter at step 0)."""
    target.set_taps(a.cfg.target_layer_ids)
    _, taps = target.forward([Pass(mx.array(toks), target.make_cache(), 0)])[0]
    drafts = []
    for d in (a, b):
        runner = DrafterRunner(d, target)
        runner.add_context(taps[:-1])
        drafts.append(runner.propose(toks[-1], len(toks) - 1, d.cfg.block_size - 1).logits)
    assert mx.allclose(drafts[0], drafts[1], atol=1e-5)


def _train_steps(target, drafter, recs, steps: int) -> None:
    cfg = TrainConfig(steps=steps, lr=3e-3, warmup=0, batch=2, anchors=4, seed=0)
    trainer = Trainer(target, drafter, recs, cfg)
    for _ in range(steps):
        trainer.train_step()


def test_grown_drafter_drafts_as_before_and_learns(target, data):
    """Depth growth: the added layers start as identity, so step 0 drafts exactly as the
    drafter it grew from, and training moves them (their zero output projections get
    gradient). A new block size is a config change; shrinking is refused."""
    recs, held_out, _ = data
    small = init_drafter(small_cfg(target, mask_token_id=0), seed=4)
    grown = reshape_drafter(small, 3, small.cfg.block_size, seed=5)
    assert grown.cfg.num_hidden_layers == 3 and len(grown.cfg.layer_types) == 3
    _assert_same_drafts(target, small, grown, held_out[0] + [5, 9, 11, 30, 2, 7])
    before = {k: v for k, v in _flat(grown).items() if k.startswith("layers.2.")}
    _train_steps(target, grown, recs, 3)
    after = _flat(grown)
    for name in ("layers.2.self_attn.o_proj.weight", "layers.2.mlp.down_proj.weight"):
        assert not mx.any(before[name]).item() and mx.any(after[name]).item(), name
    assert reshape_drafter(small, 2, 4).cfg.block_size == 4
    with pytest.raises(DFlashError, match="can only grow"):
        reshape_drafter(small, 1, 8)


def test_widened_drafter_drafts_as_before_and_learns(target, data):
    """Width growth: the added MLP units start with zero down_proj columns, so step 0 drafts
    exactly as before, and training moves those columns; a fresh drafter takes the width
    directly, and narrowing is refused."""
    recs, held_out, _ = data
    small = init_drafter(small_cfg(target, mask_token_id=0), seed=4)
    width = small.cfg.intermediate_size
    wide = reshape_drafter(small, 2, small.cfg.block_size, seed=5, intermediate_size=3 * width)
    assert wide.cfg.intermediate_size == 3 * width and wide.cfg.num_hidden_layers == 2
    assert wide.layers[0].mlp.down_proj.weight.shape == (small.cfg.hidden_size, 3 * width)
    _assert_same_drafts(target, small, wide, held_out[0] + [5, 9, 11, 30, 2, 7])
    name = "layers.0.mlp.down_proj.weight"
    assert not mx.any(_flat(wide)[name][:, width:]).item()
    _train_steps(target, wide, recs, 3)
    assert mx.any(_flat(wide)[name][:, width:]).item()
    fresh = new_drafter_config(target, layers=1, intermediate_size=40)
    assert fresh.intermediate_size == 40
    with pytest.raises(DFlashError, match="can only grow"):
        reshape_drafter(wide, 2, 8, intermediate_size=width)


def test_checkpoint_converts_loads_and_resumes(target, data, tmp_path):
    from mlx_dflash.checkpoints.convert import convert

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
    drafter2, opt_state, step, _ = load_checkpoint(out, target.num_layers)
    assert step == 4
    cfg2 = TrainConfig(steps=6, warmup=1, batch=2, anchors=4)
    resumed = Trainer(target, drafter2, recs, cfg2, out=out, step=step, opt_state=opt_state)
    assert int(resumed.opt.state["step"]) == 4
    resumed.run(show=False)
    assert resumed.step == 6
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 6


def _batch_with_vocab(target, recs, vocab):
    rng = np.random.default_rng(0)
    batch = make_batch(recs[:4], rng, TrainConfig(anchors=6), target)
    lookup = np.full(target.vocab_size, -1, dtype=np.int32)
    lookup[vocab] = np.arange(len(vocab))
    return batch, {**batch, "vocab": mx.array(vocab), "lookup": mx.array(lookup)}


def test_sub_vocabulary_loss(target, data):
    """The whole vocabulary in any order gives the full loss; a sub-vocabulary that holds every
    label gives a lower one (fewer competitors), never a different label."""
    recs, _, _ = data
    drafter = init_drafter(small_cfg(target), seed=2)
    target.set_taps(drafter.cfg.target_layer_ids)
    perm = np.random.default_rng(1).permutation(target.vocab_size).astype(np.int32)
    full, everything = _batch_with_vocab(target, recs, perm)
    loss_full, (hits_full, valid) = block_loss(drafter, target, full, 7.0)
    loss_perm, (hits_perm, _) = block_loss(drafter, target, everything, 7.0)
    assert abs(loss_full.item() - loss_perm.item()) < 1e-4
    assert mx.array_equal(hits_full, hits_perm)

    vocab = loss_vocabulary(recs, 512)
    assert len(vocab) < target.vocab_size
    labels = {t for r in recs for t in r["tokens"][r["prompt_len"] + 1 :]}
    assert labels == set(vocab.tolist())
    _, sub = _batch_with_vocab(target, recs, vocab)
    loss_sub, (hits_sub, _) = block_loss(drafter, target, sub, 7.0)
    assert loss_sub.item() < loss_full.item()
    assert (hits_sub >= hits_full).all().item()


def test_corpus_vocabulary_training_reduces_loss(target, data):
    recs, _, _ = data
    drafter = init_drafter(small_cfg(target), seed=0)
    cfg = TrainConfig(steps=12, lr=3e-3, warmup=2, batch=4, anchors=8, loss_vocab="corpus")
    cfg.negatives = 16
    trainer = Trainer(target, drafter, recs, cfg)
    assert len(trainer.batch(0)["vocab"]) == len(trainer.vocab) + 16
    first = trainer.train_step()["loss"]
    for _ in range(10):
        last = trainer.train_step()["loss"]
    assert last < first - 0.5


def test_corpus_trained_drafter_ships_its_draft_vocabulary(target, data, tmp_path):
    """Trained to rank only the answers' tokens, the drafter drafts only those: the checkpoint
    carries them (draft_vocab.json), `convert` keeps them, and a bad file is one clear error."""
    from mlx_dflash.checkpoints.convert import convert
    from mlx_dflash.errors import DFlashError

    recs, _, _ = data
    out = tmp_path / "ckpt"
    cfg = TrainConfig(steps=2, warmup=1, batch=2, anchors=4, loss_vocab="corpus", negatives=4)
    trainer = Trainer(target, init_drafter(small_cfg(target), seed=0), recs, cfg, out=out)
    trainer.run(show=False)
    converted = convert(out, tmp_path / "mlx", kind="drafter", target=DEFAULT_TARGET)
    for folder in (out, converted):
        loaded = load_drafter(folder, num_target_layers=target.num_layers)
        np.testing.assert_array_equal(loaded.draft_vocab, trainer.vocab)
    runner = DrafterRunner(loaded, target)
    runner.add_context(
        target.forward([Pass(mx.array(recs[0]["tokens"][:9]), target.make_cache(), 0)])[0][1]
    )
    logits = np.array(runner.propose(recs[0]["tokens"][8], 9, 3).logits)
    assert set(np.nonzero(np.isfinite(logits))[1]) <= set(trainer.vocab.tolist())
    (converted / "draft_vocab.json").write_text('{"token_ids": [1, 99999]}')
    with pytest.raises(DFlashError, match="outside the vocabulary"):
        load_drafter(converted, num_target_layers=target.num_layers)
    # Trained with the full-vocabulary loss: no draft vocabulary, and a stale one is removed.
    drafter = init_drafter(small_cfg(target), seed=0)
    Trainer(target, drafter, recs, TrainConfig(steps=1, warmup=0), out=out).run(show=False)
    assert not (out / "draft_vocab.json").exists()


def test_preconditioning_is_the_same_drafter(target, data):
    """Training fc on scaled taps and keeping `fc * scale` is exactly the inference drafter:
    the loss of the stored weights on raw taps equals the loss the step optimised."""
    recs, _, _ = data
    drafter = init_drafter(small_cfg(target), seed=4)
    init_fc = drafter.fc.weight
    cfg = TrainConfig(steps=3, warmup=1, batch=4, anchors=4, cache_taps=True)
    trainer = Trainer(target, drafter, recs, cfg, fresh=True)
    scale = trainer.scale
    assert mx.allclose(drafter.fc.weight, init_fc * scale)
    scaled = mx.concatenate([x.astype(mx.float32) * scale for x in trainer.taps[:50]])
    assert mx.allclose(mx.abs(scaled).mean(axis=0), mx.ones(scale.shape), rtol=0.2)
    trainer.train_step()

    raw = trainer.batch(trainer.step)
    loss_raw, _ = block_loss(drafter, target, raw, cfg.gamma)
    stored = drafter.fc.weight
    drafter.fc.weight = stored / scale
    loss_scaled, _ = block_loss(drafter, target, {**raw, "taps": raw["taps"] * scale}, cfg.gamma)
    drafter.fc.weight = stored
    assert abs(loss_raw.item() - loss_scaled.item()) < 1e-4
    assert mx.allclose(tap_scale([mx.ones((3, 4)) * 5.0]), mx.full((4,), 0.2))


def test_lm_head_rows_match_the_head(tmp_path):
    """Sub-vocabulary logits equal the full head's columns, also for a quantized head."""
    import mlx.nn as nn

    from mlx_dflash.models.tiny import write_tiny_target

    for tied in (True, False):
        path = write_tiny_target(tmp_path / f"t{tied}", "qwen3", tie_word_embeddings=tied)
        for quantized in (False, True):
            tgt = load_target(path)
            if quantized:
                nn.quantize(tgt.model, group_size=32, bits=4)
            h = mx.random.normal((5, tgt.hidden_size), key=mx.random.key(0))
            ids = mx.array([7, 0, 3, tgt.vocab_size - 1], dtype=mx.int32)
            ref = tgt.lm_head(h)[:, ids]
            assert mx.allclose(h @ tgt.lm_head_rows(ids).T, ref, atol=1e-4), (tied, quantized)


def test_tap_cache_on_disk(target, data, tmp_path, monkeypatch):
    """Taps are computed once, kept on disk, reused; other tapped layers recompute them."""
    import mlx_dflash.training.batches as train_mod

    recs, _, _ = data
    target.set_taps([1, 3])
    first = cache_all_taps(target, recs[:10], 512, group=4, out=tmp_path)
    assert len(list((tmp_path / TAPS_DIR).glob("*.safetensors"))) == 3  # one per group
    ref = target_taps(target, mx.array([recs[0]["tokens"]]))[0]
    assert mx.allclose(first[0].astype(mx.float32), ref, atol=1e-2, rtol=1e-2)

    def no_forward(*a, **k):
        raise AssertionError("the cached taps should have been used")

    monkeypatch.setattr(train_mod, "target_taps", no_forward)
    again = cache_all_taps(target, recs[:10], 512, group=4, out=tmp_path)
    assert all(mx.array_equal(a, b) for a, b in zip(first, again, strict=True))
    # Shorter max_len: the stored taps are cut, not recomputed.
    cut = cache_all_taps(target, recs[:10], 20, group=4, out=tmp_path)
    assert all(mx.array_equal(a[:20], b) for a, b in zip(first, cut, strict=True))
    monkeypatch.undo()
    target.set_taps([2])
    other = cache_all_taps(target, recs[:10], 512, group=4, out=tmp_path)
    assert other[0].shape[-1] == target.hidden_size


def test_taps_kept_while_answering(target, tmp_path, monkeypatch):
    """Answering with tap_ids stores, per answer, the taps a separate pass over prompt + answer
    gives (left-padded rows, rows leaving the batch early): training then needs no pass."""
    import mlx_dflash.training.batches as train_mod

    prompts = ["Once upon a time", "Tom had a big red", "The sun", "Lily and Ben went to the"]
    shard = tmp_path / "answers.jsonl"
    target.set_taps([1, 3])
    answer_prompts(target, prompts, shard, temps=(0.0, 0.7), max_tokens=40, tap_ids=[1, 3])
    recs = load_records([shard])
    assert len({len(r["tokens"]) for r in recs}) > 1  # some stopped early
    stored = TapStore(tmp_path, [1, 3]).load()
    assert sorted(k for k in stored if "." not in k) == sorted(str(r["id"]) for r in recs)
    for r in recs:
        got = stored[str(r["id"])].astype(mx.float32)
        ref = target_taps(target, mx.array([r["tokens"]]))[0]
        assert got.shape == ref.shape
        # All but the last token were fed to the target; the last one's taps stay zero.
        assert mx.allclose(got[:-1], ref[:-1], atol=2e-2, rtol=1e-2), r["id"]
        assert not mx.any(got[-1]).item()

    # The soft targets: entry j is the target's top-k of the distribution answer token j was
    # drawn from (a greedy answer's token is its top entry).
    soft = soft_targets(recs, tmp_path, [1, 3])
    for r, (ids, logp) in zip(recs, soft, strict=True):
        n = len(r["tokens"]) - r["prompt_len"]
        assert ids.shape == logp.shape == (n, SOFT_TOP_K)
        full = target.model(mx.array([r["tokens"]]))[0, r["prompt_len"] - 1 : -1]
        full = full - mx.logsumexp(full, axis=-1, keepdims=True)
        want = mx.take_along_axis(full, mx.array(ids), axis=-1)
        assert mx.allclose(mx.array(logp), want, atol=2e-2), r["id"]
        assert (mx.topk(full, SOFT_TOP_K, axis=-1).min(axis=-1) <= want.min(axis=-1) + 1e-3).all()
        if r["temp"] == 0:
            answer = r["tokens"][r["prompt_len"] :]
            assert [int(i[np.argmax(lp)]) for i, lp in zip(ids, logp, strict=True)] == answer

    monkeypatch.setattr(train_mod, "target_taps", lambda *a, **k: 1 / 0)
    taps = cache_all_taps(target, recs, 512, out=tmp_path)  # no second pass
    assert [t.shape[0] for t in taps] == [len(r["tokens"]) for r in recs]


def test_soft_targets_for_answers_made_without(target, data, tmp_path):
    """Answers made without soft targets get them from the tap pass (with_soft): the target's
    top-k log-probabilities at each answer token, as the answerer would have kept them."""
    recs, _, _ = data
    target.set_taps([1, 3])
    assert soft_targets(recs[:5], tmp_path, [1, 3]) == [None] * 5
    taps = cache_all_taps(target, recs[:5], 512, group=2, out=tmp_path, with_soft=True)
    for r, x, (ids, logp) in zip(recs[:5], taps, soft_targets(recs[:5], tmp_path, [1, 3]),
                                 strict=True):  # fmt: skip
        assert x.shape[0] == len(r["tokens"])
        assert ids.shape == (len(r["tokens"]) - r["prompt_len"], SOFT_TOP_K)
        full = target.model(mx.array([r["tokens"]]))[0, r["prompt_len"] - 1 : -1]
        full = full - mx.logsumexp(full, axis=-1, keepdims=True)
        assert mx.allclose(mx.array(logp), mx.take_along_axis(full, mx.array(ids), -1), atol=2e-2)
        best = np.argsort(-np.array(full), axis=-1)[:, :SOFT_TOP_K]
        assert (np.sort(ids, axis=-1) == np.sort(best, axis=-1)).mean() > 0.99  # ties aside
    # Records whose taps are stored already get only their soft targets added (taps are
    # 5.8 KB a token on SmolLM2: storing them twice doubled the store).
    plain = cache_all_taps(target, recs[5:8], 512, out=tmp_path)
    shards = set((tmp_path / TAPS_DIR).glob("*.safetensors"))
    again = cache_all_taps(target, recs[5:8], 512, out=tmp_path, with_soft=True)
    (new,) = set((tmp_path / TAPS_DIR).glob("*.safetensors")) - shards
    keys = set(mx.load(str(new)))
    assert keys == {record_key(r) + s for r in recs[5:8] for s in (SOFT_IDS, SOFT_LOGP)}
    assert all(mx.array_equal(a, b) for a, b in zip(plain, again, strict=True))


def test_distillation_loss(target, data):
    """kl_weight w mixes, per slot, the answer token's cross-entropy with the cross-entropy
    against the target's soft targets: one-hot soft targets change nothing, and half the mass
    on the answer token and half on another id gives the mean of both cross-entropies."""
    import mlx.nn as nn

    from mlx_dflash.training.forward import slot_weights

    recs, _, _ = data
    drafter = init_drafter(small_cfg(target), seed=4)
    target.set_taps(drafter.cfg.target_layer_ids)
    cfg = TrainConfig(anchors=6)

    def batch_with(logp_row):
        soft = []
        for r in recs[:4]:
            answer = np.array(r["tokens"][r["prompt_len"] :], dtype=np.int32)
            ids = np.stack([answer, (answer + 1) % 500, (answer + 2) % 500], axis=1)
            soft.append((ids, np.tile(np.array(logp_row, np.float32), (len(answer), 1))))
        return make_batch(recs[:4], np.random.default_rng(0), cfg, target, soft=soft)

    plain = make_batch(recs[:4], np.random.default_rng(0), cfg, target)
    base = block_loss(drafter, target, plain, 7.0)[0].item()
    one_hot = batch_with([0.0, -np.inf, -np.inf])
    assert abs(block_loss(drafter, target, one_hot, 7.0, kl_weight=0.7)[0].item() - base) < 1e-5

    # The other cross-entropy by hand: the same blocks, labels shifted to the next id.
    h = drafter_blocks(drafter, target, plain["taps"], plain["tokens"], plain["anchors"])
    logits = drafter_logits(drafter.cfg, target, h[:, :, 1:]).astype(mx.float32)
    pos = plain["anchors"][..., None] + mx.arange(1, drafter.cfg.block_size)
    T = plain["tokens"].shape[1]
    labels = mx.take_along_axis(plain["tokens"], mx.minimum(pos, T - 1).reshape(4, -1), axis=1)
    ce_next = nn.losses.cross_entropy(logits, ((labels + 1) % 500).reshape(pos.shape))
    w = slot_weights(drafter.cfg.block_size, 7.0) * (pos < plain["lengths"][:, None, None])
    other = ((ce_next * w).sum() / w.sum()).item()
    halves = batch_with([np.log(0.5), np.log(0.5), -np.inf])
    got = block_loss(drafter, target, halves, 7.0, kl_weight=1.0)[0].item()
    assert abs(got - 0.5 * (base + other)) < 1e-4


def test_records_from_several_runs(target, data, tmp_path):
    """Another run's answers (gzipped, as committed) join the run's own, keyed apart."""
    import gzip
    import shutil

    recs, _, shard = data
    other = tmp_path / "other-run" / "answers.jsonl.gz"
    other.parent.mkdir()
    with open(shard, "rb") as src, gzip.open(other, "wb") as dst:
        shutil.copyfileobj(src, dst)
    both = load_records([shard, other], own=shard)
    assert len(both) == 2 * len(recs)
    keys = [record_key(r) for r in both]
    assert len(set(keys)) == len(keys)
    assert keys[0] == str(both[0]["id"]) and keys[-1] == f"other-run/{both[-1]['id']}"


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


def test_batched_answers_equal_one_at_a_time(target):
    """Rows that stop early leave the batch; the others' greedy answers must not change."""
    tok = target.tokenizer
    prompts = [encode(tok, p) for p in ["Once upon a time", "Tom had a big", "The sun", "Lily"]]
    alone = [batch_generate(target.model, [p], [0.0], 24, set())[0] for p in prompts]
    # Stop on a token some answers reach early and others late or never.
    firsts = {}
    for a in alone:
        for k, t in enumerate(a[1:], 1):
            firsts.setdefault(t, []).append(k)
    stop = min(firsts, key=lambda t: (abs(len(firsts[t]) - 2), min(firsts[t])))
    want = [a[: a.index(stop) + 1] if stop in a else a for a in alone]
    assert len({len(w) for w in want}) > 1  # rows really leave at different steps
    got = batch_generate(target.model, prompts, [0.0] * 4, 24, {stop})
    assert got == want


def _flat(model):
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))


def test_train_command_end_to_end(run_cli, tmp_path):
    """The CLI: answer, train on a sub-vocabulary, keep taps on disk, then resume on the same
    answers without answering again; bad flags end in one sentence."""
    out = tmp_path / "run"
    common = ["--out", out, "--layers", "1", "--taps", "2", "--block-size", "4", "--batch", "2",
              "--anchors", "2", "--eval-every", "0", "--eval-prompts", "2", "--eval-tokens", "8",
              "--loss-vocab", "corpus", "--negatives", "8"]  # fmt: skip
    code, stdout, err = run_cli("train", *common, "--num-prompts", "10", "--gen-max-tokens", "12",
                                "--steps", "2")  # fmt: skip
    assert code == 0, err
    assert "final eval tau" in stdout and (out / "model.safetensors").exists()
    answers = (out / "answers.jsonl").read_text()
    assert len(answers.splitlines()) == 8
    # Taps were kept while answering: one shard per answered batch, every answer in it.
    store = TapStore(out, [2]).load()
    ids = sorted(str(json.loads(x)["id"]) for x in answers.splitlines())
    assert sorted(k for k in store if "." not in k) == ids

    # Resumed on the same answers plus another run's, distilled from the soft targets kept
    # while answering, with a tau curve on two sets.
    code, stdout, err = run_cli("train", *common, "--no-gen", "--resume", "--steps", "3",
                                "--answers", out / "answers.jsonl", "--eval-every", "1",
                                "--eval-set", "mixed:2", "--eval-set", "copy:1",
                                "--kl-weight", "0.5")  # fmt: skip
    assert code == 0, err
    assert (out / "answers.jsonl").read_text() == answers
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["seen_tokens"] > 0
    curve = [json.loads(x) for x in (out / CURVE_FILE).read_text().splitlines()]
    assert [c["step"] for c in curve] == [3]  # resumed at step 2: one evaluation, at 3
    assert {"held-out", "mixed", "copy"} <= set(curve[0]) and curve[0]["seen_tokens"] > 0
    assert "tau by set" in stdout + err

    # Grown from that drafter: one layer more, wider MLPs, a smaller block; it cannot shrink.
    grown = tmp_path / "grown"
    grown.mkdir()
    (grown / "answers.jsonl").write_text(answers)
    small = ["--batch", "2", "--anchors", "2", "--eval-every", "0", "--eval-prompts", "2",
             "--eval-tokens", "8", "--no-gen", "--steps", "1"]  # fmt: skip
    code, _, err = run_cli("train", "--out", grown, "--init", out, "--layers", "2",
                           "--block-size", "3", "--intermediate-size", "256", *small)  # fmt: skip
    assert code == 0, err
    cfg = json.loads((grown / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["block_size"] == 3
    assert cfg["intermediate_size"] == 256
    code, _, err = run_cli("train", "--out", grown, "--init", grown, "--layers", "1", *small)
    assert code != 0 and "it can only grow" in err and "Traceback" not in err
    code, _, err = run_cli("train", "--out", grown, "--init", grown, "--taps", "1", *small)
    assert code != 0 and "--taps shapes a new drafter" in err and "Traceback" not in err

    code, _, err = run_cli("train", "--out", tmp_path / "empty", "--no-gen", "--num-prompts", "12")
    assert code != 0 and "--no-gen needs answers" in err and "Traceback" not in err
    code, _, err = run_cli("train", *common, "--no-gen", "--steps", "1", "--loss-vocab", "some")
    assert code != 0 and "--loss-vocab is 'full' or 'corpus'" in err
    code, _, err = run_cli("train", *common, "--no-gen", "--answers", tmp_path / "none.jsonl")
    assert code != 0 and "no such file" in err and "Traceback" not in err
    (tmp_path / "broken.jsonl.gz").write_text("not gzip")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "not an answer"}\n')
    for bad, says in [("broken.jsonl.gz", "not a readable answers file"),
                      ("prompts.jsonl", "is not an answers file")]:  # fmt: skip
        code, _, err = run_cli("train", *common, "--no-gen", "--answers", tmp_path / bad)
        assert code != 0 and says in err and "Traceback" not in err, err
    code, _, err = run_cli("train", *common, "--no-gen", "--eval-set", "nope")
    assert code != 0 and "Unknown dataset 'nope'" in err and "Traceback" not in err


# --- DFlash 2 -------------------------------------------------------------------------------


def dflash2_cfg(target, **kw):
    import dataclasses

    base = new_drafter_config(target, layers=2, taps=[1, 3], block_size=8, mask_token_id=0, **kw)
    return dataclasses.replace(
        base, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6
    )


def test_dflash2_training_forward_matches_propose(target):
    """With the convolutions and the selector moved off identity, the training forward still
    computes the inference forward, and the training selector's scores are the lattice's."""
    from mlx_dflash.training.forward import selector_loss

    drafter = init_drafter(dflash2_cfg(target), seed=3)
    for layer in drafter.layers:  # a non-trivial convolution (init is the identity)
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = 1.0 + 0.3 * mx.random.normal(conv.base_kernel.shape)
            conv.kernel_projection.weight = 0.1 * mx.random.normal(
                conv.kernel_projection.weight.shape
            )
    cfg = drafter.cfg
    target.set_taps(cfg.target_layer_ids)
    rng = np.random.default_rng(0)
    toks = [1] + [int(x) for x in rng.integers(3, 500, size=60)]
    _, taps = target.forward([Pass(mx.array(toks), target.make_cache(), 0)])[0]
    anchors = [4, 33, 50]
    h = drafter_blocks(
        drafter, target, target_taps(target, mx.array([toks])), mx.array([toks]),
        mx.array([anchors]),
    )  # fmt: skip
    logits = drafter_logits(cfg, target, h[:, :, 1:])
    for j, a in enumerate(anchors):
        runner = DrafterRunner(drafter, target)
        runner.add_context(taps[:a])
        ref = runner.propose(toks[a], a, cfg.block_size - 1)
        assert mx.allclose(logits[0, j], ref.logits, atol=1e-4), a
        # the lattice's chain, taken as labels: teacher forcing then scores that very chain
        chain = ref.lattice.greedy()
        prev = mx.concatenate([mx.array([toks[a]]), chain[:-1]])
        _, hits = selector_loss(drafter.candidate_selector, h[0, j, 1:], logits[0, j], chain, prev)
        assert hits.all().item(), a


def test_to_dflash2_drafts_as_before_then_training_moves_the_selector(target, data):
    from mlx_dflash.models.drafter import to_dflash2

    recs, _, _ = data
    v1 = init_drafter(small_cfg(target), seed=0)
    _train_steps(target, v1, recs, 10)
    v2 = to_dflash2(v1, rank=8, top_k=6)
    assert v2.cfg.kind == "dflash2"
    _assert_same_drafts(target, v1, v2, [1] + list(range(20, 60)))
    # step 0: the chain is the argmax of the logits
    runner = DrafterRunner(v2, target)
    _, taps = target.forward([Pass(mx.array(list(range(3, 30))), target.make_cache(), 0)])[0]
    runner.add_context(taps[:-1])
    p = runner.propose(29, 26, 7)
    assert np.array(p.lattice.greedy()).tolist() == np.array(mx.argmax(p.logits, -1)).tolist()
    w0 = np.array(v2.candidate_selector.hidden_projection.weight)
    cfg = TrainConfig(steps=10, lr=3e-3, warmup=0, batch=4, anchors=8, seed=0)
    trainer = Trainer(target, v2, recs, cfg)
    fixed = trainer.batch(0)
    before = trainer._loss(v2, fixed)[0].item()
    for _ in range(10):
        trainer.train_step()
    assert trainer._loss(v2, fixed)[0].item() < before
    assert np.abs(np.array(v2.candidate_selector.hidden_projection.weight) - w0).max() > 0
    with pytest.raises(DFlashError, match="DFlash 2 already"):
        to_dflash2(v2)


def test_train_cli_dflash2_from_init_and_fresh(tmp_path, data):
    from typer.testing import CliRunner

    from mlx_dflash.cli import app
    from mlx_dflash.training.checkpoint import save_checkpoint

    recs, _, shard = data
    cli = CliRunner()
    common = ["--answers", str(shard), "--no-gen", "--steps", "3", "--batch", "2",
              "--anchors", "4", "--eval-prompts", "1", "--num-prompts", "4", "--eval-every", "0",
              "--selector-rank", "8"]  # fmt: skip
    init = tmp_path / "v1"
    save_checkpoint(init, init_drafter(small_cfg(load_target(DEFAULT_TARGET)), seed=0), None, 0, {})
    for name, extra in [("grown", ["--init", str(init)]), ("fresh", ["--layers", "1"])]:
        out = tmp_path / name
        out.mkdir()
        (out / "answers.jsonl").write_text(shard.read_text())
        res = cli.invoke(app, ["train", "--out", str(out), "--arch", "dflash2", *common, *extra])
        assert res.exit_code == 0, res.output
        saved = json.loads((out / "config.json").read_text())
        assert saved["architectures"] == ["DFlash2DraftModel"]
        assert saved["dflash_config"]["selector_rank"] == 8
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "np") as f:
            assert "candidate_selector.predecessor_codebook" in f.keys()
    res = cli.invoke(app, ["train", "--out", str(tmp_path / "x"), "--arch", "dflash3", *common])
    assert res.exit_code != 0 and "--arch must be dflash or dflash2" in str(res.exception)
