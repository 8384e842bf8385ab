"""training/tau_by_position.py: real decoding and the training forward agree round by round."""

import importlib.util
import json
from pathlib import Path

from mlx_dflash.models.drafter import load_drafter
from mlx_dflash.models.target import load_target
from mlx_dflash.paths import DEFAULT_DRAFTER, DEFAULT_TARGET
from mlx_dflash.training.data import encode

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "training" / "tau_by_position.py"
spec = importlib.util.spec_from_file_location("tau_by_position", SCRIPT)
tau_by_position = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tau_by_position)


def test_forced_blocks_accept_what_decoding_accepted():
    target = load_target(DEFAULT_TARGET)
    drafter = load_drafter(DEFAULT_DRAFTER, num_target_layers=target.num_layers)
    target.set_taps(drafter.cfg.target_layer_ids)
    ids = encode(target.tokenizer, "Once upon a time, there was a little dog")
    answer, rounds = tau_by_position.decode(target, drafter, ids, 80)
    forced = tau_by_position.forced_accepts(target, drafter, ids, answer)
    bs = drafter.cfg.block_size
    assert len(answer) == 80 and len(forced) == 80
    assert (forced[len(answer) - bs + 1 :] == -1).all()  # blocks past the end: not comparable
    compared = [(o, acc) for o, acc, whole in rounds if whole and forced[o] > 0]
    assert len(compared) >= 5
    assert max(acc for _, acc in compared) > 1  # some rounds accept drafts: a real comparison
    assert [int(forced[o]) for o, _ in compared] == [acc for _, acc in compared]


def test_report_by_bucket(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    lines = ["One day, Tim went to the park", "Lily wanted to bake a cake for her mom"]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    args = ["-m", str(DEFAULT_TARGET), "--drafter", str(DEFAULT_DRAFTER)]
    args += ["--prompts", str(prompts), "--last", "2", "--max-tokens", "64", "--buckets", "0,32,64"]
    assert tau_by_position.main(args) == 0
    out = capsys.readouterr().out
    assert "| [0,32) |" in out and "| [32,64) |" in out
    assert "differs from the decoded one: 0" in out
