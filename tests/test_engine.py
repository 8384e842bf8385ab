"""DFlash engine exactness: speculative output equals the target's own greedy decoding.

Compared against mlx-lm's `generate_step` (the independent reference) and our `--mode ar`,
for tiny random targets of every standard-attention family, in float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from oracle import OracleDrafter, diversify

from mlx_dflash.engine import GenerationConfig, SamplingParams, Session, generate_rounds
from mlx_dflash.engine.contract import Pass
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.drafter import DrafterRunner, init_drafter
from mlx_dflash.models.drafter_config import DrafterConfig
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import TARGET_TYPES, write_tiny_target
from mlx_dflash.settings import SETTINGS

PROMPT = list(range(3, 43))
N = 80


@pytest.fixture(scope="module", params=TARGET_TYPES)
def target(request, tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp(request.param), request.param)
    target = load_target(path)
    diversify(target.model)
    return target


def mlx_lm_greedy(target, prompt, n):
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    return [
        int(t)
        for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=n, sampler=greedy)
    ]


def run(session, prompt, **kw):
    """Greedy decoding through the engine (DFlash's chain unless `mode` says otherwise)."""
    out, taus = [], []
    for r in generate_rounds(session, prompt, GenerationConfig(**{"mode": "dflash", **kw})):
        out += r.tokens
        if not r.prefill:
            taus.append(r.accepted)
    return out, taus


def random_drafter(target, block_size=8, layers=2):
    cfg = DrafterConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=target.vocab_size,
        block_size=block_size,
        mask_token_id=target.vocab_size - 1,
        target_layer_ids=[0, target.num_layers - 2],
        layer_types=["full_attention"] * layers,
    )
    target.set_taps(cfg.target_layer_ids)
    return DrafterRunner(init_drafter(cfg), target)


def test_ar_and_random_drafter_match_mlx_lm(target):
    ref = mlx_lm_greedy(target, PROMPT, N)
    ar, _ = run(Session(target), PROMPT, max_tokens=N, mode="ar")
    assert ar == ref
    out, taus = run(Session(target, random_drafter(target)), PROMPT, max_tokens=N)
    assert out == ref
    assert all(1 <= t <= 8 for t in taus)


def test_exact_with_the_cpu_attention_off(target, monkeypatch):
    """DFLASH_MLX_CPU_ATTENTION=0 (MLX's fused attention, the graphs a GPU builds: what
    scripts/host_time.py measures) keeps every mode exact: target, drafter and tree verify."""
    from mlx_dflash.kernels import cpu_attention

    monkeypatch.setattr(SETTINGS, "cpu_attention", "0")
    assert not cpu_attention.use_cpu_attention()
    ref = mlx_lm_greedy(target, PROMPT, N)
    for mode in ("dflash", "ddtree"):
        out, _ = run(Session(target, random_drafter(target)), PROMPT, max_tokens=N, mode=mode)
        assert out == ref, mode
    monkeypatch.setattr(SETTINGS, "cpu_attention", "off")
    with pytest.raises(DFlashError, match="DFLASH_MLX_CPU_ATTENTION must be one of auto, 0"):
        cpu_attention.use_cpu_attention()


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_draft_vocabulary_restricts_proposals_not_output(target, mode):
    """A drafter with a draft vocabulary scores exactly those tokens as the full head would,
    never proposes any other, and the output is still the target's own."""
    ref = mlx_lm_greedy(target, PROMPT, N)
    full = random_drafter(target)
    vocab = np.unique(np.concatenate([ref[::2], np.arange(0, target.vocab_size, 3)]))
    full.drafter.draft_vocab = vocab
    restricted = DrafterRunner(full.drafter, target)
    full.drafter.draft_vocab = None
    for runner in (full, restricted):
        runner.add_context(target.forward([Pass(mx.array(PROMPT), target.make_cache(), 0)])[0][1])
    a = np.array(full.propose(PROMPT[-1], len(PROMPT), 7).logits)
    b = np.array(restricted.propose(PROMPT[-1], len(PROMPT), 7).logits)
    np.testing.assert_allclose(b[:, vocab], a[:, vocab], rtol=1e-5, atol=1e-5)
    outside = np.setdiff1d(np.arange(target.vocab_size), vocab)
    assert np.isneginf(b[:, outside]).all()
    restricted.reset(0)
    out, taus = run(Session(target, restricted), PROMPT, max_tokens=N, mode=mode, budget=4)
    assert out == ref


