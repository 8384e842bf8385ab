"""Lookup in the target's past answers (engine/corpus.py): the index finds what it should, its
branches stay exact in every tree mode, and bad corpus input is one sentence."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from oracle import OracleDrafter, diversify
from test_engine import mlx_lm_greedy, run

from mlx_dflash.benchmark.runner import parse_methods
from mlx_dflash.engine import GenerationConfig, Session
from mlx_dflash.engine import corpus as corpus_mod
from mlx_dflash.engine.corpus import AnswerCorpus, join_answers, load_corpus, split_answers
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.target import Target
from mlx_dflash.models.tiny import HYBRID_TYPES, TARGET_TYPES, load_module, tiny_target_config
from mlx_dflash.paths import ASSETS

N = 40


def test_branches_are_the_longest_matchs_continuations_most_frequent_first():
    c = AnswerCorpus([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [7, 2, 3, 6, 6]])
    assert c.branches([0, 1, 2, 3], 2, 3) == [[4, 5], [9, 9]]
    assert c.branches([0, 1, 2, 3], 5, 1) == [[4, 5]]  # an answer's end cuts a branch
    assert c.branches([7, 2, 3], 4, 3) == [[6, 6]]  # the longer suffix [7, 2, 3] decides
    # [5, 2, 3] is not in the corpus and [2, 3] is shorter than MIN_NGRAM: no branch
    assert c.branches([5, 2, 3], 4, 3) == [] and c.branches([2, 3], 4, 3) == []
    assert c.branches([1, 2, 3], 0, 3) == [] and len(c) == 20


def test_no_ngram_or_branch_crosses_two_answers():
    c = AnswerCorpus([[1, 2, 3], [4, 5, 6, 7]])
    assert AnswerCorpus([[1, 2]]).branches([1, 2], 4, 3) == []  # shorter than any n-gram
    assert c.branches([1, 2, 3], 4, 3) == []  # [1, 2, 3] ended its answer
    assert c.branches([3, 4, 5], 4, 3) == []  # [3 | 4, 5] spans two answers
    assert c.branches([4, 5, 6], 4, 3) == [[7]]


def test_hash_collisions_never_become_branches(monkeypatch):
    """With a multiplier of 0 every n-gram's hash is its last token's: each query finds many
    candidates, and only true matches may survive."""
    monkeypatch.setattr(corpus_mod, "_MUL", np.uint64(0))
    c = AnswerCorpus([[1, 2, 3, 4], [9, 8, 3, 5], [7, 7, 3, 6]])
    assert c.branches([1, 2, 3], 2, 3) == [[4]]
    assert c.branches([0, 0, 3], 2, 3) == []


def _same_index(a: AnswerCorpus, b: AnswerCorpus) -> bool:
    return (
        np.array_equal(a.tokens, b.tokens)
        and a.keys.keys() == b.keys.keys()
        and all(np.array_equal(a.index(n)[0], b.index(n)[0]) for n in a.keys)
        and all(np.array_equal(a.index(n)[1], b.index(n)[1]) for n in a.keys)
    )


@pytest.mark.parametrize("recent_min", [corpus_mod.RECENT_MIN, 0, 40])
def test_answers_added_one_at_a_time_index_as_if_read_together(monkeypatch, recent_min):
    """serve adds each answer it finishes: the merged index must be the one built from all
    answers at once (same hashes, same order: newest last within a hash), and the copy it
    grows must leave the file's corpus as read. Small alphabet: many equal n-grams. The
    answers wait in the recent index (all of them), merge into the main one at once (0), or
    every few answers (40), and queries find the same branches either way."""
    monkeypatch.setattr(corpus_mod, "RECENT_MIN", recent_min)
    rng = np.random.default_rng(3)
    seqs = [[int(t) for t in rng.integers(0, 4, rng.integers(1, 30))] for _ in range(40)]
    base = AnswerCorpus(seqs[:10])
    grown = base.copy()
    for s in seqs[10:30]:
        grown.add(s)
    grown.add([])  # (an empty answer adds nothing)
    grown.extend(seqs[30:])  # (a kept log's answers join at once)
    whole = AnswerCorpus(seqs)
    assert _same_index(grown, whole)
    assert _same_index(base, AnswerCorpus(seqs[:10]))
    for s in seqs[::3]:
        for cut in range(3, len(s)):
            assert grown.branches(s[:cut], 4, 3) == whole.branches(s[:cut], 4, 3)
    empty = AnswerCorpus([])
    assert empty.branches([1, 2, 3], 4, 2) == [] and len(empty) == 0
    empty.add([5, 6, 7, 8, 9])
    assert empty.branches([0, 5, 6, 7], 4, 2) == [[8, 9]]


def test_answers_joined_and_split_back():
    """The flat form ranks send each other, and the corpus's own token array, split back into
    the same answers (empty ones dropped: they hold no n-gram)."""
    answers = [[5, 6, 7], [], [0], [9, 9, 9, 9]]
    flat = join_answers(answers)
    assert flat == [5, 6, 7, -1, -1, 0, -1, 9, 9, 9, 9, -1]
    assert split_answers(flat) == [[5, 6, 7], [0], [9, 9, 9, 9]]
    assert split_answers(AnswerCorpus(answers).tokens) == [[5, 6, 7], [0], [9, 9, 9, 9]]
    assert split_answers([]) == [] and split_answers([-1, -1]) == []


def test_a_growing_corpus_keeps_its_newest_answers(monkeypatch):
    monkeypatch.setattr(corpus_mod, "MAX_TOKENS", 40)
    seqs = [[i] * 9 for i in range(1, 8)]  # 10 tokens each with the separator
    c = AnswerCorpus([])
    for s in seqs:
        c.add(s)
    assert len(c.tokens) <= 40 and c.branches([7, 7, 7], 2, 1) == [[7, 7]]
    assert _same_index(c, AnswerCorpus(seqs[-(len(c.tokens) // 10) :]))
    assert c.branches([1, 1, 1], 2, 1) == []  # the oldest left


def test_served_answers_join_the_corpus(folders_for_serve):
    """A server in a lookup mode starts from its corpus (here none: empty) and adds every
    answer it serves; the same question again is drafted from the first answer."""
    import urllib.request

    from test_serve import post, serving

    with serving(folders_for_serve, None, "lookup") as (app, url):
        body = {"messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 40, "temperature": 0}  # fmt: skip
        code, first = post(url, "/v1/chat/completions", body)
        assert code == 200, first
        with urllib.request.urlopen(url + "/health") as r:
            size = json.loads(r.read())["lookup_corpus_tokens"]
        assert size == first["usage"]["completion_tokens"] > 8
        code, again = post(url, "/v1/chat/completions", body)
        text = [x["choices"][0]["message"]["content"] for x in (first, again)]
        assert text[0] == text[1]
        assert again["dflash"]["rounds"] < first["dflash"]["rounds"], (first, again)
        assert len(app.corpus) == 2 * size


def test_kept_answers_survive_a_restart(folders_for_serve, tmp_path):
    """serve --keep-answers: the first server keeps its answer in the log (a header naming
    the tokenizer, then one line an answer, readable by its owner only); a second server on
    the same log starts with that answer in its corpus and drafts the same question from it."""
    import os
    import stat
    import urllib.request

    from test_serve import post, serving

    log = tmp_path / "kept" / "answers.jsonl"
    body = {"messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 40, "temperature": 0}  # fmt: skip
    with serving(folders_for_serve, None, "lookup", keep_answers=str(log)) as (_, url):
        code, first = post(url, "/v1/chat/completions", body)
        assert code == 200, first
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and corpus_mod.LOG_HEADER in json.loads(lines[0])
    n = first["usage"]["completion_tokens"]
    assert len(json.loads(lines[1])["tokens"]) == n
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    with serving(folders_for_serve, None, "lookup", keep_answers=str(log)) as (app, url):
        with urllib.request.urlopen(url + "/health") as r:
            assert json.loads(r.read())["lookup_corpus_tokens"] == n
        code, again = post(url, "/v1/chat/completions", body)
    text = [x["choices"][0]["message"]["content"] for x in (first, again)]
    assert text[0] == text[1]
    assert again["dflash"]["rounds"] < first["dflash"]["rounds"], (first, again)
    assert len(log.read_text().splitlines()) == 3 and len(app.corpus) == 2 * n
    assert len(load_corpus(log)) == 2 * n  # (the log is a corpus file too)
    # The command says what it read back.
    exe = str(Path(sys.executable).parent / "dflash-mlx")
    cmd = [exe, "serve", "-m", folders_for_serve, "--mode", "lookup", "--port", "0"]
    proc = subprocess.Popen([*cmd, "--keep-answers", str(log)], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline() if proc.stderr else ""
        while line and "Serving" not in line:
            line = proc.stderr.readline() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait()
    assert f"2 kept answers read from {log}" in line, line


def test_answer_log_damage_and_bounds(tmp_path, monkeypatch):
    """A last line cut short (the server stopped mid-write) is dropped and the file mended;
    damage before it, another tokenizer's log or a file that is no log is one sentence; a log
    past MAX_TOKENS keeps its newest answers, as the corpus does."""
    path = tmp_path / "log.jsonl"
    log = corpus_mod.AnswerLog(path, "tok-a")
    assert log.read() == []
    log.start("m")
    for a in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        log.append(a)
    assert log.read() == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    with open(path, "a") as f:
        f.write('{"tokens": [10, 1')
    assert log.read() == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    log.append([11])
    assert log.read() == [[1, 2, 3], [4, 5], [6, 7, 8, 9], [11]]
    with pytest.raises(DFlashError, match="another tokenizer"):
        corpus_mod.AnswerLog(path, "tok-b").read()
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    with pytest.raises(DFlashError, match="Line 2 of the answer log"):
        log.read()
    other = tmp_path / "other.jsonl"
    other.write_text('{"tokens": [1]}\n')
    with pytest.raises(DFlashError, match="not an answer log"):
        corpus_mod.AnswerLog(other, "tok-a").read()
    monkeypatch.setattr(corpus_mod, "MAX_TOKENS", 20)
    path.unlink()
    log.start("m")
    for i in range(1, 8):
        log.append([i] * 4)  # 5 tokens each with the separator
    assert log.read() == [[6] * 4, [7] * 4]  # the newest half of 20 tokens
    assert len(path.read_text().splitlines()) == 3  # (rewritten: it stays bounded)


def test_every_rank_gets_rank_0s_kept_answers(tmp_path):
    """A sharded server: rank 0 reads the log and sends its answers (the other ranks may run on
    Macs without the file), so every rank's corpus, and so every rank's tree, is the same;
    only rank 0 appends to the log."""
    from mlx_dflash.server.kept_answers import open_answer_log, tokenizer_id

    class Tok:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    class World:
        sharded = True

        def __init__(self, is_main, sent):
            self.is_main, self.sent = is_main, sent

        def agree_seq(self, values):
            if self.is_main:
                self.sent.append(list(values))
            return np.array(self.sent[0])

    log = corpus_mod.AnswerLog(tmp_path / "log.jsonl", tokenizer_id(Tok()))
    log.start("m")
    kept = [[1, 2, 3], [4], [5, 6]]
    for a in kept:
        log.append(a)
    sent: list = []
    main, other = AnswerCorpus([[9, 9]]), AnswerCorpus([[9, 9]])
    assert open_answer_log(log.path, main, True, Tok(), "m", World(True, sent)) is not None
    elsewhere = tmp_path / "elsewhere" / "log.jsonl"  # (the follower's Mac has no such file)
    assert open_answer_log(elsewhere, other, True, Tok(), "m", World(False, sent)) is None
    assert not elsewhere.exists()
    assert _same_index(main, AnswerCorpus([[9, 9], *kept]))
    assert _same_index(other, AnswerCorpus([[9, 9], *kept]))


def test_keep_answers_needs_the_lookup_corpus(folders_for_serve, tmp_path, run_cli):
    for extra in (["--mode", "ar"], ["--mode", "lookup", "--lookup-corpus", "none"]):
        code, _, err = run_cli("serve", "-m", folders_for_serve, "--keep-answers",
                               tmp_path / "log.jsonl", "--port", "0", *extra)  # fmt: skip
        assert code != 0 and "--keep-answers feeds the lookup corpus" in err, err
        assert "Traceback" not in err and not (tmp_path / "log.jsonl").exists()


def _write(path, seqs):
    with gzip.open(path, "wt") as f:
        for s in seqs:
            f.write(json.dumps({"id": 0, "tokens": s}) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{nope\n", "cannot be read"),
        ('{"text": "hi"}\n', "no 'tokens' list"),
        ('{"tokens": [1, -2]}\n', "no 'tokens' list"),
        ("\n", "holds no answers"),
    ],
)
def test_bad_corpus_files_are_one_sentence(tmp_path, text, reason):
    p = tmp_path / "c.jsonl"
    p.write_text(text)
    with pytest.raises(DFlashError, match=reason):
        load_corpus(p)
    with pytest.raises(DFlashError, match="does not exist"):
        load_corpus(tmp_path / "missing.jsonl")


def test_a_corpus_needs_lookup_branches(tmp_path):
    with pytest.raises(DFlashError, match="lookup corpus"):
        GenerationConfig(mode="dflash", lookup_corpus="x.jsonl")
    with pytest.raises(DFlashError, match="lookup corpus"):
        GenerationConfig(mode="ddtree", budget=8, lookup_corpus="x.jsonl")
    with pytest.raises(DFlashError, match="--lookup-corpus"):
        parse_methods("mlx-lm,ddtree+lookup+corpus:auto")
    path = _write(tmp_path / "c.jsonl.gz", [[1, 2, 3, 4]])
    m = parse_methods("lookup+corpus:auto,ddtree+lookup:auto", path)
    assert [x.corpus for x in m] == [path, ""]  # "": no corpus, not even the drafter's
    with pytest.raises(DFlashError, match="does not exist"):
        parse_methods("lookup+corpus", str(tmp_path / "none.jsonl"))
    grown = parse_methods("lookup+corpus,ddtree+lookup+corpus:auto", None, grows=True)
    assert all(isinstance(x.corpus, AnswerCorpus) and len(x.corpus) == 0 for x in grown)
    assert grown[0].corpus is not grown[1].corpus  # each method's answers its own
    assert len(parse_methods("lookup+corpus", path, grows=True)[0].corpus) == 4


@pytest.fixture(scope="module")
def folders_for_serve(tmp_path_factory):
    from mlx_dflash.models.tiny import write_tiny_target

    return str(write_tiny_target(tmp_path_factory.mktemp("serve") / "target", "qwen3"))


@pytest.fixture(scope="module", params=TARGET_TYPES + HYBRID_TYPES)
def target(request):
    cfg = tiny_target_config(request.param)
    mod = load_module(request.param)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    diversify(model, gain=1.0, seed=5)
    return Target(model, None, cfg)


def _corpus_for(tmp_path, prompt, ref, vocab):
    """Past answers: the target's own answer after the prompt's last tokens, a wrong answer
    after the same tokens (twice, so it ranks first where both match), and noise."""
    rng = np.random.default_rng(0)
    wrong = [int(t) for t in rng.integers(0, vocab, N)]
    noise = [[int(t) for t in rng.integers(0, vocab, 64)] for _ in range(20)]
    seqs = [prompt[-4:] + wrong, prompt[-4:] + wrong, prompt[-4:] + ref, *noise]
    return _write(tmp_path / "answers.jsonl.gz", seqs)


@pytest.mark.parametrize(
    "mode, budget", [("lookup", 16), ("lookup", "auto"), ("ddtree", 4), ("ddtree", "auto")]
)
def test_corpus_branches_are_exact_and_accepted(target, tmp_path, mode, budget):
    """Exact in every tree mode; at a fixed budget (which verifies every branch) the corpus's
    copy of the answer is taken. (Auto may cut corpus branches at their measured rate.)"""
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.permutation(target.vocab_size - 1)[:24]]  # no repeat in it
    ref = mlx_lm_greedy(target, prompt, N)
    path = _corpus_for(tmp_path, prompt, ref, target.vocab_size)
    drafter = None
    if mode == "ddtree":
        target.set_taps([1, 3])
        drafter = OracleDrafter(prompt + ref, target.vocab_size, block_size=8, corrupt=0.9, seed=2)
    kw = dict(max_tokens=N, mode=mode, budget=budget, lookup=8)
    out, taus = run(Session(target, drafter), prompt, **kw, lookup_corpus=path)
    alone, taus_alone = run(Session(target, drafter), prompt, **kw)
    assert out == ref and alone == ref
    if budget != "auto":
        assert len(taus) < len(taus_alone), "no corpus draft was taken"


def test_generate_and_bench_read_a_corpus(run_cli, tmp_path):
    """The embedded pair: generate's answer with a corpus of an earlier answer is plain
    decoding's, and a corpus outside a lookup mode is one sentence before any model loads."""
    args = ("generate", "-p", "Once upon a time", "-n", "48", "--json")
    code, out, err = run_cli(*args, "--mode", "ar")
    assert code == 0, err
    plain = json.loads(out)["text"]
    from mlx_dflash.models.target import load_target
    from mlx_dflash.paths import DEFAULT_TARGET

    tok = load_target(DEFAULT_TARGET).tokenizer
    path = _write(tmp_path / "a.jsonl.gz", [tok.encode("Once upon a time" + plain)] * 2)
    code, out, err = run_cli(*args, "--mode", "lookup", "--lookup-corpus", path)
    assert code == 0, err
    assert json.loads(out)["text"] == plain and json.loads(out)["mean_tau"] > 1.2
    code, out, err = run_cli(*args, "--mode", "dflash", "--lookup-corpus", path)
    assert code != 0 and "lookup corpus" in err and "Traceback" not in err
    code, out, err = run_cli(
        "bench", "--methods", "mlx-lm,lookup+corpus", "--limit", "1", "-n", "16",
        "--lookup-corpus", path, "--no-plot", "--out", tmp_path / "b.json",
    )  # fmt: skip
    assert code == 0, err
    results = json.loads((tmp_path / "b.json").read_text())
    assert {r["method"] for r in results["results"]} == {"mlx-lm", "lookup+corpus"}
    assert results["identical"]["identical"]
    code, out, err = run_cli(
        "bench", "--methods", "mlx-lm,lookup+corpus", "--limit", "2", "-n", "16",
        "--grow-corpus", "--no-plot", "--out", tmp_path / "g.json",
    )  # fmt: skip
    grown = json.loads((tmp_path / "g.json").read_text())
    assert code == 0 and grown["identical"]["identical"] and grown["settings"]["grow_corpus"]


