"""`dflash-mlx convert`: round trips, every rejection path, atomic output, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_dflash.models.tiny as F
from mlx_dflash.checkpoints import convert as conv
from mlx_dflash.checkpoints.read import (
    check_drafter_weights,
    check_pair,
    drafter_weight_shapes,
    read_drafter,
)
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.drafter_config import DrafterConfig

LINEAR_PARTS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {t: F.write_tiny_target(root / t, t, seed=i) for i, t in enumerate(F.TARGET_TYPES)}


@pytest.fixture(scope="module")
def target_cfg() -> dict:
    return F.tiny_target_config("qwen3")


@pytest.fixture
def drafter(tmp_path, target_cfg) -> Path:
    return F.write_drafter_checkpoint(
        tmp_path / "drafter", F.drafter_config_dict("toplevel_block_size", target_cfg)
    )


def _loaded(folder: Path) -> dict[str, mx.array]:
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        w, meta = mx.load(str(f), return_metadata=True)
        assert meta.get("format") == "mlx"
        weights.update(w)
    return weights


def _resolved(folder: Path, n_target=None) -> DrafterConfig:
    return DrafterConfig.from_dict(json.loads((folder / "config.json").read_text()), n_target)


def _rejects(match: str, *args, **kwargs) -> None:
    with pytest.raises(DFlashError, match=match) as e:
        conv.convert(*args, **kwargs)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# Drafters


@pytest.mark.parametrize("variant", F.DRAFTER_VARIANTS)
def test_drafter_round_trip(tmp_path, target_cfg, variant):
    raw = F.drafter_config_dict(variant, target_cfg, n_layers=3, block_size=8)
    prefix = "model." if variant == "rope_parameters" else ""
    src = F.write_drafter_checkpoint(tmp_path / "src", raw, seed=3, prefix=prefix)
    out = conv.convert(src, tmp_path / "out", dtype="float32")

    assert _resolved(out) == DrafterConfig.from_dict(raw)
    original = {
        _zlab_name(k.removeprefix(prefix)): v
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    converted = _loaded(out)
    assert converted.keys() == original.keys()
    for k, v in original.items():
        assert mx.array_equal(converted[k], v), k
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    cfg, weights = read_drafter(out, target_cfg)
    expected = DrafterConfig.from_dict(raw, target_cfg["num_hidden_layers"])
    if expected.vocab_size is None:  # Muse's assistant: the target's, once paired
        expected = dataclasses.replace(expected, vocab_size=target_cfg["vocab_size"])
    assert cfg == expected and weights.keys() == original.keys()


def _zlab_name(name: str) -> str:
    """Muse Glimmer's assistant names its context projection and norm `encoder.fc` and
    `encoder.output_norm_enc`; converted folders use z-lab's `fc` and `hidden_norm`."""
    for alias, zlab in (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm.")):
        if name.startswith(alias):
            return zlab + name[len(alias) :]
    return name


def test_drafter_taps_derived_from_target(tmp_path, targets):
    tcfg = F.tiny_target_config("llama")
    raw = F.drafter_config_dict("no_target_layer_ids", tcfg, num_target_layers=None)
    src = F.write_drafter_checkpoint(tmp_path / "src", raw)
    _rejects("target_layer_ids", src, tmp_path / "a")
    out = conv.convert(src, tmp_path / "b", target=targets["llama"])
    saved = json.loads((out / "config.json").read_text())
    assert saved["dflash_config"]["target_layer_ids"] == [1, 3]
    assert saved["num_target_layers"] == 6
    assert _resolved(out).target_layer_ids == [1, 3]


def test_drafter_dtype_default_and_explicit(tmp_path, drafter):
    out = conv.convert(drafter, tmp_path / "default")  # config says torch_dtype bfloat16
    assert {v.dtype for v in _loaded(out).values()} == {mx.bfloat16}
    out = conv.convert(drafter, tmp_path / "f16", dtype="float16")
    assert {v.dtype for v in _loaded(out).values()} == {mx.float16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"


def test_drafter_quantized(tmp_path, drafter, target_cfg):
    out = conv.convert(drafter, tmp_path / "q", dtype="float32", quantize=True, q_bits=4)
    saved = json.loads((out / "config.json").read_text())
    assert saved["quantization"] == {"group_size": 64, "bits": 4}
    original = mx.load(str(drafter / "model.safetensors"))
    weights = _loaded(out)
    for name, w in original.items():
        base = name.removesuffix(".weight")
        if base.split(".")[-1] in LINEAR_PARTS:
            q = weights[name]
            assert q.dtype == mx.uint32 and q.shape == (w.shape[0], w.shape[1] * 4 // 32)
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            deq = mx.dequantize(q, scales, biases, group_size=64, bits=4)
            err = mx.abs(deq - w).max().item()
            assert err <= 2 * mx.abs(w).max().item() / 15, name  # within one 4-bit step
            layer = nn.QuantizedLinear(w.shape[1], w.shape[0], bias=False, group_size=64, bits=4)
            layer.load_weights([("weight", q), ("scales", scales), ("biases", biases)])
            x = mx.random.normal((3, w.shape[1]))
            assert mx.allclose(layer(x), x @ deq.T, atol=1e-4)
        else:
            assert mx.array_equal(weights[name], w), name
            assert f"{base}.scales" not in weights
    assert sum(k.endswith(".scales") for k in weights) == 1 + 7 * 2
    cfg, _ = read_drafter(out, target_cfg)
    check_drafter_weights(cfg, weights, saved["quantization"])
    _rejects("already quantized", out, tmp_path / "qq", quantize=True)
    again = conv.convert(out, tmp_path / "again")  # a quantized MLX drafter passes through
    assert json.loads((again / "config.json").read_text())["quantization"]["bits"] == 4
    assert all(mx.array_equal(v, weights[k]) for k, v in _loaded(again).items())


def test_drafter_quantize_skips_layers_not_divisible_by_group(tmp_path, drafter):
    out = conv.convert(drafter, tmp_path / "q", quantize=True, q_group_size=128, q_bits=8)
    weights = _loaded(out)
    quantized = {k.removesuffix(".scales") for k in weights if k.endswith(".scales")}
    # hidden 64 < 128: only fc (2 taps * 64 inputs) and down_proj (128 inputs) qualify.
    assert quantized == {"fc", "layers.0.mlp.down_proj", "layers.1.mlp.down_proj"}
    read_drafter(out)


def test_drafter_shape_listing_matches_published_layout(target_cfg):
    raw = F.drafter_config_dict("sliding", target_cfg, n_layers=5)
    assert drafter_weight_shapes(DrafterConfig.from_dict(raw)) == F.drafter_tensor_shapes(raw)


# --------------------------------------------------------------------------------------------
# Targets


def _logits(folder: Path) -> mx.array:
    import mlx_lm

    model, tok = mlx_lm.load(str(folder))
    ids = tok.encode("Once upon a time, there was a tiny model.")
    return model(mx.array([ids]))


@pytest.mark.parametrize("model_type", F.TARGET_TYPES)
def test_target_round_trip(tmp_path, targets, model_type):
    out = conv.convert(targets[model_type], tmp_path / "out")
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    assert mx.array_equal(_logits(out), _logits(targets[model_type]))
    logits = _logits(out)[0]
    assert len(set(mx.argmax(logits, axis=-1).tolist())) > 1  # the random model is not degenerate


def test_target_from_hf_layout(tmp_path, targets):
    """Per-expert HF tensors go through mlx-lm's sanitize into the same model."""
    src = F.write_tiny_target(tmp_path / "hf", "qwen3_moe", seed=3, hf_layout=True)
    assert any(".experts.3." in k for k in mx.load(str(src / "model.safetensors")))
    out = conv.convert(src, tmp_path / "out")
    assert not any(".experts." in k for k in _loaded(out))
    assert mx.array_equal(_logits(out), _logits(targets["qwen3_moe"]))


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_target_quantized(tmp_path, targets, model_type):
    import mlx_lm

    out = conv.convert(targets[model_type], tmp_path / "q", quantize=True, dtype="float16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    model, tok = mlx_lm.load(str(out))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    text = mlx_lm.generate(model, tok, "Once upon a time", max_tokens=8)
    assert isinstance(text, str) and text
    ref = _logits(targets[model_type]).astype(mx.float32)
    got = _logits(out).astype(mx.float32)
    assert mx.isfinite(got).all() and mx.abs(got - ref).mean().item() < 0.5
    _rejects("already quantized", out, tmp_path / "qq", quantize=True)
    # --dequantize: float weights again (fast BLAS path on CPUs), same function as the 4-bit model.
    deq = conv.convert(out, tmp_path / "dq", dequantize=True, dtype="float32")
    assert "quantization" not in json.loads((deq / "config.json").read_text())
    model, _ = mlx_lm.load(str(deq))
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert mx.abs(_logits(deq) - got).max().item() < 5e-2  # the 4-bit model ran in float16
    _rejects("not quantized", targets[model_type], tmp_path / "dq2", dequantize=True)


def test_sharded_output(tmp_path, targets, drafter, monkeypatch):
    import mlx_lm

    monkeypatch.setattr(conv, "MAX_SHARD_BYTES", 40_000)
    out = conv.convert(targets["qwen3"], tmp_path / "t")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    mlx_lm.load(str(out))
    out = conv.convert(drafter, tmp_path / "d")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    read_drafter(out)


# --------------------------------------------------------------------------------------------
# Rejections


def test_missing_config(tmp_path, drafter):
    (drafter / "config.json").unlink()
    _rejects(r"has no config\.json", drafter, tmp_path / "out")


def test_missing_weights(tmp_path, drafter):
    (drafter / "model.safetensors").unlink()
    _rejects(r"no \*\.safetensors", drafter, tmp_path / "out")


def test_pickle_only_checkpoint_is_refused_unread(tmp_path, drafter):
    (drafter / "model.safetensors").unlink()
    (drafter / "pytorch_model.bin").write_bytes(b"\x80\x04 not even a real pickle")
    _rejects("pytorch_model.bin.*safetensors is required", drafter, tmp_path / "out")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tmp_path, drafter, targets, damage):
    f = drafter / "model.safetensors"
    if damage == "garbage":
        f.write_bytes(b"definitely not safetensors" * 10)
    else:
        os.truncate(f, f.stat().st_size // 2)
    _rejects(r"model\.safetensors.*not a valid safetensors", drafter, tmp_path / "out")
    t = tmp_path / "t"
    t.mkdir()
    for p in targets["llama"].iterdir():
        (t / p.name).write_bytes(p.read_bytes())
    os.truncate(t / "model.safetensors", 100)
    _rejects(r"model\.safetensors.*not a valid safetensors", t, tmp_path / "out2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


@pytest.mark.parametrize(
    "hook, match",
    [
        (
            {"bad_shape_key": "layers.1.self_attn.k_proj.weight"},
            "'layers.1.self_attn.k_proj.weight' has shape",
        ),
        ({"bad_shape_key": "fc.weight"}, "'fc.weight' has shape"),
        (
            {"drop_keys": ["layers.0.mlp.up_proj.weight"]},
            "missing tensor 'layers.0.mlp.up_proj.weight'",
        ),
        (
            {"extra_keys": {"layers.0.mlp.extra.weight": (64,)}},
            "unexpected tensor 'layers.0.mlp.extra",
        ),
        ({"extra_keys": ["lm_head.weight"]}, "'lm_head.weight'.*different drafter family"),
        (
            {"extra_keys": ["embed_tokens.weight"], "prefix": "model."},
            "embed_tokens.*different drafter family",
        ),
    ],
)
def test_bad_drafter_tensors(tmp_path, target_cfg, hook, match):
    raw = F.drafter_config_dict("dflash_config_block_size", target_cfg)
    src = F.write_drafter_checkpoint(tmp_path / "src", raw, **hook)
    _rejects(match, src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "target_overrides, drafter_overrides, match",
    [
        ({"hidden_size": 128, "head_dim": 32}, {}, "hidden size 64 differs from the target's 128"),
        ({"vocab_size": 300}, {}, "vocabulary size 256 differs from the target's 300"),
        (
            {},
            {"dflash_config": {"target_layer_ids": [1, 6]}},
            "taps target layer 6 .* only 6 layers",
        ),
        ({}, {"dflash_config": {"mask_token_id": 256}}, "mask_token_id 256 is outside"),
    ],
)
def test_mismatched_pair(tmp_path, target_overrides, drafter_overrides, match):
    base = F.tiny_target_config("qwen3")
    raw = F.drafter_config_dict("toplevel_block_size", base, **drafter_overrides)
    src = F.write_drafter_checkpoint(tmp_path / "src", raw)
    target = tmp_path / "target"
    target.mkdir()
    tcfg = F.tiny_target_config("qwen3", **target_overrides)
    (target / "config.json").write_text(json.dumps(tcfg))
    _rejects(match, src, tmp_path / "out", target=target)
    with pytest.raises(DFlashError, match=match):  # the same rule through the nested layout
        check_pair(DrafterConfig.from_dict(raw), {"model_type": "vlm", "text_config": tcfg})


def test_hub_unreachable_or_missing(tmp_path, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    def offline(repo_id):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(conv, "_download_config", offline)
    monkeypatch.setattr(conv, "_snapshot_download", offline)
    _rejects(
        "Could not reach the Hugging Face hub.*pass a local folder", "z-lab/nope", tmp_path / "o"
    )

    class Missing(RepositoryNotFoundError):
        def __init__(self):
            Exception.__init__(self, "404")  # the real one wants an HTTP response

    def missing(repo_id):
        raise Missing()

    monkeypatch.setattr(conv, "_download_config", missing)
    monkeypatch.setattr(conv, "_snapshot_download", missing)
    _rejects("neither a local folder nor a model", "z-lab/nope", tmp_path / "o")
    _rejects("does not exist", str(tmp_path / "no" / "such" / "folder"), tmp_path / "o")


def test_hub_fetch_uses_snapshot(tmp_path, drafter, monkeypatch):
    monkeypatch.setattr(conv, "_snapshot_download", lambda repo_id: str(drafter))
    monkeypatch.setattr(conv, "_download_config", lambda repo_id: str(drafter / "config.json"))
    out = conv.convert("z-lab/tiny-DFlash", tmp_path / "out")
    assert (out / "config.json").exists()


def test_misc_argument_errors(tmp_path, drafter, targets):
    _rejects("--target only applies", targets["qwen3"], tmp_path / "o", target=targets["qwen3"])
    _rejects("--q-bits", drafter, tmp_path / "o", quantize=True, q_bits=7)
    _rejects("--q-group-size", drafter, tmp_path / "o", quantize=True, q_group_size=48)
    _rejects("--dtype", drafter, tmp_path / "o", dtype="float64")
    _rejects("is a DFlash drafter, not a target", drafter, tmp_path / "o", kind="target")
    _rejects("must not be the source", drafter, drafter, force=True)
    assert (drafter / "model.safetensors").exists()
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# Output folder safety


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_existing_output_is_untouched_without_force(tmp_path, drafter):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    _rejects("already exists; pass --force", drafter, out)
    assert _siblings(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    conv.convert(drafter, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert _siblings(tmp_path) == ["drafter", "out"]


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("kind", ["drafter", "target"])
def test_failure_leaves_nothing_half_written(
    tmp_path, drafter, targets, monkeypatch, existing, kind
):
    def failing_save(folder, weights):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(conv, "save_weights", failing_save)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    if existing:
        out.mkdir()
        (out / "old.txt").write_text("old")
    source = drafter if kind == "drafter" else targets["llama"]
    with pytest.raises(RuntimeError, match="disk full"):
        conv.convert(source, out, force=existing)
    assert _siblings(work) == (["out"] if existing else [])
    if existing:
        assert _siblings(out) == ["old.txt"]


def test_interrupt_after_weights_cleans_up(tmp_path, drafter, monkeypatch):
    def interrupted(path, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(drafter, tmp_path / "out")
    assert _siblings(tmp_path) == ["drafter"]


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_convert_and_errors(tmp_path, drafter, run_cli):
    out = tmp_path / "out"
    code, stdout, _ = run_cli("convert", drafter, "--out", out, "-q", "--dtype", "float32")
    assert code == 0 and "Wrote" in stdout
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    for args in (
        ("convert", drafter, "--out", out),
        ("convert", tmp_path / "missing", "--out", tmp_path / "o2"),
        ("convert", drafter, "--out", tmp_path / "o3", "--q-bits", "7", "-q"),
    ):
        code, _, err = run_cli(*args)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert "Traceback" not in err


def test_cli_binary_offline_hub(tmp_path):
    """The installed entry point, for real: offline hub id -> one line, exit 1, no traceback."""
    exe = Path(sys.executable).with_name("dflash-mlx")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlx_dflash.cli"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run(
        [*cmd, "convert", "nobody-dflash/absent-model", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "error: Could not reach the Hugging Face hub to fetch nobody-dflash/absent-model (and no "
        "local folder of that name exists); pass a local folder instead."
    ]
    assert not (tmp_path / "o").exists()
