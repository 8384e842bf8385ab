"""One rank of a distributed exactness run (started by tests/test_distributed.py through
`mlx.launch`): load the target sharded, decode with each mode against an oracle drafter that
knows the single-process answer, and (rank 0) write the outputs as JSON."""

# isort: skip_file
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import mlx_dflash  # noqa: F401,E402  (OpenBLAS before mlx)
from mlx_dflash import distributed  # noqa: E402
from mlx_dflash.engine import GenerationConfig, SamplingParams, Session  # noqa: E402
from mlx_dflash.engine import generate_rounds  # noqa: E402
from mlx_dflash.models.pair import load_pair  # noqa: E402
from oracle import OracleDrafter  # noqa: E402


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    world = distributed.init()
    assert world is not None and world.size == 2, "run me with mlx.launch -n 2"
    target, _ = load_pair(spec["model"], mode="ar", world=world)
    target.set_taps([0, 1])
    die_after = int(os.environ.get("DFLASH_TEST_DIE_AFTER", "0"))
    results = {}
    for name, kw in spec["runs"].items():
        oracle = OracleDrafter(spec["truth"], target.vocab_size, block_size=8, corrupt=0.3, seed=2)
        kw = dict(kw)
        if "temperature" in kw:
            kw["sampling"] = SamplingParams(kw.pop("temperature"))
        cfg = GenerationConfig(max_tokens=spec["max_tokens"], **kw)
        out, taus = [], []
        for i, rnd in enumerate(generate_rounds(Session(target, oracle), spec["prompt"], cfg)):
            out += rnd.tokens
            taus.append(rnd.accepted)
            world.heartbeat()
            if die_after and world.rank == 1 and i == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        results[name] = {"tokens": out, "taus": taus}
    results["_comm"] = {"broadcasts": world.collectives, "bytes": world.bytes_agreed}
    results["_parallel"] = "pipeline" if target.stage is not None else "tensor"
    if world.is_main:
        Path(spec["out"]).write_text(json.dumps(results))
    else:  # the other rank's tokens, to check that the ranks never diverged
        Path(spec["out"] + ".rank1").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
