"""Target -> drafter lookups and hub-id resolution through the conversion cache (no network:
the hub downloader is replaced by a function serving local tiny checkpoints)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlx_dflash.checkpoints import convert as convert_mod
from mlx_dflash.checkpoints import registry
from mlx_dflash.checkpoints.registry import DRAFTERS, PAIRS, base_name, find_drafter, refusal
from mlx_dflash.checkpoints.resolve import cached_path, resolve_model
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.tiny import drafter_config_dict, write_drafter_checkpoint, write_tiny_target
from mlx_dflash.settings import SETTINGS


@pytest.mark.parametrize("target", list(DRAFTERS))
def test_exact_ids(target):
    assert find_drafter(target) == DRAFTERS[target]
    assert find_drafter(target.lower()) == DRAFTERS[target]


@pytest.mark.parametrize(
    "name, drafter",
    [
        ("mlx-community/Qwen3-8B-4bit", "z-lab/Qwen3-8B-DFlash-b16"),
        ("mlx-community/Qwen3-8B-bf16", "z-lab/Qwen3-8B-DFlash-b16"),
        ("mlx-community/Qwen3-8B-4bit-DWQ-053125", "z-lab/Qwen3-8B-DFlash-b16"),
        ("Qwen/Qwen3-4B-MLX-8bit", "z-lab/Qwen3-4B-DFlash-b16"),
        (
            "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit",
            "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        ),
        ("mlx-community/gemma-4-31b-it-4bit", "z-lab/gemma-4-31B-it-DFlash"),
        ("zai-org/GLM-5.1-FP8", "z-lab/GLM-5.1-FP8-DFlash"),
        ("mlx-community/gpt-oss-20b-MXFP4-Q8", "z-lab/gpt-oss-20b-DFlash"),
        ("mlx-community/Qwen3-Coder-30B-A3B-Instruct-6bit", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
        ("mlx-community/Qwen3.5-9B-MLX-4bit", "z-lab/Qwen3.5-9B-DFlash"),
        ("mlx-community/Qwen3.5-35B-A3B-mxfp4", "z-lab/Qwen3.5-35B-A3B-DFlash"),
        ("models/qwen3-4b-4bit/", "z-lab/Qwen3-4B-DFlash-b16"),  # a local folder's name
    ],
)
def test_requantized_names(name, drafter):
    assert find_drafter(name) == drafter


@pytest.mark.parametrize(
    "name", ["mistralai/Mistral-7B-v0.1", "mlx-community/Qwen3-4B-Instruct-2507-4bit", "x"]
)
def test_unknown_target_asks_for_drafter(name):
    with pytest.raises(DFlashError, match="pass --drafter"):
        find_drafter(name)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setattr(SETTINGS, "cache", str(root))
    return root


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Local folders standing in for hub repos."""
    root = tmp_path_factory.mktemp("hub")
    target = write_tiny_target(root / "target", "qwen3")
    cfg = json.loads((target / "config.json").read_text())
    drafter = write_drafter_checkpoint(
        root / "drafter", drafter_config_dict("no_target_layer_ids", cfg, block_size=4)
    )
    return {"acme/Tiny-8B": target, "z-lab/Tiny-8B-DFlash": drafter}


def serve(monkeypatch, hub, calls, config_calls=None):
    """Stand in for the hub: `calls` records full downloads, `config_calls` config.json ones."""

    def fake_download(repo_id):
        calls.append(repo_id)
        if repo_id not in hub:
            raise ConnectionError("no network in tests")
        return str(hub[repo_id])

    def fake_config(repo_id):
        if config_calls is not None:
            config_calls.append(repo_id)
        if repo_id not in hub:
            raise ConnectionError("no network in tests")
        return str(hub[repo_id] / "config.json")

    monkeypatch.setattr(convert_mod, "_snapshot_download", fake_download)
    monkeypatch.setattr(convert_mod, "_download_config", fake_config)


