"""`dflash-mlx chat` scripted through a non-tty stdin, and the Conversation under it: commands,
prefix reuse across turns, and answers identical to plain decoding of the same conversation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from oracle import OracleDrafter, diversify
from typer.testing import CliRunner

from mlx_dflash import load_pair, stop_ids
from mlx_dflash.cli import app
from mlx_dflash.conversation import Conversation
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.tiny import drafter_config_dict, write_drafter_checkpoint, write_tiny_target

N = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny qwen3 target with varied greedy output, and a random drafter (block 4)."""
    from mlx_lm.utils import load_model, save_model

    root = tmp_path_factory.mktemp("chat")
    path = write_tiny_target(root / "target", "qwen3")
    model, _ = load_model(path)
    diversify(model)
    save_model(path, model)
    cfg = json.loads((path / "config.json").read_text())
    drafter = write_drafter_checkpoint(
        root / "drafter", drafter_config_dict("toplevel_block_size", cfg, block_size=4)
    )
    return str(path), str(drafter)


@pytest.fixture(scope="module")
def loaded(pair):
    return load_pair(*pair)


def invoke(args, lines):
    return CliRunner().invoke(app, args, input="".join(f"{x}\n" for x in lines))


def ar_tokens(target, ids, n=N) -> list[int]:
    """Plain decoding of one rendered conversation from an empty cache: the reference."""
    cfg = GenerationConfig(max_tokens=n, mode="ar", stop_ids=stop_ids(target.tokenizer))
    toks = [t for r in generate_rounds(Session(target), ids, cfg) for t in r.tokens]
    return [t for t in toks if t not in cfg.stop_ids]


def ar_answer(target, ids, n=N) -> str:
    return target.tokenizer.decode(ar_tokens(target, ids, n))


def make_chat(loaded, mode="dflash", **kw):
    target, runner = loaded
    cfg = GenerationConfig(max_tokens=N, mode=mode, stop_ids=stop_ids(target.tokenizer), **kw)
    return Conversation(target, runner, cfg)


def test_scripted_session_and_commands(pair):
    model, drafter = pair
    script = [
        "Hello there",
        "/stats",
        "/system Be brief.",
        "Tell me more",
        "/help",
        "/bogus",
        "/reset",
        "",
        "Hello there",
        "/exit",
        "this line is never read",
    ]
    r = invoke(["chat", "-m", model, "-d", drafter, "-n", str(N)], script)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "turns 1 | messages in history 2" in out
    assert "system message: none (/system sets one)" in out and "None" not in out
    assert "System message set: Be brief." in out
    assert "Conversation reset." in out and "Unknown command /bogus" in out
    assert "/reset" in out and "/exit" in out  # the /help listing
    lines = re.findall(r"prefill (\d+) new of (\d+) \((\d+) cached\)", r.stderr)
    assert len(lines) == 3  # three answers; nothing after /exit
    # The second turn starts with a new system message, so nothing is reused; after /reset the
    # conversation is the system message plus one message, a prefix of the second turn's.
    assert lines[0][2] == "0" and int(lines[2][2]) > 10


def test_first_answer_matches_generate_ar(pair):
    model, drafter = pair
    g = CliRunner().invoke(
        app, ["generate", "-m", model, "--mode", "ar", "-n", str(N), "-p", "Hello there"]
    )
    assert g.exit_code == 0, g.output
    c = invoke(["chat", "-m", model, "-d", drafter, "-n", str(N)], ["Hello there"])
    assert c.exit_code == 0, c.output
    assert c.stdout.startswith(g.stdout)


def test_second_turn_prefills_only_new_tokens(loaded):
    chat = make_chat(loaded)
    first = "Hello there, I would like to hear a long story about a cat and a dog. " * 3
    ids1 = chat.render(first)
    _, stats1 = chat.turn(first)
    assert stats1.prompt_tokens == len(ids1)
    ids2 = chat.render("And then?")
    _, stats2 = chat.turn("And then?")
    # Turn one's prompt stays cached (but for the boundary token that the answer's first token
    # can merge with when the history is re-tokenized); only the answer and the new message
    # are prefilled.
    assert stats2.prompt_tokens <= len(ids2) - len(ids1) + 1
    assert stats2.prompt_tokens < len(ids2) // 3


MODES = [("dflash", {}), ("dflash", {"block_size": 2}), ("ar", {}), ("ddtree", {"budget": 4})]


