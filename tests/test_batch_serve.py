"""`serve --max-batch`: concurrent requests share each target forward (engine/batch.py) and get
what the one-at-a-time server answers, token for token; streams cancelled mid-way and bad
requests under load leave every other request whole and the server serving."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import folders, post, serving  # noqa: F401  (folders: a fixture)

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

PROMPTS = [f"Question {i}: what comes {'next ' * i}?" for i in range(6)]
LENGTHS = [24, 9, 31, 16, 5, 20]


def answers(url: str, stream_every: int = 2) -> list[str]:
    """Every prompt asked at once (every `stream_every`-th streamed), in prompt order."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    def ask(i: int) -> str:
        p, n = PROMPTS[i], LENGTHS[i]
        if i % stream_every:
            parts = client.completions.create(model="tiny", prompt=p, max_tokens=n, stream=True)
            return "".join(c.choices[0].text for c in parts)
        return client.completions.create(model="tiny", prompt=p, max_tokens=n).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


@pytest.mark.parametrize("mode", ["dflash", "ddtree", "ar"])
def test_batched_answers_are_the_one_at_a_time_answers(folders, mode):  # noqa: F811
    drafter = None if mode == "ar" else folders["drafter"]
    with serving(folders["target"], drafter, mode) as (_, url):
        alone = answers(url)
    with serving(folders["target"], drafter, mode, max_batch=4) as (app, url):
        together = answers(url)
        with urllib.request.urlopen(url + "/health") as r:
            health = json.loads(r.read())
        batcher = app.worker.batcher
    assert together == alone
    assert health["max_batch"] == 4
    assert batcher.max_rows > 1, "no forward carried two requests"
    assert batcher.forwards < batcher.rows


def held_memory(app) -> int:
    """MLX memory in use beyond what the prefix cache keeps on purpose."""
    import mlx.core as mx

    from mlx_dflash.server.sessions import session_bytes

    return mx.get_active_memory() - sum(session_bytes(s) for s in app.worker.pool.idle)


def test_cancelled_streams_and_bad_requests_under_load(folders):  # noqa: F811
    """50 requests at once into a batch of 4: streamed and not, some dropped mid-stream,
    some malformed. Every good one is answered as alone, every bad one gets a 4xx, the
    cancelled ones end as cancelled, and the server serves on with no row left running and
    its memory back where it was."""
    with serving(folders["target"], folders["drafter"], "ddtree") as (_, url):
        want = answers(url, stream_every=1)
    with serving(folders["target"], folders["drafter"], "ddtree", max_batch=4) as (app, url):
        assert answers(url) == want  # warm: the auto budget's profile, compiled kernels
        # (A client has its answer just before its row ends and leaves the arena.)
        assert app.worker.wait_quiet(30)
        baseline = held_memory(app)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def ask(i: int):
            j = i % len(PROMPTS)
            if i % 10 == 3:
                return "bad", post(url, "/v1/completions", {"prompt": "", "max_tokens": 5})[0]
            if i % 10 == 7:
                stream = client.completions.create(
                    model="tiny", prompt=PROMPTS[j], max_tokens=3000, stream=True
                )
                for k, _ in enumerate(stream):
                    if k == 2:
                        break
                stream.close()
                return "cancelled", None
            if i % 2:
                parts = client.completions.create(
                    model="tiny", prompt=PROMPTS[j], max_tokens=LENGTHS[j], stream=True
                )
                return j, "".join(c.choices[0].text for c in parts)
            r = client.completions.create(model="tiny", prompt=PROMPTS[j], max_tokens=LENGTHS[j])
            return j, r.choices[0].text

        with ThreadPoolExecutor(50) as pool:
            results = list(pool.map(ask, range(50)))
        assert app.worker.wait_quiet(30)
        finishes = list(app.worker.finishes)
        after = answers(url)
        assert app.worker.wait_quiet(30)
        idle = app.worker.running == 0 and app.worker.batcher.active == 0
        grown = held_memory(app) - baseline
    for key, value in results:
        if key == "bad":
            assert value == 400
        elif key != "cancelled":
            assert value == want[key], key
    assert finishes.count("cancelled") == sum(1 for k, _ in results if k == "cancelled")
    assert after == want and idle
    assert grown <= 16 << 10, f"{grown} bytes more held after the load than before it"