def test_a_drafter_folders_corpus_is_the_default(run_cli, tmp_path):
    """A drafter that ships its target's answers (`lookup-corpus.jsonl.gz`, as the SmolLM2 and
    coder drafters do) lends them to lookup unless --lookup-corpus says otherwise."""
    import shutil

    from mlx_dflash.cli.options import Flags, default_corpus
    from mlx_dflash.models.drafter import CORPUS_FILE
    from mlx_dflash.models.pair import load_pair
    from mlx_dflash.paths import DEFAULT_DRAFTER, DEFAULT_TARGET

    folder = tmp_path / "drafter"
    shutil.copytree(DEFAULT_DRAFTER, folder)
    shipped = _write(folder / CORPUS_FILE, [[1, 2, 3, 4, 5]])
    other = _write(tmp_path / "mine.jsonl.gz", [[5, 6, 7, 8]])
    _, runner = load_pair(str(DEFAULT_TARGET), str(folder), "ddtree")

    def corpus(mode, budget, given=None):
        cfg = Flags(32, mode=mode, budget=budget, corpus=given).config()
        return default_corpus(cfg, runner).lookup_corpus

    assert corpus("ddtree", "auto") == shipped and corpus("lookup", "16") == shipped
    assert corpus("ddtree", "auto", other) == other and not corpus("ddtree", "auto", "none")
    assert corpus("dflash", "16") is None and corpus("ddtree", "8") is None  # no lookup there
    assert CORPUS_FILE in {p.name for p in ASSETS.glob("*/*")}, "no shipped drafter has one"
    broken = tmp_path / "broken"
    shutil.copytree(DEFAULT_DRAFTER, broken)
    (broken / CORPUS_FILE).write_bytes(b"not gzip")
    _, broken_runner = load_pair(str(DEFAULT_TARGET), str(broken), "ddtree")
    cfg = Flags(32, mode="ddtree", budget="auto").config()
    with pytest.raises(DFlashError, match="cannot be read"):
        default_corpus(cfg, broken_runner)
    args = ("generate", "-p", "Once upon a time", "-n", "32", "--json", "-d", folder)
    code, out, err = run_cli(*args, "--mode", "ddtree", "--budget", "auto")
    code_ar, out_ar, _ = run_cli(*args, "--mode", "ar")
    assert code == 0 == code_ar, err
    assert json.loads(out)["lookup_corpus"] == shipped
    assert json.loads(out)["text"] == json.loads(out_ar)["text"]
    # The library reads it too: a GenerationConfig that names no corpus gets the drafter's.
    from mlx_dflash.engine.corpus import lookup_corpus

    assert runner.corpus_file == str(shipped)
    assert lookup_corpus(GenerationConfig(), runner) == str(shipped)
    assert lookup_corpus(GenerationConfig(lookup_corpus=""), runner) == ""


def test_corpus_branches_keep_sampling_lossless(monkeypatch, tmp_path):
    """Every token has continuations in the corpus (1-grams count), so nearly every round
    verifies corpus branches; the sampled tokens must still follow the target exactly."""
    from test_lookup import assert_lossless, sampling_target
    from test_sampling import V

    from mlx_dflash.engine.sampling import SamplingParams

    monkeypatch.setattr(corpus_mod, "MIN_NGRAM", 1)
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.permutation(V)]
    path = _write(tmp_path / "c.jsonl.gz", [[int(t) for t in rng.integers(0, V, 400)]])
    assert_lossless(
        monkeypatch, sampling_target(), prompt, SamplingParams(1.0), "corpus branches",
        lookup_corpus=path,
    )  # fmt: skip