def test_local_folder_returned_as_is(tmp_path, cache, monkeypatch):
    serve(monkeypatch, {}, calls := [])
    assert resolve_model(tmp_path, "target") == tmp_path
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(DFlashError, match="is a file"):
        resolve_model(tmp_path / "f.txt", "target")
    with pytest.raises(DFlashError, match="does not exist"):
        resolve_model(tmp_path / "missing" / "deeper" / "x", "target")
    assert calls == []


def test_cached_id_needs_no_hub(cache, monkeypatch):
    folder = cache / "Qwen" / "Qwen3-8B"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    serve(monkeypatch, {}, calls := [])
    assert resolve_model("Qwen/Qwen3-8B", "target") == folder == cached_path("Qwen/Qwen3-8B")
    assert calls == []


def test_uncached_id_offline_is_one_clear_sentence(cache, monkeypatch):
    serve(monkeypatch, {}, calls := [])
    with pytest.raises(DFlashError, match="Could not reach the Hugging Face hub") as e:
        resolve_model("Qwen/Qwen3-8B", "target")
    assert str(e.value).count(". ") == 0 and calls == []  # config.json already failed
    assert not (cache / "Qwen" / "Qwen3-8B").exists()


def test_hf_hub_offline_flag(cache, monkeypatch):
    from huggingface_hub import constants

    serve(monkeypatch, {}, calls := [])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DFlashError, match="not in the dflash-mlx cache .* offline"):
        resolve_model("Qwen/Qwen3-8B", "target")
    assert calls == []


