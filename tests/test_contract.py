"""The engine contract (issue 28): typed protocols that mypy checks, one commit path, round kinds
chosen once, a local world, self-describing chunks, and Metal hygiene that is a no-op here."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from oracle import OracleDrafter, diversify

from mlx_dflash import distributed
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds, stream_generate
from mlx_dflash.engine import device as engine_device
from mlx_dflash.engine.contract import Pass
from mlx_dflash.engine.session import MODES
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mlx_dflash"
PROMPT = list(range(3, 30))
N = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target = load_target(write_tiny_target(tmp_path_factory.mktemp("qwen3"), "qwen3"))
    diversify(target.model)
    target.set_taps([1, 3])
    return target


def plain(target, prompt=PROMPT, n=N) -> list[int]:
    rounds = generate_rounds(Session(target), prompt, GenerationConfig(max_tokens=n, mode="ar"))
    return [t for r in rounds for t in r.tokens]


def oracle_for(target, corrupt=0.3):
    truth = PROMPT + plain(target)
    return OracleDrafter(truth, target.vocab_size, block_size=8, corrupt=corrupt, seed=3)


# --- typed protocols ------------------------------------------------------------------------


needs_mypy = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is a dev dependency"
)


def mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True
    )


@needs_mypy
def test_every_implementation_satisfies_the_protocols():
    """`make lint`'s type check: the caches, drafters, worlds and the target conform."""
    done = mypy()
    assert done.returncode == 0, done.stdout + done.stderr


@needs_mypy
def test_the_type_check_catches_a_drafter_that_breaks_the_contract(tmp_path):
    """A drafter whose propose lost an argument is refused, so the check above can fail."""
    bad = tmp_path / "bad_drafter.py"
    bad.write_text(
        "import mlx.core as mx\n"
        "from mlx_dflash.engine.contract import Drafter\n\n\n"
        "class Half:\n"
        "    block_size = 8\n"
        "    context_len = 0\n\n"
        "    def reset(self, length: int = 0) -> None: ...\n\n"
        "    def add_context(self, taps: mx.array) -> None: ...\n\n"
        "    def propose(self, last_token: int, start: int) -> mx.array: ...\n\n\n"
        "_check: type[Drafter] = Half\n"
    )
    # The repository's mypy cache (the check above fills it): a fresh one costs ~10 s here.
    done = mypy(str(bad))
    assert done.returncode == 1 and "type[Drafter]" in done.stdout, done.stdout


# --- one commit path, round kinds chosen once, no `world is None` ---------------------------


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node.func


def test_session_commit_is_the_only_place_caches_and_tokens_move():
    """Outside engine/session.py, nothing above the models trims or compacts a cache, feeds the
    drafter, or extends a session's tokens."""
    above_models = [p for p in PKG.rglob("*.py") if not p.is_relative_to(PKG / "models")]
    found = []
    for path in above_models:
        if path.name in ("session.py", "distributed.py"):
            continue
        for f in _calls(path):
            base = ast.unparse(f.value)
            if f.attr in ("trim", "compact", "add_context") or (
                f.attr in ("extend", "append") and base.endswith("session.tokens")
            ):
                found.append(f"{path.relative_to(ROOT)}: {base}.{f.attr}")
    assert not found, found