@pytest.mark.parametrize("mode, kw", MODES)
def test_multi_turn_answers_match_plain_decoding(loaded, mode, kw):
    target = loaded[0]
    chat = make_chat(loaded, mode, **kw)
    for msg in ["Hello there", "Tell me a story", "Shorter, please"]:
        ids = chat.render(msg)
        answer, _ = chat.turn(msg)
        assert answer == ar_answer(target, ids)
    chat.system = "You are terse."
    ids = chat.render("Why?")
    assert chat.turn("Why?")[0] == ar_answer(target, ids)


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_multi_turn_with_accepting_drafter(loaded, mode):
    """Blocks get (partly) accepted across turns, so cache reuse meets real rewinds."""
    target = loaded[0]
    oracle = OracleDrafter([], target.vocab_size, block_size=4, corrupt=0.3, seed=3)
    cfg = GenerationConfig(max_tokens=20, mode=mode, budget=4, stop_ids=stop_ids(target.tokenizer))
    chat = Conversation(target, oracle, cfg)
    taus = []
    for msg in ["Hello there", "Tell me a story", "Shorter, please"]:
        ids = chat.render(msg)
        ref = ar_tokens(target, ids, 20)
        oracle.truth = ids + ref
        answer, stats = chat.turn(msg)
        assert answer == target.tokenizer.decode(ref)
        taus += stats.taus
    assert max(taus) > 1 and min(taus) < 4


def test_interrupted_answer_keeps_the_session(loaded):
    target = loaded[0]
    chat = make_chat(loaded)
    answer, stats = chat.turn("Hello there", stopped=lambda: True)
    assert stats.finish == "interrupted" and 0 < stats.tokens < N
    assert chat.messages[-1] == {"role": "assistant", "content": answer}
    ids = chat.render("Go on")
    assert chat.turn("Go on")[0] == ar_answer(target, ids)

    seen = []

    def ctrl_c(text):
        seen.append(text)
        if len(seen) == 2:
            raise KeyboardInterrupt

    _, stats = chat.turn("Once more", write=ctrl_c)
    assert stats.finish == "interrupted"
    ids = chat.render("Last one")
    assert chat.turn("Last one")[0] == ar_answer(target, ids)
    assert "interrupted" in chat.turn_line(stats)


def test_plain_concatenation_without_template(pair, loaded):
    chat = make_chat(loaded)
    chat.templated = False
    answer, _ = chat.turn("Once upon a time")
    ids = chat.render("The end")
    assert chat.tokenizer.decode(ids) == f"Once upon a time{answer}\nThe end"
    assert chat.turn("The end")[0] == ar_answer(loaded[0], ids)

    model, drafter = pair
    r = invoke(["chat", "-m", model, "-d", drafter, "-n", "4", "--no-chat-template"], ["Hi"])
    assert r.exit_code == 0 and "no chat template" in r.stderr


def test_forcing_a_missing_template_fails(loaded):
    target, runner = loaded

    class NoTemplate:
        chat_template = None

    class T:
        tokenizer = NoTemplate()

    with pytest.raises(DFlashError, match="no chat template"):
        Conversation(T(), None, GenerationConfig(mode="ar"), chat_template=True)


def test_the_banner_names_the_pair_and_a_cut_answer_says_so(pair):
    """The banner names the model, its drafter and what runs; an answer cut at -n says so on
    its stats line instead of ending mid-word without a word."""
    from mlx_dflash.cli.chat import banner

    model, drafter = pair
    target, runner = load_pair(model, drafter)
    cfg = GenerationConfig(mode="dflash")
    line = banner(model, runner, cfg)
    assert model in line and f"drafter {Path(drafter).name}" in line and "dflash" in line
    assert "drafter" not in banner(model, runner, GenerationConfig(mode="ar"))
    r = invoke(["chat", "-m", model, "-d", drafter, "-n", "4"], ["Hello there", "/exit"])
    assert r.exit_code == 0 and "cut at --max-tokens 4" in r.stderr


def test_a_pasted_message_is_one_turn_and_a_backslash_continues():
    from mlx_dflash.cli.chat import join_message

    waiting = iter(["second line", "third line"])
    asked = []
    one = join_message("first line", lambda: next(waiting, None), lambda: asked.append(1) or "")
    assert one == "first line\nsecond line\nthird line" and not asked
    typed = iter(["goes on", "and ends"])
    msg = join_message("starts \\", lambda: None, lambda: next(typed))
    assert msg == "starts \ngoes on" and next(typed) == "and ends"


def test_a_terminal_answer_breaks_between_words():
    """At 80 columns a streamed answer broke inside words ("couldn" / "'t"); the terminal's
    answer is now broken at spaces, whatever pieces the text streams in."""
    from mlx_dflash.cli.chat import WordWrap

    text = ("This cat was very smart and couldn't find it. This cat was very small and "
            "couldn't find it.\nOne day a supercalifragilisticexpialidocious word came.")  # fmt: skip
    for pieces in ([text], list(text), [text[i : i + 3] for i in range(0, len(text), 3)]):
        wrap = WordWrap(24)
        out = "".join(wrap.feed(p) for p in pieces) + wrap.flush()
        lines = out.split("\n")
        assert all(len(line) <= 24 or " " not in line for line in lines), lines
        assert " ".join(out.split()) == " ".join(text.split())  # nothing lost or added
        assert "couldn't" in out.split() and any(line.startswith("One day") for line in lines)
