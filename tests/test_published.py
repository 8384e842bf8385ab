"""Every registry pair, in every layout users download, loads and decodes exactly.

Targets are the published configs with only their sizes shrunk (tests/published.py), written in
the original Hugging Face layout, as text-only Qwen3.5 exports, as mlx-community's mlx-lm (4-bit,
8-bit) and mlx-vlm conversions; each sits in a local folder named as users name them, so
`load_pair(folder)` finds the z-lab drafter through the registry and fetches it from a stand-in
hub. DFlash and DDTree output must equal plain mlx-lm greedy decoding of the same folder.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from oracle import OracleDrafter
from published import (
    HYBRID_ONLY,
    LAYOUTS,
    TARGETS,
    VOCAB,
    _random_model,
    shrink,
    write_published,
    write_published_drafter,
)

from mlx_dflash.checkpoints import convert as convert_mod
from mlx_dflash.checkpoints.registry import DRAFTERS
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.models.families import model_classes
from mlx_dflash.settings import SETTINGS

PROMPT = list(range(3, 43))
N = 40
# Qwen3.8 has Qwen3.5-27B's layouts (tested there); Muse Glimmer has no text-only export.
LAYOUTS_OF = {"Qwen/Qwen3.8-27B": ("hf",), "meta-models/Muse-Glimmer-30B": ("hf", "mlx-lm-4bit")}
CASES = [
    (tid, layout)
    for tid in TARGETS
    for layout in LAYOUTS_OF.get(tid, LAYOUTS)
    if layout not in HYBRID_ONLY or TARGETS[tid]["model_type"].startswith("qwen3_5")
]


def local_name(target_id: str, layout: str) -> str:
    """The folder name a user's download carries (mlx-community's naming for MLX copies)."""
    name = target_id.split("/")[1]
    if layout.startswith("mlx-"):
        if name.startswith("Llama-3.1"):
            name = "Meta-" + name
        name += "-" + layout.rsplit("-", 1)[1]
    return name


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The z-lab drafter of every registry target, shrunk, standing in for the hub."""
    root = tmp_path_factory.mktemp("zlab")
    return {
        DRAFTERS[tid]: write_published_drafter(root / DRAFTERS[tid].split("/")[1], tid)
        for tid in TARGETS
    }


@pytest.fixture
def served(hub, monkeypatch, tmp_path):
    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path / "cache"))
    calls = []

    def snapshot(repo_id):
        calls.append(repo_id)
        return str(hub[repo_id])

    monkeypatch.setattr(convert_mod, "_snapshot_download", snapshot)
    monkeypatch.setattr(convert_mod, "_download_config", lambda r: str(hub[r] / "config.json"))
    return calls


def mlx_lm_reference(folder, n: int) -> list[int]:
    """Plain mlx-lm greedy decoding of the folder, loaded by mlx-lm on its own."""
    from mlx_lm.utils import load_model

    model, _ = load_model(folder, get_model_classes=model_classes)
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    steps = generate_step(mx.array(PROMPT), model, max_tokens=n, sampler=greedy)
    return [int(t) for t, _ in steps]


def decode(session, mode, budget=16):
    cfg = GenerationConfig(max_tokens=N, mode=mode, budget=budget)
    out, taus = [], []
    for r in generate_rounds(session, PROMPT, cfg):
        out += r.tokens
        taus += [] if r.prefill else [r.accepted]
    return out, taus


@pytest.mark.parametrize("target_id, layout", CASES, ids=[f"{t}:{lay}" for t, lay in CASES])
def test_published_pair_runs_exactly(target_id, layout, tmp_path, served):
    from mlx_dflash import load_pair

    folder = write_published(tmp_path / layout / local_name(target_id, layout), target_id, layout)
    ref = mlx_lm_reference(folder, N)
    assert len(set(ref)) > 5, "the fixture's greedy continuation is too repetitive to test"

    target, runner = load_pair(str(folder), None)
    assert served == [DRAFTERS[target_id]]  # found through the registry, fetched once
    assert target.tap_ids == list(runner.cfg.target_layer_ids)
    for mode, budget in (("dflash", 16), ("ddtree", 4)):
        out, _ = decode(Session(target, runner), mode, budget)
        assert out == ref, f"{mode} differs from mlx-lm"

    # A drafter that is right most of the time, so acceptance, commits and rewinds happen.
    oracle = OracleDrafter(PROMPT + ref, VOCAB, block_size=8, corrupt=0.3, seed=3)
    for mode, budget in (("dflash", 16), ("ddtree", 8)):
        out, taus = decode(Session(target, oracle), mode, budget)
        assert out == ref, f"{mode} with partial acceptance differs from mlx-lm"
        assert np.mean(taus) > 2


@pytest.mark.parametrize("target_id", [t for t in TARGETS if "text_config" in TARGETS[t]])
def test_hf_fixture_holds_the_model_it_was_written_from(target_id, tmp_path):
    """The HF-layout writer inverts mlx-lm's sanitize exactly (norm shift, conv axes, fused
    experts), so the published layout tested above is the real one, not a lookalike."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    folder = write_published(tmp_path / "hf", target_id, "hf", seed=5)
    loaded, _ = load_model(folder, get_model_classes=model_classes)
    original = dict(tree_flatten(_random_model(shrink(TARGETS[target_id]), 5).parameters()))
    got = dict(tree_flatten(loaded.parameters()))
    assert set(got) == set(original)
    for k, v in original.items():
        assert mx.allclose(got[k], v, atol=1e-6).item(), k
    raw = json.loads((folder / "config.json").read_text())
    assert raw["text_config"]["model_type"].endswith("_text")  # the wrapper, as published


@pytest.mark.parametrize("target_id", list(TARGETS))
def test_fixture_keeps_every_published_field(target_id):
    """Shrinking changes values, never the set of fields (or their nesting)."""
    pub, small = TARGETS[target_id], shrink(TARGETS[target_id])
    assert set(small) == set(pub)
    if "text_config" in pub:
        assert set(small["text_config"]) == set(pub["text_config"])
        assert set(small["vision_config"]) == set(pub["vision_config"])


@pytest.mark.parametrize("gate", ["sigmoid", "gelu"])
def test_an_output_gate_type_we_cannot_compute_is_refused(gate, tmp_path):
    """Qwen3.8's "swish" names the SiLU gate mlx-lm computes (decoded exactly above); any other
    value would still run and only show in the tokens, so it ends in one sentence instead."""
    from mlx_dflash.errors import DFlashError
    from mlx_dflash.models.target import load_target

    folder = write_published(tmp_path / "Qwen3.8-27B", "Qwen/Qwen3.8-27B", "hf")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["output_gate_type"] = gate
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as err:
        load_target(folder)
    assert f"output_gate_type '{gate}' is not supported" in str(err.value)
    assert "\n" not in str(err.value)