def test_hub_id_converted_once_then_reused(cache, hub, monkeypatch):
    serve(monkeypatch, hub, calls := [])
    first = resolve_model("acme/Tiny-8B", "target")
    assert first == cache / "acme" / "Tiny-8B"
    assert (first / "config.json").is_file() and list(first.glob("*.safetensors"))
    assert (first / "tokenizer.json").is_file()
    drafter = resolve_model("z-lab/Tiny-8B-DFlash", "drafter", target=first)
    # Converted drafters carry the tap ids derived from the target.
    assert json.loads((drafter / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert calls == ["acme/Tiny-8B", "z-lab/Tiny-8B-DFlash"]
    assert resolve_model("acme/Tiny-8B", "target") == first
    assert resolve_model("z-lab/Tiny-8B-DFlash", "drafter") == drafter
    assert len(calls) == 2


def test_load_pair_finds_and_fetches_the_drafter(cache, hub, monkeypatch):
    """`--model <quantized copy id>` alone: registry lookup, download, convert, load."""
    from mlx_dflash import load_pair

    serve(monkeypatch, {"mlx-community/Tiny-8B-4bit": hub["acme/Tiny-8B"], **hub}, calls := [])
    monkeypatch.setitem(registry.DRAFTERS, "acme/Tiny-8B", "z-lab/Tiny-8B-DFlash")
    target, runner = load_pair("mlx-community/Tiny-8B-4bit", None)
    assert calls == ["mlx-community/Tiny-8B-4bit", "z-lab/Tiny-8B-DFlash"]
    assert runner.block_size == 4 and target.tap_ids == list(runner.cfg.target_layer_ids)
    target, runner = load_pair("mlx-community/Tiny-8B-4bit", None)
    assert len(calls) == 2
    with pytest.raises(DFlashError, match="pass --drafter"):
        load_pair(str(hub["acme/Tiny-8B"]), None)  # folder named "target": unknown


def test_incomplete_cache_folder(cache, monkeypatch):
    (cache / "Qwen" / "Qwen3-8B").mkdir(parents=True)
    serve(monkeypatch, {}, calls := [])
    with pytest.raises(DFlashError, match="incomplete; delete it"):
        resolve_model("Qwen/Qwen3-8B", "target")
    assert calls == []


@pytest.mark.parametrize(
    "name",
    [
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "mlx-community/SmolLM2-135M-Instruct-8bit",
        "models/smollm2-135m-instruct-f32",
        "models/smollm2-135m-instruct",
    ],
)
def test_shipped_drafter(name):
    """The drafter trained here for SmolLM2-135M-Instruct ships in the package, shaped for it."""
    from mlx_dflash.models.drafter_config import DrafterConfig

    folder = find_drafter(name)
    raw = json.loads((Path(folder) / "config.json").read_text())
    cfg = DrafterConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (576, 49152, 30)
    assert (Path(folder) / "model.safetensors").stat().st_size < 40 * 2**20


def test_config_checked_before_any_weight_download(cache, hub, tmp_path, monkeypatch):
    """An unsupported architecture, or a checkpoint of the wrong kind, is one sentence after
    fetching config.json alone: no weight is downloaded, nothing is left in the cache."""
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34}
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    serve(monkeypatch, {"google/gemma-3-4b-it": gemma, **hub}, calls := [], configs := [])
    cases = [
        ("google/gemma-3-4b-it", "target", "architecture 'gemma3' is not supported"),
        ("z-lab/Tiny-8B-DFlash", "target", "pass it with --drafter"),  # swapped arguments
        ("acme/Tiny-8B", "drafter", "not a DFlash drafter"),
    ]
    for repo, kind, needle in cases:
        with pytest.raises(DFlashError, match=needle) as e:
            resolve_model(repo, kind)
        assert str(e.value).startswith(repo)
        assert not cached_path(repo).exists()
    assert calls == [] and configs == [c[0] for c in cases]


PAIR_IDS = [f"{p.target}->{p.drafter}" for p in PAIRS]


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_every_pair_resolves_by_id_and_by_a_requantised_name(pair):
    """A target finds its default drafter by its exact id and by the names its re-quantised
    copies and local folders carry; a second drafter of the same target is listed, not found."""
    default = DRAFTERS[pair.target]
    assert pair.default == (pair.drafter == default)
    name = pair.target.split("/")[1]
    for spelling in (
        pair.target,
        pair.target.upper(),
        f"mlx-community/{name}-4bit",
        f"mlx-community/{name}-MLX-8bit",
        f"some-org/{name}-bf16-DWQ",
        f"models/{name.lower()}-q4_K_M/",
        f"bartowski/{name}-GGUF",
    ):
        assert find_drafter(spelling) == default, spelling


def test_one_default_per_target_and_no_duplicates():
    pairs = [(p.target, p.drafter) for p in PAIRS]
    assert len(set(pairs)) == len(pairs), "a pair is listed twice"
    targets = {p.target for p in PAIRS}
    for t in targets:
        assert sum(p.default for p in PAIRS if p.target == t) == 1, t
    assert set(DRAFTERS) == targets
    # Two targets with one base name would make a re-quantised copy's drafter ambiguous.
    names = [base_name(t) for t in targets | set(registry.SHIPPED)]
    assert len(set(names)) == len(names)
    assert {p.kind for p in PAIRS} <= set(registry.KIND_ARCHITECTURES)
    for p in PAIRS:
        assert p.source and p.model_type, p


def test_published_fixtures_agree_with_the_registry():
    """The shrunk published configs other tests run (tests/published.py, the Kimi fixture) are
    registry pairs, of the model type recorded here, and run here exactly when the registry
    says so: the recorded facts are checked against configs written from the published files."""
    from published import TARGETS
    from test_mla import KIMI_K25

    from mlx_dflash.models.families import architecture

    fixtures = {**TARGETS, "moonshotai/Kimi-K2.5": KIMI_K25}
    for target_id, cfg in fixtures.items():
        pair = next(p for p in PAIRS if p.target == target_id and p.default)
        assert pair.model_type == cfg["model_type"], target_id
        try:
            architecture(cfg)
            runs = True
        except DFlashError:
            runs = False
        assert runs == (refusal(pair) is None), target_id


def test_refusal_follows_the_loaders(monkeypatch):
    """Support is asked of the loaders at call time: a family dropped from ARCHITECTURES turns
    its rows into refusals naming it, and a drafter kind the drafter code stops recognising
    refuses its pairs naming the architecture; nothing in the registry says what runs."""
    from mlx_dflash.models import drafter_config, families

    qwen3 = [p for p in PAIRS if p.model_type == "qwen3"]
    assert qwen3 and all(refusal(p) is None for p in qwen3)
    monkeypatch.delitem(families.ARCHITECTURES, "qwen3")
    for p in qwen3:
        assert "'qwen3'" in refusal(p) and "not supported" in refusal(p)
    assert refusal(next(p for p in PAIRS if p.model_type == "llama")) is None

    dflash2 = [p for p in PAIRS if p.kind == "dflash2" and p.model_type != "qwen3"]
    runnable = [p for p in dflash2 if refusal(p) is None]
    assert runnable
    known = drafter_config.architecture_of
    monkeypatch.setattr(
        drafter_config,
        "architecture_of",
        lambda cfg: None if "DFlash2DraftModel" in cfg["architectures"] else known(cfg),
    )
    for p in runnable:
        assert "'DFlash2DraftModel' is not supported" in refusal(p)


def test_models_command_lists_every_pair(run_cli):
    code, out, err = run_cli("models")
    assert code == 0, err
    runs = sum(refusal(p) is None for p in PAIRS)
    assert f"{runs} of {len(PAIRS)} published pairs run in this build" in out
    lines = out.splitlines()
    for p in PAIRS:
        row = next((ln for ln in lines if p.target in ln and p.drafter in ln), None)
        assert row is not None, f"{p.target} -> {p.drafter} is not listed"
        assert p.kind in row
        assert ("no: " in row) == (refusal(p) is not None), row


def test_models_reads_at_80_columns():
    """Issue 51: at 80 columns the table squeezed "runs here" to nothing and cut the ids. Below
    130 columns each pair is a block: every id whole, the loader's reason, the size of the
    target's weights and, where it runs, the command."""
    from rich.console import Console

    from mlx_dflash.checkpoints.registry import support_rows, weights_gb
    from mlx_dflash.cli.models import render

    console = Console(width=80, record=True, force_terminal=False)
    console.print(render(support_rows(), 80))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for p in PAIRS:
        assert p.target in text and p.drafter in text
        why = refusal(p)
        if why is None:
            assert f"dflash-mlx chat -m {p.target}" in text
        else:
            assert " ".join(why.split()[:4]) in " ".join(text.split())
    assert "8B: 4.5 GB at 4-bit, 8.5 at 8-bit" in text  # Qwen3-8B, from its id
    assert "1T (32B active)" in text  # Kimi, from PARAMS
    assert weights_gb(8, None) == 16 and weights_gb(8, 4) == 4.5  # bf16; 4 bits + a fp16 scale
    assert weights_gb(8, 4, 32) == 5.0  # and bias per 64 (or 32) weights


def test_models_json_is_the_computed_support(run_cli, monkeypatch):
    """--json is the registry's rows, runs as computed; dropping a family from the loader flips
    its rows to refused, naming the family, in the JSON and in the table."""
    from mlx_dflash.models import families

    code, out, err = run_cli("models", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["target"], r["drafter"], r["kind"]) for r in rows] == [
        (p.target, p.drafter, p.kind) for p in PAIRS
    ]
    for r, p in zip(rows, PAIRS, strict=True):
        assert r["runs"] == (refusal(p) is None) and r["refused"] == refusal(p)
        assert r["default"] == p.default and r["model_type"] == p.model_type
        assert (r["command"] is None) == (refusal(p) is not None)
    qwen3 = next(r for r in rows if r["target"] == "Qwen/Qwen3-8B")
    assert qwen3["weights_gb"] == {"bf16": 16.0, "8bit": 8.5, "4bit": 4.5}

    monkeypatch.delitem(families.ARCHITECTURES, "qwen3_5")
    rows = json.loads(run_cli("models", "--json")[1])
    flipped = [r for r in rows if r["model_type"] == "qwen3_5"]
    assert flipped and all(not r["runs"] and "'qwen3_5'" in r["refused"] for r in flipped)
    assert all(r["runs"] for r in rows if r["model_type"] == "qwen3")
    out = run_cli("models")[1]
    row = next(ln for ln in out.splitlines() if "z-lab/Qwen3.5-4B-DFlash" in ln)
    assert "no: " in row and "qwen3_5" in out