def test_runners_share_their_draft_vocabularys_head_rows(target):
    """Every runner of one draft vocabulary reads the same gathered LM head rows (serve keeps a
    runner per pooled session); another vocabulary, or a head whose weight was replaced, gets
    rows of its own, equal to the head's."""
    drafter = random_drafter(target).drafter
    drafter.draft_vocab = np.arange(0, target.vocab_size, 3)
    a, b = DrafterRunner(drafter, target), DrafterRunner(drafter, target)
    assert a.head_rows is b.head_rows
    drafter.draft_vocab = np.arange(1, target.vocab_size, 3)
    c = DrafterRunner(drafter, target)
    drafter.draft_vocab = None
    assert c.head_rows is not a.head_rows
    np.testing.assert_array_equal(np.array(c.head_rows), np.array(target.lm_head_rows(c.vocab)))
    layer = target._untied_head() or target.inner.embed_tokens  # the head, tied or not
    old = layer.weight
    layer.weight = old * 2  # new weights loaded: the rows are gathered again
    try:
        again = target.draft_head_rows(np.arange(1, target.vocab_size, 3))
        np.testing.assert_allclose(np.array(again), 2 * np.array(c.head_rows), rtol=1e-6)
    finally:
        layer.weight = old


@pytest.mark.parametrize("corrupt", [0.0, 0.15, 0.5, 1.0])
def test_oracle_drafter_exact_at_every_acceptance_level(target, corrupt):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([0, 1])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=corrupt, seed=1)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=N)
    assert out == ref
    if corrupt == 0.0:
        assert max(taus) == 8 and np.mean(taus) > 7  # full blocks accepted
    if corrupt == 1.0:
        assert max(taus) == 1  # nothing accepted: one bonus token per round
    if corrupt == 0.15:
        assert 1 < np.mean(taus) < 8 and len(set(taus)) > 2  # partial acceptance


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 8, 9, 23])
def test_max_tokens_cut_off(target, max_tokens):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([0, 1])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=max_tokens)
    assert out == ref[:max_tokens]


def test_stop_token_inside_accepted_block(target):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([0, 1])
    # A token first produced mid-way through the continuation becomes the stop token.
    k = next(i for i in range(10, N) if ref[i] not in ref[:i])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8)
    out, _ = run(Session(target, oracle), PROMPT, max_tokens=N, stop_ids=frozenset({ref[k]}))
    assert out == ref[: k + 1]


def test_block_size_option(target):
    ref = mlx_lm_greedy(target, PROMPT, 40)
    target.set_taps([0, 1])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=40, block_size=4)
    assert out == ref and max(taus) == 4
    with pytest.raises(DFlashError, match="Block size"):
        run(Session(target, oracle), PROMPT, max_tokens=4, block_size=9)


def test_empty_prompt(target):
    with pytest.raises(DFlashError, match="empty"):
        run(Session(target), [], max_tokens=4, mode="ar")


def test_session_prefix_reuse(target):
    """A second call with an extended prompt prefills only the new tokens and stays exact."""
    ref1 = mlx_lm_greedy(target, PROMPT, 20)
    target.set_taps([0, 1])
    prompt2 = PROMPT + ref1 + [5, 6, 7]
    ref2 = mlx_lm_greedy(target, prompt2, 20)
    oracle = OracleDrafter(prompt2 + ref2, target.vocab_size, block_size=8, corrupt=0.2)
    session = Session(target, oracle)
    out1, _ = run(session, PROMPT, max_tokens=20)
    assert out1 == ref1
    rounds = list(generate_rounds(session, prompt2, GenerationConfig(max_tokens=20)))
    assert rounds[0].prefill_tokens <= 4
    assert [t for r in rounds for t in r.tokens] == ref2


