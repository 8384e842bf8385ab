"""Batched rounds (engine/batch.py): generations in their own threads share each target
forward; each row's greedy output equals its output alone, token for token, in every mode and
attention family, with rows of different lengths joining mid-way and leaving at different
times; a seeded sampled row is reproducible; sampling stays in distribution per row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import attention_target
from oracle import OracleDrafter, diversify
from test_engine import mlx_lm_greedy, run
from test_sampling import chi2_pvalue

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.batch import run_rows
from mlx_dflash.engine.contract import Pass
from mlx_dflash.engine.lattice import LatticeDrafts
from mlx_dflash.engine.sampling import SamplingParams
from mlx_dflash.models.arena import SlotCache
from mlx_dflash.models.target import Target
from mlx_dflash.models.tiny import load_module, tiny_target_config

PROMPTS = [list(range(3, 3 + n)) for n in (12, 30, 7, 19)]
MAX_TOKENS = [40, 24, 33, 16]
JOIN_AT = [0, 0, 3, 6]  # packed forwards run before the row starts


def batched(target, rows, join_at=None):
    """Each row (prompt, cfg, drafter or None) as one generation of a batch: their outputs,
    and the batcher."""
    outs: list = [None] * len(rows)

    def row(i: int):
        def generate(shared) -> None:
            prompt, cfg, drafter = rows[i]
            tokens = []
            session = Session(shared, drafter)
            for r in generate_rounds(session, prompt, cfg):
                tokens += r.tokens
            outs[i] = tokens
            sessions.append(session)

        return generate

    sessions: list = []
    batcher = run_rows(target, [row(i) for i in range(len(rows))], join_at)
    # Every row's caches left the shared KV arena when it ended (models/arena.py).
    assert not any(isinstance(c, SlotCache) for s in sessions for c in s.cache)
    assert not batcher.arena.keys, "the arena keeps no memory once every row has left"
    return outs, batcher


KINDS = ["llama", "qwen3_5", "deepseek_v3", "gpt-oss-20b"]


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory):
    return attention_target(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def truths(target):
    return [mlx_lm_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


@pytest.mark.parametrize(
    "mode, budget, lookup",
    [("ar", 1, 0), ("dflash", 1, 0), ("ddtree", 4, 0), ("ddtree", 16, 4), ("lookup", 16, 4),
     ("ddtree", "auto", 0)],
)  # fmt: skip
def test_each_row_is_its_own_output_alone(target, truths, mode, budget, lookup):
    rows = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        oracle = None
        if mode != "ar":
            oracle = OracleDrafter(prompt + truths[i], target.vocab_size, 8, corrupt=0.3, seed=i)
        cfg = GenerationConfig(max_tokens=n, mode=mode, budget=budget, lookup=lookup)
        rows.append((prompt, cfg, oracle))
    outs, batcher = batched(target, rows, JOIN_AT)
    assert outs == truths
    assert batcher.max_rows >= 3, "rows were not batched"
    assert batcher.forwards < sum(MAX_TOKENS)
    if budget == "auto":
        assert batcher.allots > 0, "the rows' trees never shared a budget"


def test_rows_leave_the_kv_arena_when_they_grow_past_it(target, truths, monkeypatch):
    """Rows join the shared KV arena at their first packed forward and move back to their own
    caches once longer than it keeps (KVArena.max_rows), mid-generation: outputs unchanged."""
    from mlx_dflash.models.arena import KVArena

    if not target.new_arena().layers:
        pytest.skip("MLA keeps its latent cache per row: no layer of this target is in an arena")
    monkeypatch.setattr(KVArena, "max_rows", 36)
    released_at: list[int] = []  # a row's length when its caches left the arena
    release = KVArena.release

    def counted(self, cache):
        released_at.append(max(getattr(c, "offset", 0) for c in cache))
        return release(self, cache)

    monkeypatch.setattr(KVArena, "release", counted)
    rows = [(p, GenerationConfig(max_tokens=n, mode="ar"), None)
            for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]  # fmt: skip
    outs, _ = batched(target, rows, JOIN_AT)
    assert outs == truths
    # Rows 0-2 grow past 36 positions: they leave mid-generation, not only when they end.
    assert len(released_at) == 4 and sum(n <= 36 for n in released_at) == 4, released_at


def test_one_verify_budget_goes_where_acceptance_is_high():
    """split_budget: the batch's best nodes, whichever row they are in, up to the size that
    pays; a row whose drafts are unlikely to land gets none; each row's nodes a prefix."""
    from mlx_dflash.engine.budget import VerifyProfile, split_budget

    # A forward costs 50 + 2 per token: cheap tokens, so confident nodes pay and weak do not.
    sizes = [1, 2, 4, 8, 16, 32, 48, 65]
    profile = VerifyProfile(sizes, [50 + 2 * s for s in sizes])
    sure = np.array([0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4])
    weak = np.array([0.02, 0.01, 0.01])
    assert split_budget([sure, weak], 0, 0, 0.0, profile) == [8, 0]
    assert split_budget([weak, sure], 0, 0, 0.0, profile) == [0, 8]
    # Dear tokens: only the surest nodes pay, and the fixed costs of the round count.
    dear = VerifyProfile(sizes, [10 + 8 * s for s in sizes])
    got = split_budget([sure, weak], 0, 0, 0.0, dear)
    assert 0 < got[0] < 8 and got[1] == 0
    # A gain that rises inside a row is still taken after the nodes before it.
    assert split_budget([np.array([0.1, 0.99])], 0, 0, 0.0, profile)[0] in (0, 2)
    # Other passes in the forward make its tokens no cheaper per token here (linear cost),
    # but count in the rate: with a large base, the same nodes still pay.
    assert split_budget([sure, weak], 40, 4, 0.0, profile) == [8, 0]
    assert split_budget([], 10, 1, 0.0, profile) == []


