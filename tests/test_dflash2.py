"""DFlash 2 drafters (../shared/docs/dflash2.md): the published layout loads, drafts are the
selector's chain, DDTree follows the lattice's pairwise term, output is the target's exactly
(greedy token for token, sampling in distribution), and bad checkpoints get one sentence."""

from __future__ import annotations

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
from oracle import LatticeOracle, diversify
from published import (
    DFLASH2_DRAFTERS,
    TARGETS,
    dflash2_config,
    dflash2_shapes,
    published_file,
    shrink,
    shrink_dflash2,
    write_dflash2_drafter,
    write_published,
)
from test_engine import mlx_lm_greedy, run
from test_sampling import PROMPT as SAMPLING_PROMPT
from test_sampling import chi2_pvalue, exact_marginals

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.contract import Pass
from mlx_dflash.engine.lattice import Lattice, lattice_tree
from mlx_dflash.engine.sampling import SamplingParams
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.drafter import DrafterRunner, init_drafter, load_drafter
from mlx_dflash.models.drafter_config import DrafterConfig
from mlx_dflash.models.target import Target, load_target
from mlx_dflash.models.tiny import load_module, tiny_target_config
from mlx_dflash.settings import SETTINGS

PROMPT = list(range(3, 31))
N = 48
IDS = [d.split("/")[1] for d in DFLASH2_DRAFTERS]


@pytest.fixture(scope="module", params=list(DFLASH2_DRAFTERS), ids=IDS)
def pair(request, tmp_path_factory):
    """(target, its raw config, the drafter folder): each published DFlash 2 config shrunk,
    beside the shrunk target fixture it drafts for (hf layout, float32)."""
    drafter_id = request.param
    root = tmp_path_factory.mktemp(drafter_id.split("/")[1])
    folder = write_published(root / "target", DFLASH2_DRAFTERS[drafter_id], "hf")
    target = load_target(folder)
    diversify(target.model)
    raw = json.loads((folder / "config.json").read_text())
    dcfg = shrink_dflash2(dflash2_config(drafter_id), raw)
    return target, raw, write_dflash2_drafter(root / "drafter", dcfg), drafter_id


def runner_of(pair):
    target, raw, folder, _ = pair
    drafter = load_drafter(folder, target_config=raw)
    target.set_taps(drafter.cfg.target_layer_ids)
    return DrafterRunner(drafter, target)


# --- the published layout --------------------------------------------------------------------


@pytest.mark.parametrize("drafter_id", list(DFLASH2_DRAFTERS), ids=IDS)
def test_fixture_keeps_every_published_field(drafter_id):
    published = dflash2_config(drafter_id)
    shrunk = shrink_dflash2(published, shrink(TARGETS[DFLASH2_DRAFTERS[drafter_id]]))
    assert set(shrunk) == set(published)
    assert set(shrunk["dflash_config"]) == set(published["dflash_config"])
    assert shrunk["architectures"] == ["DFlash2DraftModel"] and "rope_theta" not in shrunk
    assert shrunk["is_causal"] is False


def test_tensor_names_are_the_published_ones():
    """The Muse drafter's safetensors header (81 tensors) names exactly what we expect."""
    header = published_file("z-lab__Muse-Glimmer-30B-DFlash2.safetensors-header.json")
    names = {k for k in header if k != "__metadata__"}
    cfg = dflash2_config("z-lab/Muse-Glimmer-30B-DFlash2")
    shapes = dflash2_shapes(cfg)
    assert len(names) == 81 and names == set(shapes)
    for name in names:
        assert tuple(header[name]["shape"]) == shapes[name], name
    # and the code under test agrees: every tensor it expects, at its published shape
    from mlx_dflash.checkpoints.read import drafter_weight_shapes

    ours = drafter_weight_shapes(DrafterConfig.from_dict(cfg))
    assert ours == {n: tuple(header[n]["shape"]) for n in names}