@pytest.mark.parametrize("model_type", TARGET_TYPES)
def test_quantized_target_exact(tmp_path, model_type):
    """4-bit mlx-lm weights (the common case on Macs): still token-identical to mlx-lm."""
    import mlx.nn as nn

    target = load_target(write_tiny_target(tmp_path, model_type))
    diversify(target.model)
    nn.quantize(target.model, group_size=32, bits=4)
    ref = mlx_lm_greedy(target, PROMPT, 40)
    target.set_taps([0, 1])
    for mode in ("dflash", "ddtree"):
        oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3)
        out, _ = run(Session(target, oracle), PROMPT, max_tokens=40, mode=mode, budget=16)
        assert out == ref, mode


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dflash_round_syncs_with_the_host_once(target, monkeypatch, temperature):
    """Drafts stay on the device: a round reads drafts and the target's choices (greedy), or
    drafts, accepted count and next token (sampled), back in one transfer, with no other eval
    (issue 19: host syncs are the overhead of small models); the drafts are queued once
    (mx.async_eval, no wait) before the verify's graph is built, and on this CPU each layer of
    the drafter's pass and of the verify is queued as it is built (engine/device.py
    queues_layers). The engine's own syncs: a CPU forward's numpy exponentials sync inside it
    by design (kernels/cpu_math.py), so off."""
    from mlx_dflash.engine import SamplingParams, rounds

    monkeypatch.setattr(SETTINGS, "numpy_math", "0")
    calls = {"to_host": 0, "eval": 0, "queued": 0}
    real_to_host, real_eval, real_async = rounds.to_host, mx.eval, mx.async_eval

    def counting_to_host(x):
        calls["to_host"] += 1
        return real_to_host(x)

    def counting_eval(*args):
        calls["eval"] += 1
        return real_eval(*args)

    monkeypatch.setattr(rounds, "to_host", counting_to_host)
    ref = mlx_lm_greedy(target, PROMPT, 40)
    drafter = random_drafter(target)
    session = Session(target, drafter)
    out, draft_rounds = [], 0
    cfg = GenerationConfig(
        max_tokens=40, sampling=SamplingParams(temperature), seed=1, mode="dflash"
    )
    gen = generate_rounds(session, PROMPT, cfg)
    out += next(gen).tokens  # prefill evaluates the prompt's caches: not a round
    monkeypatch.setattr(mx, "eval", counting_eval)
    monkeypatch.setattr(
        mx,
        "async_eval",
        lambda *a: (calls.__setitem__("queued", calls["queued"] + 1), real_async(*a)),
    )
    for r in gen:
        out += r.tokens
        draft_rounds += r.drafted > 0
    assert out == ref or temperature > 0
    assert draft_rounds > 5 and len(out) == 40
    per_round = 1 + len(drafter.drafter.layers) + target.num_layers  # the drafts, then layers
    assert calls == {"to_host": draft_rounds, "eval": 0, "queued": draft_rounds * per_round}


def test_plain_decoding_keeps_a_step_in_flight(target, monkeypatch):
    """`--mode ar` (and the default where speculation cannot pay) queues each next step before
    the host reads the current token, as mlx-lm's generate_step does: exact, one step queued a
    token, and a follow-up prompt on the same session reuses the cache it left."""
    from mlx_dflash.engine.loop import pipelines, round_function
    from mlx_dflash.engine.rounds import PipelinedSteps

    ref = mlx_lm_greedy(target, PROMPT, 30)
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(1), real(*a))[1])
    session = Session(target)
    out, _ = run(session, PROMPT, max_tokens=30, mode="ar")
    assert out == ref and len(queued) == 30  # a step per round, and the one left in flight
    prompt2 = PROMPT + ref + [5, 6, 7]
    monkeypatch.undo()
    ref2 = mlx_lm_greedy(target, prompt2, 20)
    rounds = list(generate_rounds(session, prompt2, GenerationConfig(max_tokens=20, mode="ar")))
    assert rounds[0].prefill_tokens <= 4
    assert [t for r in rounds for t in r.tokens] == ref2
    cfg = GenerationConfig(mode="ar")
    assert isinstance(round_function(Session(target), cfg), PipelinedSteps)
    # Host work between tokens, or a target that does not run alone: one step at a time.
    assert not pipelines(Session(target), GenerationConfig(mode="ar", logprobs=2), None)
    sampled = GenerationConfig(mode="ar", sampling=SamplingParams(1.0))
    assert not pipelines(Session(target), sampled, None)
    monkeypatch.setattr(type(target), "runs_alone", property(lambda self: False))
    assert not pipelines(Session(target), cfg, None)