def test_a_seeded_row_is_reproducible_batched(target, truths):
    """The same seed gives the same sampled tokens alone and in a batch of four."""
    sampling = SamplingParams(0.8, 0.95, 0)

    def rows():
        return [
            (p, GenerationConfig(max_tokens=20, mode="ddtree", budget=6, sampling=sampling,
                                 seed=11 + i),
             OracleDrafter(p + truths[i], target.vocab_size, 8, corrupt=0.3, seed=i))
            for i, p in enumerate(PROMPTS)
        ]  # fmt: skip

    together, _ = batched(target, rows())
    for i, (prompt, _, drafter) in enumerate(rows()):
        alone, _ = run(Session(target, drafter), prompt, max_tokens=20, mode="ddtree", budget=6,
                       sampling=sampling, seed=11 + i)  # fmt: skip
        assert together[i] == alone, i


def test_sampling_is_lossless_per_row():
    """Two rows sampled side by side: each row's first tokens after a DDTree round follow the
    target's exact marginals (chi-square), the other row's presence notwithstanding."""
    from test_families import marginals
    from test_sampling import token_probs  # noqa: F401  (marginals needs its helpers)

    V, depth = 24, 3
    cfg = tiny_target_config("llama", vocab_size=V, num_hidden_layers=2)
    mod = load_module("llama")
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    diversify(model, gain=1.0, seed=3)
    target = Target(model, None, cfg)
    target.set_taps([0, 1])
    prompts = [[3, 9, 4, 17, 5], [8, 2, 21, 6, 14, 10, 1]]
    sampling = SamplingParams(1.0)
    truths = [p + mlx_lm_greedy(target, p, depth) for p in prompts]
    samples: list[list] = [[], []]
    for seed in range(600):
        rows = [
            (p, GenerationConfig(max_tokens=depth, sampling=sampling, seed=seed * 2 + i,
                                 mode="ddtree", budget=4),
             OracleDrafter(truths[i], V, block_size=4, corrupt=0.5, seed=seed, margin=1.0))
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        outs, _ = batched(target, rows)
        for i in range(2):
            samples[i].append(outs[i][:depth])
    for i, prompt in enumerate(prompts):
        got = np.array(samples[i])
        for k, expected in enumerate(marginals(target, prompt, sampling, depth, V)):
            assert chi2_pvalue(got[:, k], expected) > 1e-3, f"row {i}: token {k + 1} is biased"


def test_an_error_in_a_batch_reaches_its_rows_and_the_others_go_on(target, truths):
    """A pass that fails fails the rows of its forward with the reason; rows joining later run
    exactly."""
    errors, out = [], []

    def broken(shared) -> None:
        session = Session(shared, None)
        session.cache = session.cache[:1]  # its forward fails on the missing layers
        try:
            for _ in generate_rounds(session, PROMPTS[0], GenerationConfig(mode="ar")):
                pass
        except Exception as e:
            errors.append(e)

    def good(shared) -> None:
        cfg = GenerationConfig(max_tokens=MAX_TOKENS[0], mode="ar")
        for r in generate_rounds(Session(shared, None), PROMPTS[0], cfg):
            out.extend(r.tokens)

    run_rows(target, [broken, good], join_at=[0, 1])
    assert len(errors) == 1 and out == truths[0]


def test_the_auto_budget_prices_a_tree_at_its_share_of_the_packed_forward():
    """Batched, a row's tree costs what it adds to the other rows' tokens (less per token than
    a forward of its own, whose fixed cost it does not pay), and sizes past the largest
    measured extrapolate instead of costing nothing."""
    from mlx_dflash.engine.budget import AutoBudget, MarginalProfile, VerifyProfile

    profile = VerifyProfile([1, 2, 4, 8, 16, 32, 48, 65], [60, 62, 64, 70, 80, 100, 120, 140])
    assert profile.cost(130) == pytest.approx(140 + 65 * 20 / 17)
    shared = MarginalProfile(profile, others=12)
    assert shared.cost(1) < profile.cost(1) and shared.cost(16) == pytest.approx(
        profile.cost(28) - profile.cost(12)
    )

    class Busy:  # a Batcher whose forwards carry 40 other tokens
        def others_tokens(self):
            return 40.0

    policy = AutoBudget(profile)
    assert policy.costs() is profile
    policy.batch = Busy()
    assert isinstance(policy.costs(), MarginalProfile) and policy.costs().others == 40.0
    policy.record_plain(5.0)  # a plain step's wall time in a batch is the whole batch's
    share = float(profile.cost(41) - profile.cost(40))
    assert policy.pacer.plain[1] == pytest.approx(0.5 * 60 + 0.5 * share)


def test_a_batched_pacer_weighs_trees_against_a_plain_steps_share():
    """In a batch a tree round is weighed against what a plain step adds to the packed forward,
    from the first round (not against a forward of its own, which made every tree round of a
    tau ~1 drafter look like a win: rows drafted every round and ran 1.4x slower than plain
    steps); and a noisy profile (16 tokens timed faster than 8) never prices a token at zero
    or below."""
    from mlx_dflash.engine.budget import AutoBudget, MarginalProfile, VerifyProfile
    from mlx_dflash.engine.tree import Tree

    noisy = VerifyProfile([1, 2, 4, 8, 16, 32, 48, 65], [100, 130, 175, 175, 160, 310, 400, 490])
    assert (np.diff(noisy.seconds) >= 0).all()
    for others in (0, 3, 6, 9.5, 12, 40):
        assert (MarginalProfile(noisy, others).cost(np.arange(1, 9)) > 0).all(), others

    class Busy:
        def others_tokens(self):
            return 12.0

    policy = AutoBudget(noisy)
    policy.batch = Busy()
    tree = Tree(np.array([5, 6]), np.array([-1, 0]), np.array([0, 1]), np.log([1.0, 0.5]))
    # One token a round, 40 of drafting and host time: a loss against a plain step's share.
    policy.record_tree(tree, 2, [0], 1, 40.0, 200.0)
    assert not policy.draft_now(), "a batched row kept drafting at tau 1"

    # A tiny model's profile can be flat end to end (its 1-token verify timed slowest): a
    # plain step's share must still cost something, and a tree round not divide by it (CI
    # once failed here with ZeroDivisionError).
    flat = VerifyProfile(
        [1, 2, 4, 8, 16, 32, 48, 65], [3e-3, 1e-3, 1e-3, 2e-3, 1e-3, 2e-3, 3e-3, 3e-3]
    )
    assert (MarginalProfile(flat, 12).cost(np.arange(1, 9)) > 0).all()
    policy = AutoBudget(flat)
    policy.batch = Busy()
    for _ in range(3):
        policy.record_tree(tree, 2, [0, 1], 2, 0.0, 1.0)


def test_a_row_that_fails_ends_the_others_and_their_blocks(target):
    """An error escaping one row ends the rows still suspended (their `finally` blocks run),
    instead of leaving them, and the wired-memory block each generation enters, open for as
    long as the error's traceback lives: CI once saw a later test find that block still
    entered."""
    from mlx_dflash.engine import device

    ended = []

    def row(i: int):
        def generate(shared) -> None:
            try:
                session = Session(shared, None)
                cfg = GenerationConfig(max_tokens=MAX_TOKENS[i], mode="ar")
                for n, _ in enumerate(generate_rounds(session, PROMPTS[i], cfg)):
                    if i == 1 and n == 3:
                        raise RuntimeError("row 1 fails")
            finally:
                ended.append(i)

        return generate

    with pytest.raises(RuntimeError, match="row 1 fails"):
        run_rows(target, [row(i) for i in range(3)])
    assert sorted(ended) == [0, 1, 2]
    assert device._wired.depth == 0


def test_a_long_prompt_is_read_in_chunks_between_the_other_rows_rounds(target, truths):
    """A 300-token prompt joining mid-way is prefilled in chunks that ride with the decoding
    row's rounds: that row keeps emitting while the prompt is read, and both stay exact."""
    long_prompt = [3 + (i * 7) % 200 for i in range(300)]
    long_truth = mlx_lm_greedy(target, long_prompt, 8)
    seen: dict = {"short": [], "long_prefilled": None}
    outs: dict = {}

    def short(shared) -> None:
        cfg = GenerationConfig(max_tokens=MAX_TOKENS[0], mode="ar")
        tokens = []
        for r in generate_rounds(Session(shared, None), PROMPTS[0], cfg):
            tokens += r.tokens
            seen["short"].append(shared.batcher.forwards)
        outs["short"] = tokens

    def long(shared) -> None:
        cfg = GenerationConfig(max_tokens=8, mode="ar", prefill_chunk=32)
        tokens = []
        for r in generate_rounds(Session(shared, None), long_prompt, cfg):
            if r.prefill:
                seen["long_prefilled"] = shared.batcher.forwards
            tokens += r.tokens
        outs["long"] = tokens

    run_rows(target, [short, long], join_at=[0, 3])
    assert outs == {"short": truths[0], "long": long_truth}
    during = [f for f in seen["short"] if 3 < f < seen["long_prefilled"]]
    assert len(during) >= 5, (seen, "the short row stalled while the long prompt was read")


DRAFTER_SHAPES = {
    "full": {},
    "sliding-causal": {"layer_types": ["sliding_attention", "full_attention"],
                       "sliding_window": 6},
    "mimo-like": {"attention_sink_bias": True, "attention_value_scale": 0.7, "v_head_dim": 8,
                  "partial_rotary_factor": 0.5, "attention_bias": True,
                  "layer_types": ["sliding_attention"] * 2, "sliding_window": 6,
                  "is_causal": False},
    "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                "selector_top_k": 6},
    "dflash2-sliding": {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8,
                        "selector_top_k": 6, "layer_types": ["sliding_attention"] * 2,
                        "sliding_window": 6, "is_causal": False},
    "draft-vocab": {},  # the drafter proposes from a subset of the vocabulary (draft_vocab.json)
}  # fmt: skip


def _drafter(target, **shape):
    from mlx_dflash.models.drafter import init_drafter
    from mlx_dflash.models.drafter_config import DrafterConfig

    cfg = DrafterConfig(
        hidden_size=target.hidden_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64,
        vocab_size=target.vocab_size, block_size=8, mask_token_id=target.vocab_size - 1,
        target_layer_ids=[0, target.num_layers - 1],
        layer_types=shape.pop("layer_types", ["full_attention"] * 2), **shape,
    )  # fmt: skip
    drafter = init_drafter(cfg, seed=4)
    mx.eval(drafter.parameters())
    return drafter


@pytest.mark.parametrize("shape", list(DRAFTER_SHAPES))
def test_packed_drafter_passes_are_each_rows_own(target, shape):
    """Several rows' drafter passes as one: each row's logits (and a DFlash 2 row's lattice)
    are its own pass's."""
    from mlx_dflash.models.drafter import DrafterRunner, propose_rows

    drafter = _drafter(target, **dict(DRAFTER_SHAPES[shape]))
    if shape == "draft-vocab":
        drafter.draft_vocab = np.arange(0, target.vocab_size, 3)
    runners, requests = [], []
    for k, prompt in enumerate(PROMPTS[:3]):
        runner = DrafterRunner(drafter, target)
        _, taps = target.forward([Pass(mx.array(prompt), target.make_cache(), 0)])[0]
        runner.add_context(taps)
        runners.append(runner)
        requests.append((prompt[-1], len(prompt), 7 - k))
    packed = propose_rows(runners, requests)
    for runner, req, got in zip(runners, requests, packed, strict=True):
        want = runner.propose_alone(*req)
        assert got.logits.shape == want.logits.shape
        assert np.allclose(np.array(got.logits), np.array(want.logits), atol=1e-4, rtol=1e-4)
        assert type(got) is type(want)
        assert isinstance(got, LatticeDrafts) == (drafter.cfg.kind == "dflash2")
        if isinstance(got, LatticeDrafts):
            assert np.array_equal(np.array(got.lattice.cand), np.array(want.lattice.cand))
            for part in ("first", "pairs"):
                a, b = getattr(got.lattice, part), getattr(want.lattice, part)
                assert np.allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4), part


DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


@pytest.mark.parametrize("mode, kind", [("dflash", "dflash"), ("ddtree", "dflash"),
                                        ("ddtree", "dflash2")])  # fmt: skip
def test_real_drafters_draft_in_packed_passes_and_stay_exact(target, truths, mode, kind):
    """Rows with real (random) drafters, DFlash 2 too: their drafter passes are packed, and
    every row's output is still its output alone."""
    from mlx_dflash.models.drafter import DrafterRunner

    drafter = _drafter(target, **(DFLASH2 if kind == "dflash2" else {}))
    target.set_taps([0, target.num_layers - 1])
    outs: list = [None] * len(PROMPTS)

    def row(i: int):
        def generate(shared) -> None:
            cfg = GenerationConfig(max_tokens=MAX_TOKENS[i], mode=mode, budget=6)
            session = Session(shared, DrafterRunner(drafter, shared))
            outs[i] = [t for r in generate_rounds(session, PROMPTS[i], cfg) for t in r.tokens]

        return generate

    batcher = run_rows(target, [row(i) for i in range(len(PROMPTS))])
    assert outs == truths
    assert batcher.drafts > 0 and batcher.draft_rows > batcher.drafts  # several rows a pass