@pytest.mark.parametrize(
    "args, needle",
    [(("--frobnicate",), "No such option"), (("Qwen/Qwen3-8B",), "unexpected extra argument")],
)
def test_models_bad_arguments_are_one_usage_error(run_cli, args, needle):
    code, out, err = run_cli("models", *args)
    assert code == 2 and needle in err and "Traceback" not in err and not out


def test_doctor_counts_the_pairs_that_run():
    from mlx_dflash.cli import doctor

    runs = sum(refusal(p) is None for p in PAIRS)
    line = doctor.pairs_summary()["published pairs"]
    assert line == f"{runs} of {len(PAIRS)} run in this build; see dflash-mlx models"


def readme_pairs() -> list[list[str]]:
    """The cells of README.md's "Published pairs" table, one list per row."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    lines = text[text.index("### Published pairs") :].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| target |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_readme_published_pairs_match_this_build():
    """README's table lists every registry pair once, with the kind and model type recorded
    here, says "yes" exactly where this build runs the pair and otherwise "refused" naming what
    the loader names, and every test it cites exists."""
    root = Path(__file__).resolve().parents[1]
    ticked = [[re.findall(r"`([^`]+)`", c) for c in row] for row in readme_pairs()]
    listed = {(t[0][0], t[1][0]): row for t, row in zip(ticked, readme_pairs(), strict=True)}
    assert len(listed) == len(ticked), "a pair is listed twice"
    assert set(listed) == {(p.target, p.drafter) for p in PAIRS}
    for p in PAIRS:
        target, drafter, kind, model_type, runs, tests = listed[(p.target, p.drafter)]
        assert kind == p.kind and model_type == f"`{p.model_type}`", p
        assert ("(alternative)" in drafter) == (not p.default), p
        why = refusal(p)
        if why is None:
            assert runs == "yes", (
                f"{p.target} -> {p.drafter} runs in this build: README says {runs}"
            )
        else:
            named = re.search(r"'([^']+)'", why)
            culprit = named.group(1) if named else p.model_type
            assert runs.startswith("refused") and culprit in runs, (
                f"{p.target} -> {p.drafter} is refused here ({why}); README says {runs}"
            )
        cited = re.findall(r"`(tests/\w+\.py)::(\w+)`", tests)
        assert cited or tests == "none yet", tests
        for path, name in cited:
            assert re.search(rf"^def {name}\(", (root / path).read_text(), re.M), (path, name)


def test_doctor_says_version_memory_disk_and_the_next_step(run_cli, monkeypatch):
    """Issue 51: doctor showed neither the package version, the memory nor the free disk, and
    left the user to guess what to run. The next step fits the machine: the largest published
    target whose 4-bit weights take at most half of what a Mac's GPU may hold."""
    from mlx_dflash.cli import doctor

    code, out, err = run_cli("doctor")
    assert code == 0, err
    for key in ("dflash-mlx", "memory", "disk", "next step"):
        assert any(line.strip().startswith(key + " ") for line in out.splitlines()), key
    assert "GB free for models" in out
    assert "dflash-mlx generate -p" in doctor.next_step(None, None, blas_ok=True)  # no Metal here
    assert "libopenblas" in doctor.next_step(None, None, blas_ok=False)
    assert doctor.next_step("m", "d", True) == "dflash-mlx chat -m m -d d"
    monkeypatch.setattr(doctor, "memory_bytes", lambda: (16e9, 10.7e9))  # a 16 GB Mac
    step = doctor.next_step(None, None, blas_ok=True)
    assert step.startswith("dflash-mlx chat -m Qwen/Qwen3.5-9B") and "5.1 GB" in step, step


def test_doctor_reports_a_target_with_no_known_drafter(tmp_path):
    """A target no published drafter is known for runs prompt lookup alone (generate's default),
    so doctor reports it so rather than stopping at "pass --drafter"."""
    from mlx_dflash.cli import doctor
    from mlx_dflash.models.tiny import write_tiny_target

    folder = write_tiny_target(tmp_path / "target", "qwen3")
    rows = doctor.pair_report(str(folder), None)
    assert rows["target"].startswith(str(folder)) and "qwen3, 6 layers" in rows["target"]
    assert rows["drafter"].startswith("none known for this target: it runs prompt lookup alone")