def test_modes_are_only_compared_where_the_round_kind_is_chosen():
    """`mode in ("dflash", "ddtree")` and friends live in engine/session.py alone; everyone
    else asks GenerationConfig.uses_drafter / round_kind (or uses_drafter(mode))."""
    found = []
    for path in PKG.rglob("*.py"):
        if path == PKG / "engine" / "session.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            names = {ast.unparse(x) for x in [node.left, *node.comparators]}
            if not any(n == "mode" or n.endswith(".mode") for n in names):
                continue
            literals = {
                c.value
                for c in ast.walk(node)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            if literals & set(MODES):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_no_code_outside_distributed_asks_whether_a_world_exists():
    found = [
        f"{p.relative_to(ROOT)}"
        for root in ("mlx_dflash", "scripts", "training", "convert")
        for p in (ROOT / root).rglob("*.py")
        if p.name != "distributed.py"
        and ("world is None" in p.read_text() or "world is not None" in p.read_text())
    ]
    assert not found, found


def test_local_world_has_every_method_of_the_distributed_one():
    world_api = {n for n in dir(distributed.World) if not n.startswith("_")}
    world_api -= {"group", "timeout", "waiting"}  # the process group's own settings
    missing = world_api - set(dir(distributed.LocalWorld))
    assert not missing
    local = distributed.LOCAL
    assert local.agree([3, 4]).tolist() == [3, 4] and local.all_min(7) == 7
    assert local.all_true(True) and not local.all_true(False)
    assert local.send_text("hi") == "hi" and not local.sharded and local.is_main
    with local.idle():
        local.heartbeat()


def test_an_unsharded_target_holds_the_local_world(target):
    assert target.world is distributed.LOCAL
    assert Session(target).world is distributed.LOCAL
    assert distributed.init() is distributed.LOCAL  # not launched by mlx.launch


def test_commit_keeps_a_prefix_or_a_path_and_feeds_the_drafter(target):
    """Session.commit: a linear block keeps its first tokens, a tree its path; the drafter gets
    exactly the kept positions' taps."""
    oracle = oracle_for(target)
    session = Session(target, oracle)
    logits, taps = target.forward([Pass(mx.array(PROMPT), session.cache, 0)])[0]
    session.commit(PROMPT[:10], taps)
    assert session.tokens == PROMPT[:10] and oracle.context_len == 10
    assert all(c.offset == 10 for c in session.cache)
    # A tree of 4 nodes after those 10: root, two children of the root, a grandchild.
    tree = mx.array(PROMPT[10:14])
    _, taps = target.forward([Pass(tree, session.cache, 10, parents=[-1, 0, 0, 2])])[0]
    session.commit([PROMPT[10], PROMPT[12], PROMPT[13]], taps, [0, 2, 3])
    assert session.tokens == PROMPT[:11] + PROMPT[12:14] and oracle.context_len == 13
    assert all(c.offset == 13 for c in session.cache)


# --- the stream -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["dflash", "ddtree", "ar"])
def test_chunks_carry_the_generation_so_far(target, mode):
    ref = plain(target)
    drafter = oracle_for(target) if mode != "ar" else None
    cfg = GenerationConfig(max_tokens=N, mode=mode, budget=4)
    chunks = list(stream_generate(Session(target, drafter), PROMPT, cfg))
    assert [t for c in chunks for t in c.tokens] == ref
    taus = [c.round.accepted for c in chunks if not c.round.prefill]
    emitted = 0
    for i, c in enumerate(chunks):
        emitted += len(c.tokens)
        assert c.generation_tokens == emitted
        assert c.prompt_tokens == len(PROMPT)
        assert c.peak_memory > 0 and c.generation_tps >= 0
        assert c.finish_reason == ("length" if i == len(chunks) - 1 else None)
        assert c.stats is chunks[0].stats  # one running object
    assert chunks[-1].mean_tau == pytest.approx(sum(taus) / len(taus))
    d = chunks[-1].stats.to_dict()
    assert d["generated_tokens"] == N and d["finish_reason"] == "length"
    assert d["acceptance_lengths"] == taus and d["peak_memory_gb"] == chunks[-1].peak_memory
    if mode != "ar":
        assert max(taus) > 1  # the oracle's drafts are accepted, so tau means something here


# --- Metal hygiene --------------------------------------------------------------------------


class StreamSpy(OracleDrafter):
    """Records the default stream each draft is built on."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.streams = []

    def propose(self, last_token, start, n):
        self.streams.append(mx.default_stream(mx.default_device()))
        return super().propose(last_token, start, n)


def _spy(target):
    truth = PROMPT + plain(target)
    return StreamSpy(truth, target.vocab_size, block_size=8, corrupt=0.3, seed=3)


def test_metal_hygiene_is_a_no_op_without_metal(target, monkeypatch):
    """Here (no Metal) generation neither wires memory nor leaves the default stream."""
    import mlx_lm.generate  # noqa: F401  (the module, not mlx_lm's `generate` function)

    gen_module = sys.modules["mlx_lm.generate"]

    def refuse(*a, **k):
        raise AssertionError("wired_limit entered without Metal")

    monkeypatch.setattr(gen_module, "wired_limit", refuse)
    assert not engine_device.on_metal()
    spy = _spy(target)
    default = mx.default_stream(mx.default_device())
    cfg = GenerationConfig(max_tokens=N, mode="dflash")
    out = [t for c in stream_generate(Session(target, spy), PROMPT, cfg) for t in c.tokens]
    assert out == plain(target)
    assert spy.streams and all(s == default for s in spy.streams)


def test_on_metal_rounds_run_wired_and_on_the_generation_stream(target, monkeypatch):
    """The Metal path, simulated: wired_limit is entered once around the whole generation, every
    round is built on the generation stream, and the caller's stream is back between rounds."""
    import mlx_lm.generate  # noqa: F401

    gen_module = sys.modules["mlx_lm.generate"]
    own = mx.new_stream(mx.default_device())
    entered = []
    ref, spy = plain(target), _spy(target)

    @contextlib.contextmanager
    def wired_limit(model, streams):
        entered.append((model, streams))
        yield

    monkeypatch.setattr(engine_device, "on_metal", lambda: True)
    monkeypatch.setattr(gen_module, "wired_limit", wired_limit)
    monkeypatch.setattr(gen_module, "generation_stream", own)
    default = mx.default_stream(mx.default_device())
    cfg = GenerationConfig(max_tokens=N, mode="dflash")
    out = []
    for chunk in stream_generate(Session(target, spy), PROMPT, cfg):
        assert mx.default_stream(mx.default_device()) == default  # never across a yield
        out += chunk.tokens
    assert out == ref
    assert entered == [(target.model, [own])]
    assert spy.streams and all(s == own for s in spy.streams)