def test_published_config_resolves(pair):
    target, raw, folder, drafter_id = pair
    cfg = DrafterConfig.from_dict(json.loads((folder / "config.json").read_text()))
    assert cfg.kind == "dflash2" and cfg.is_causal is False
    assert cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size
    published = dflash2_config(drafter_id)
    assert cfg.rope_theta == published["rope_parameters"]["rope_theta"]
    assert cfg.block_size == published["dflash_config"]["block_size"]
    assert not cfg.layer_is_causal(0)  # top-level is_causal: false, on sliding layers too


def test_convert_round_trips_and_quantizes_the_codebooks(pair, tmp_path):
    from mlx_dflash.checkpoints.convert import convert_drafter

    target, raw, folder, _ = pair
    plain = tmp_path / "plain"
    plain.mkdir()
    convert_drafter(folder, plain, target=None)
    saved = json.loads((plain / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["is_causal"] is False
    assert saved["dflash_config"]["selector_top_k"] == raw_selector(folder)["selector_top_k"]
    q = tmp_path / "q"
    q.mkdir()
    convert_drafter(folder, q, quantize=True, q_bits=8, q_group_size=32)
    weights = mx.load(str(q / "model.safetensors"))
    for book in ("predecessor_codebook", "successor_codebook"):
        assert weights[f"candidate_selector.{book}"].dtype == mx.uint32
        assert f"candidate_selector.{book}.scales" in weights
    assert "layers.0.attention_conv.kernel_projection.scales" in weights
    assert weights["layers.0.attention_conv.base_kernel"].dtype == mx.bfloat16  # as published
    assert "layers.0.attention_conv.base_kernel.scales" not in weights
    # both load and draft; 8-bit drafts mostly agree with float ones
    a, b = load_drafter(plain, target_config=raw), load_drafter(q, target_config=raw)
    target.set_taps(a.cfg.target_layer_ids)
    outs = []
    for d in (a, b):
        s = Session(target, DrafterRunner(d, target))
        outs.append(run(s, PROMPT, max_tokens=16, mode="dflash")[0])
    assert outs[0] == outs[1]  # the output is the target's either way


def raw_selector(folder):
    return json.loads((folder / "config.json").read_text())["dflash_config"]


def test_bad_checkpoints_get_one_sentence(pair, tmp_path):
    target, raw, folder, _ = pair
    cfg = json.loads((folder / "config.json").read_text())
    # a missing codebook
    bad = write_dflash2_drafter(
        tmp_path / "nocb", cfg, drop=("candidate_selector.successor_codebook",)
    )
    with pytest.raises(DFlashError, match="missing tensor 'candidate_selector.successor"):
        load_drafter(bad, target_config=raw)
    # a DFlash 1 config carrying DFlash 2 tensors
    v1 = write_dflash2_drafter(tmp_path / "v1", cfg)
    (v1 / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    with pytest.raises(DFlashError, match="DFlash 2 tensor .* declares DFlashDraftModel"):
        load_drafter(v1, target_config=raw)
    # a DFlash 2 drafter for another target
    other = dict(raw, hidden_size=raw.get("hidden_size", 64) * 2)
    if "text_config" in raw:
        other = dict(raw, text_config=dict(raw["text_config"], hidden_size=128))
    with pytest.raises(DFlashError, match="trained for another target"):
        load_drafter(folder, target_config=other)
    # a DFlash 2 config without its selector sizes
    d = dict(cfg["dflash_config"])
    del d["selector_top_k"]
    (v1 / "config.json").write_text(json.dumps({**cfg, "dflash_config": d}))
    with pytest.raises(DFlashError, match="selector_top_k"):
        load_drafter(v1, target_config=raw)


# --- the lattice -----------------------------------------------------------------------------


def zlab_chain(lat: Lattice) -> list[int]:
    """The selector's greedy walk as z-lab's loop computes it, one position at a time."""
    cand, first, pairs = np.array(lat.cand), np.array(lat.first), np.array(lat.pairs)
    j = int(np.argmax(first))
    out = [int(cand[0, j])]
    for t in range(1, len(cand)):
        j = int(np.argmax(pairs[t - 1, j]))
        out.append(int(cand[t, j]))
    return out


def random_lattice(seed: int, n: int, k: int) -> Lattice:
    rng = np.random.default_rng(seed)
    cand = np.stack([rng.permutation(50)[:k] for _ in range(n)]).astype(np.int32)
    first = rng.normal(size=k).astype(np.float32) * 2
    pairs = rng.normal(size=(n - 1, k, k)).astype(np.float32) * 2
    return Lattice(mx.array(cand), mx.array(first), mx.array(pairs))


@pytest.mark.parametrize("seed, n, k", [(0, 7, 5), (1, 7, 5), (2, 1, 5), (3, 15, 8)])
def test_greedy_chain_is_the_selectors_walk(seed, n, k):
    lat = random_lattice(seed, n, k)
    assert np.array(lat.greedy()).tolist() == zlab_chain(lat)


def sample_row_by_row(lat: Lattice, temperature: float, key: mx.array, vocab: int):
    """Lattice.sample as the selector draws it, one position at a time: each position's q is
    the softmax of its own row given the candidate drawn before it."""
    chosen, q_rows = [], []
    for t, key_t in enumerate(mx.random.split(key, lat.depth)):
        row = lat.first if t == 0 else mx.take(lat.pairs[t - 1], chosen[-1], axis=0)
        q = mx.softmax(row.astype(mx.float32) / temperature, axis=-1)
        chosen.append(mx.random.categorical(mx.log(q), key=key_t))
        q_rows.append(q)
    idx = mx.stack(chosen)[:, None]
    drafts = mx.take_along_axis(lat.cand, idx, axis=-1)[:, 0]
    dense = mx.put_along_axis(
        mx.zeros((lat.depth, vocab), mx.float32), lat.cand, mx.stack(q_rows), axis=-1
    )
    return drafts, dense


@pytest.mark.parametrize("n, k, dtype", [(7, 5, "float32"), (1, 4, "float32"), (15, 8, "bfloat16")])
def test_sampled_chain_is_the_row_by_row_draw_bit_for_bit(n, k, dtype):
    """The chain's q for every edge is computed at once and its rows picked: the same drafts
    and the same q, to the bit, as drawing row by row with the same keys."""
    for seed in range(5):
        lat = random_lattice(seed, n, k)
        dt = getattr(mx, dtype)
        lat = Lattice(lat.cand, lat.first.astype(dt), lat.pairs.astype(dt))
        for temperature in (0.7, 1.0, 1.6):
            key = mx.random.key(100 * seed + int(10 * temperature))
            drafts, q = lat.sample(temperature, key, 64)
            ref_drafts, ref_q = sample_row_by_row(lat, temperature, key, 64)
            assert np.array(drafts).tolist() == np.array(ref_drafts).tolist()
            assert np.array_equal(np.array(q), np.array(ref_q))


@pytest.mark.parametrize("seed", range(6))
def test_lattice_tree_holds_the_most_probable_paths(seed):
    """Best-first over the lattice == brute force over every path, each scored by the chain
    (a child's log-prob is its row's log-softmax given its own parent's candidate)."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 4)), int(rng.integers(2, 4))
    lat = random_lattice(seed, n, k)
    first, pairs = np.array(lat.first, np.float64), np.array(lat.pairs, np.float64)

    def lsm(x):
        return x - np.log(np.exp(x - x.max()).sum()) - x.max()

    scores = []
    for d in range(1, n + 1):
        for path in itertools.product(range(k), repeat=d):
            s = lsm(first)[path[0]]
            for t in range(1, d):
                s += lsm(pairs[t - 1, path[t - 1]])[path[t]]
            scores.append(s)
    best = sorted(scores, reverse=True)
    for budget in (1, 3, 8, 40):
        tree = lattice_tree(99, lat, budget)[0]
        got = sorted(tree.log_probs[1:], reverse=True)
        np.testing.assert_allclose(got, best[:budget], atol=1e-9)
        assert all(tree.parents[i] < i for i in range(1, len(tree.parents)))
        assert np.all(np.diff(tree.log_probs[1:]) <= 1e-12)
    chain = lattice_tree(99, lat, n, branching=1)[0]  # branching 1: the greedy chain itself
    assert chain.tokens[1:].tolist() == zlab_chain(lat)


class Refuses:
    """An allow-filter that refuses some tokens wherever they come (tree.best_first asks a
    grammar no more than this)."""

    stops: frozenset = frozenset()

    def __init__(self, banned):
        self.banned = set(banned)

    def allowed(self, path, token):
        return token not in self.banned

    def run_after(self, path, limit):
        return []

    def goto(self, path):
        pass


@pytest.mark.parametrize("seed", range(6))
def test_lattice_tree_under_a_filter_holds_the_most_probable_allowed_paths(seed):
    """The one heap with a grammar as its filter, over a lattice: brute force over every path
    none of whose tokens is refused, and the refusals are counted."""
    rng = np.random.default_rng(seed)
    n, k = 3, 3
    lat = random_lattice(seed, n, k)
    cand = np.array(lat.cand)
    banned = {int(cand[d, rng.integers(k)]) for d in range(n)}
    first, pairs = np.array(lat.first, np.float64), np.array(lat.pairs, np.float64)

    def lsm(x):
        return x - np.log(np.exp(x - x.max()).sum()) - x.max()

    scores = []
    for d in range(1, n + 1):
        for path in itertools.product(range(k), repeat=d):
            if any(int(cand[t, path[t]]) in banned for t in range(d)):
                continue
            s = lsm(first)[path[0]]
            for t in range(1, d):
                s += lsm(pairs[t - 1, path[t - 1]])[path[t]]
            scores.append(s)
    best = sorted(scores, reverse=True)
    for budget in (1, 4, 30):
        tree, refused = lattice_tree(99, lat, budget, grammar=Refuses(banned))
        assert not banned & set(tree.tokens[1:].tolist())
        np.testing.assert_allclose(sorted(tree.log_probs[1:], reverse=True), best[:budget])
        assert refused > 0 or budget < len(best)  # every refused token was met


@pytest.mark.parametrize("seed", range(4))
def test_lattice_tree_keeps_the_drafters_mass_off_the_candidates(seed):
    """With the drafter's logits, a child's probability is its exp(score / T) over its row's
    candidates' plus every other token's exp(logit / T): brute force over every path, at two
    temperatures, on the host and on the device. Logits with no mass off the candidates give
    the candidates' softmax alone (the tree of a lattice without logits)."""
    rng = np.random.default_rng(seed)
    n, k, vocab = int(rng.integers(1, 4)), int(rng.integers(2, 4)), 50
    lat = random_lattice(seed, n, k)
    cand = np.array(lat.cand)
    z = (rng.normal(size=(n, vocab)) * 2).astype(np.float32)
    z[:, 7] = -np.inf  # outside a draft vocabulary: never any mass
    full = Lattice(lat.cand, lat.first, lat.pairs, mx.array(z))
    for temp in (1.0, 0.7):
        on_cand = np.zeros((n, vocab), bool)
        np.put_along_axis(on_cand, cand.astype(np.int64), True, axis=-1)
        off = np.log(np.where(on_cand, 0.0, np.exp(z.astype(np.float64) / temp)).sum(-1))
        for on_host in (True, False):
            np.testing.assert_allclose(full.off_candidates(temp, on_host), off, rtol=1e-5)
        first = np.array(lat.first, np.float64) / temp
        pairs = np.array(lat.pairs, np.float64) / temp

        def lsm(x, o):
            return x - np.log(np.exp(x).sum() + np.exp(o))

        scores = []
        for d in range(1, n + 1):
            for path in itertools.product(range(k), repeat=d):
                s = lsm(first, off[0])[path[0]]
                for t in range(1, d):
                    s += lsm(pairs[t - 1, path[t - 1]], off[t])[path[t]]
                scores.append(s)
        best = sorted(scores, reverse=True)
        for budget in (1, 3, 8, 40):
            tree = lattice_tree(99, full, budget, temperature=temp)[0]
            np.testing.assert_allclose(tree.log_probs[1:], best[:budget], rtol=1e-5)
            assert all(tree.parents[i] < i for i in range(1, len(tree.parents)))
    # the mass off the candidates is what moves the tree: none there, the selector's alone
    only = np.full((n, vocab), -np.inf, np.float32)
    np.put_along_axis(only, cand.astype(np.int64), 0.0, axis=-1)
    alone = lattice_tree(99, Lattice(lat.cand, lat.first, lat.pairs, mx.array(only)), 40)[0]
    sparse = lattice_tree(99, lat, 40)[0]
    assert alone.tokens.tolist() == sparse.tokens.tolist()
    np.testing.assert_allclose(alone.log_probs, sparse.log_probs, atol=1e-12)


# --- exactness: the engine drafts the chain, and the output is the target's ------------------


@pytest.fixture(scope="module")
def dense_target(tmp_path_factory):
    folder = write_published(tmp_path_factory.mktemp("qwen3"), "Qwen/Qwen3-8B", "hf")
    target = load_target(folder)
    diversify(target.model)
    target.set_taps([0, 1])
    return target


@pytest.mark.parametrize(
    "mode, budget, lookup",
    [("dflash", None, 0)] + [("ddtree", b, 0) for b in (1, 2, 4, 8, 16, 32, 64)]
    + [("ddtree", 8, 6), ("ddtree", "auto", 0), ("ddtree", "auto", 6)],
)  # fmt: skip
def test_lattice_rounds_are_exact_and_follow_the_chain(dense_target, mode, budget, lookup):
    target = dense_target
    ref = mlx_lm_greedy(target, PROMPT, N)
    oracle = LatticeOracle(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.15, seed=3)
    out, taus = run(
        Session(target, oracle), PROMPT, max_tokens=N, mode=mode, budget=budget, lookup=lookup
    )
    assert out == ref
    # The argmax of the logits is never the truth here: a high tau means the chain was used.
    floor = {1: 1.0, 2: 1.9}.get(budget, 3.0) if mode == "ddtree" else 3.0
    assert np.mean(taus) > floor, np.mean(taus)


def test_published_pairs_decode_exactly(pair):
    """The real (random) DFlash 2 drafter model in every mode; past the sliding window."""
    target, _, _, _ = pair
    runner = runner_of(pair)
    ref = mlx_lm_greedy(target, PROMPT, N)
    assert len(PROMPT) + N > 2 * runner.cfg.sliding_window
    for mode, budget in [("dflash", 1), ("ddtree", 4), ("ddtree", 64), ("ddtree", "auto")]:
        out, _ = run(Session(target, runner), PROMPT, max_tokens=N, mode=mode, budget=budget)
        assert out == ref, (mode, budget)


def test_sliding_window_keeps_only_what_a_block_sees(pair):
    """A long prefill keeps sliding_window - 1 context rows per layer, and the drafts equal a
    drafter that was handed only those rows (so the rest really was unseen)."""
    target, _, _, _ = pair
    runner = runner_of(pair)
    w = runner.cfg.sliding_window
    session = Session(target, runner)
    long = list(range(3, 3 + 5 * w))
    _, taps = target.forward([Pass(mx.array(long), session.cache, 0)])[0]
    session.commit(long, taps)
    assert runner.context_len == len(long)
    assert all(c.offset == w - 1 for c in runner.cache)
    fresh = runner_of(pair)
    for c in fresh.cache:
        c.skip(len(long) - (w - 1))
    fresh.add_context(taps[len(long) - (w - 1) :])
    a = runner.propose(7, len(long), 5)
    b = fresh.propose(7, len(long), 5)
    np.testing.assert_array_equal(np.array(a.lattice.greedy()), np.array(b.lattice.greedy()))
    np.testing.assert_allclose(np.array(a.logits), np.array(b.logits), atol=1e-5)
    # rewinding into the dropped rows leaves an empty context there (hybrid targets go back to
    # a snapshot, here the start), and decoding from there is still exact
    again = long[:10] + [5, 9, 11]
    session.rewind(again)
    assert runner.context_len == len(session.tokens) <= 10
    assert all(c.end == len(session.tokens) for c in runner.cache)
    out, _ = run(session, again, max_tokens=12, mode="ddtree", budget=8)
    assert out == mlx_lm_greedy(target, again, 12)


def test_one_host_sync_per_round(dense_target, monkeypatch):
    """The engine's own syncs (numpy's exponentials in a CPU forward sync by design,
    kernels/cpu_math.py: off here)."""
    from mlx_dflash.engine import rounds

    monkeypatch.setattr(SETTINGS, "numpy_math", "0")
    target = dense_target
    ref = mlx_lm_greedy(target, PROMPT, 24)
    oracle = LatticeOracle(PROMPT + ref, target.vocab_size, block_size=8, seed=1)
    reads = []
    real = rounds.to_host
    monkeypatch.setattr(rounds, "to_host", lambda x: reads.append(1) or real(x))
    item = mx.array.item
    calls = []
    monkeypatch.setattr(mx.array, "item", lambda self: calls.append(1) or item(self))
    session = Session(target, oracle)
    n_rounds = 0
    for r in generate_rounds(session, PROMPT, GenerationConfig(max_tokens=24, mode="dflash")):
        n_rounds += not r.prefill
    assert len(reads) == n_rounds and not calls[1:]  # the first token's pick is the prefill's


# --- sampling --------------------------------------------------------------------------------


V = 24


@pytest.mark.parametrize(
    "sampling, mode, budget",
    [
        (SamplingParams(1.0), "dflash", 1),
        (SamplingParams(0.7, 0.9, 0), "dflash", 1),
        (SamplingParams(1.0), "ddtree", 6),
    ],
)
def test_sampling_under_the_selector_is_lossless(sampling, mode, budget):
    """Drafts drawn from the selector's sparse q (top-6 of 24 tokens), the acceptance rule with
    that q: emitted tokens follow the target's distribution, tokens the selector can never
    propose included (they come from the residual)."""
    cfg = tiny_target_config("llama", vocab_size=V, num_hidden_layers=2)
    mod = load_module("llama")
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    diversify(model, gain=1.0, seed=3)
    target = Target(model, None, cfg)
    dcfg = DrafterConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=V,
        block_size=4,
        mask_token_id=V - 1,
        target_layer_ids=[0, 1],
        layer_types=["sliding_attention"],
        sliding_window=4,
        is_causal=False,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=6,
    )
    target.set_taps(dcfg.target_layer_ids)
    drafter = init_drafter(dcfg, seed=5)
    depth, samples, taus = 3, [], []
    for seed in range(1500):
        session = Session(target, DrafterRunner(drafter, target))
        gen = GenerationConfig(
            max_tokens=depth, sampling=sampling, seed=seed, mode=mode, budget=budget
        )
        out = []
        for r in generate_rounds(session, SAMPLING_PROMPT, gen):
            out += r.tokens
            taus += [] if r.prefill else [r.accepted]
        samples.append(out)
    samples = np.array(samples)
    assert 1.0 < np.mean(taus) < 3.0, "both acceptance and rejection must be exercised"
    for k, expected in enumerate(exact_marginals(target, sampling, depth)):
        assert chi2_pvalue(samples[:, k], expected) > 1e-3, f"token {k + 1} is biased"


# --- against z-lab's reference ---------------------------------------------------------------


def test_drafts_equal_zlabs_round_for_round(pair, tmp_path):
    """z-lab's `DFlash2DraftModel` (PyPI `dflash` 0.1.0) proposes our chain at every round of a
    greedy generation, given the same context. Compared below the sliding window only: past it
    the reference's ring buffer hands its window mask the keys out of order (issue 29's notes),
    and the drafts there are ours by design."""
    from unittest import mock

    zlab = pytest.importorskip(
        "dflash.model_mlx", reason="z-lab's reference needs `pip install --no-deps dflash==0.1.0`"
    )
    target, raw, folder, _ = pair
    wide = tmp_path / "drafter"
    wide.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "sliding_window": 256}))
    (wide / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    ours = DrafterRunner(load_drafter(wide, target_config=raw), target)
    target.set_taps(ours.cfg.target_layer_ids)
    with mock.patch.object(zlab, "snapshot_download", lambda path, **_: path):
        theirs = zlab.load_draft(str(wide))
    theirs.bind(target.model)
    assert type(theirs).__name__ == "DFlash2DraftModel"

    rounds, differs = [], []
    propose = ours.propose

    def recording(last, start, n):
        p = propose(last, start, n)
        rounds.append((last, start, n, np.array(p.lattice.greedy()).tolist()))
        differs.append(np.mean(np.array(mx.argmax(p.logits, -1)) != np.array(rounds[-1][3])))
        return p

    ours.propose = recording
    out, _ = run(Session(target, ours), PROMPT, max_tokens=40, mode="dflash")
    _, taps = target.forward([Pass(mx.array(PROMPT + out), target.make_cache(), 0)])[0]
    assert len(rounds) > 10
    assert np.mean(differs) > 0.2, differs  # the selector moves drafts off the argmax
    bs = ours.block_size
    for last, start, n, chain in rounds:
        block = mx.array([[last] + [ours.cfg.mask_token_id] * (bs - 1)])
        path, _, _ = theirs.propose(block, taps[None, :start], theirs.make_cache(), 0.0, 1)
        assert np.array(path)[0, :n].tolist() == chain, start


def test_linear_rounds_verify_the_whole_block_or_an_auto_sized_chain(pair):
    """--mode dflash verifies the drafter's whole block by default, as z-lab's loop does (a
    constant 5-token block capped rounds that loop accepts 8-16 tokens of); --block-size
    shortens it, --budget auto sizes each chain from the measured verify cost, trees keep the
    whole depth, and all of it is exact."""
    target, _, _, _ = pair
    ref = mlx_lm_greedy(target, PROMPT, 24)
    depths = {}
    native = runner_of(pair).block_size  # 8 for Qwen3.8's drafter, 16 for Muse's
    for mode, block, budget in [("dflash", None, None), ("dflash", 4, None),
                                ("dflash", None, "auto"), ("ddtree", None, 64)]:  # fmt: skip
        runner = runner_of(pair)
        cfg = GenerationConfig(max_tokens=24, mode=mode, block_size=block, budget=budget)
        out, drafted = [], []
        for r in generate_rounds(Session(target, runner), PROMPT, cfg):
            out += r.tokens
            drafted += [] if r.prefill else [r.drafted]
        assert out == ref, (mode, block, budget)
        depths[(mode, block, budget)] = max(drafted)
    assert depths[("dflash", None, None)] == native - 1
    assert depths[("dflash", 4, None)] == 3
    assert 1 <= depths[("dflash", None, "auto")] <= native - 1
    assert depths[("ddtree", None, 64)] > 4  # a tree's node count, at any depth
