"""`dflash-mlx serve` through the real `openai` client, on a server started on a free loopback
port: answers equal `generate`'s, streaming, stop strings, thinking, prefix reuse, every bad
request, the API key, a client that leaves mid-stream, and a bounded load test."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from mlx_dflash.engine import GenerationConfig
from mlx_dflash.models.pair import load_pair
from mlx_dflash.models.tiny import drafter_config_dict, write_drafter_checkpoint, write_tiny_target
from mlx_dflash.server.app import App, ServerConfig
from mlx_dflash.server.http import make_server, serve_in_thread
from mlx_dflash.server.sessions import SessionPool
from mlx_dflash.server.text import StopStrings, ThinkingSplitter, prompt_opens_thinking

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

# Qwen3.5-style: the generation prompt opens <think> unless enable_thinking is false.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
QUESTION = "Tell me a story about a cat."


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target = write_tiny_target(root / "target", "qwen3", max_position_embeddings=4096)
    cfg = json.loads((target / "config.json").read_text())
    drafter = write_drafter_checkpoint(
        root / "drafter", drafter_config_dict("toplevel_block_size", cfg, block_size=8)
    )
    think = write_tiny_target(root / "thinker", "qwen3", max_position_embeddings=4096)
    tok_cfg = json.loads((think / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = THINKING_TEMPLATE
    (think / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return {"target": str(target), "drafter": str(drafter), "thinker": str(think)}


def start(model, drafter=None, mode="dflash", **config):
    target, runner = load_pair(model, drafter, mode)
    cfg = GenerationConfig(mode=mode, budget=4 if mode == "ddtree" else 16)
    app = App(target, runner, cfg, ServerConfig(model_name="tiny", **config))
    server = make_server(app, "127.0.0.1", 0)
    serve_in_thread(server)
    return server, app, f"http://127.0.0.1:{server.server_address[1]}"


@contextmanager
def serving(model, drafter=None, mode="dflash", **config):
    """(app, url) of a server that runs for the with-block, then shuts down."""
    server, app, url = start(model, drafter, mode, **config)
    try:
        yield app, url
    finally:
        server.shutdown()
        app.worker.stop()


@pytest.fixture(scope="module")
def served(folders):
    with serving(folders["target"], folders["drafter"]) as s:
        yield s


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0)


def generate_text(run_cli, folders, prompt, *extra):
    code, out, err = run_cli(
        "generate",
        "-m",
        folders["target"],
        "-d",
        folders["drafter"],
        "-p",
        prompt,
        "-n",
        "24",
        "--json",
        *extra,
    )
    assert code == 0, err
    return json.loads(out)["text"]


def post(url, path, body, headers=None):
    """(status, JSON body) of a raw POST; `body` bytes are sent as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- answers ---------------------------------------------------------------------------------


def test_models_and_health(client, served):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(served[1] + "/health") as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["mode"] == "dflash"


def test_chat_equals_generate(client, folders, run_cli):
    want = generate_text(run_cli, folders, QUESTION)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=24
    )
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 5
    stats = r.model_extra["dflash"]
    assert stats["mode"] == "dflash" and stats["rounds"] >= 1 and stats["mean_tau"] >= 1

    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # The same prompt again reuses the cached prefix.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_completions_equal_generate(client, folders, run_cli):
    want = generate_text(run_cli, folders, "Once upon a time", "--no-chat-template")
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    parts = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].text for c in parts) == want


def test_stop_strings_and_sampling(client):
    msgs = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24)
    text = full.choices[0].message.content
    stop = text[6:9]
    cut = text[: text.find(stop)]
    for s in (stop, [stop, "\u2603"]):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, stop=s)
        assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
        parts = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=24, stop=s, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == cut
    # Seeded sampling is reproducible, and differs from greedy somewhere over a few seeds.
    kw = dict(model="tiny", messages=msgs, max_tokens=16, temperature=1.0, top_p=0.95)
    kw["extra_body"] = {"top_k": 50}
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b
    others = {
        client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)
    }
    assert len(others | {a}) > 1


def test_conversation_turn_prefills_only_new_tokens(client):
    msgs = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12)
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn came from the cache, up to its last token or two (the generation
    # prompt's trailing space merges with the answer's first word when re-rendered).
    assert cached >= first.usage.prompt_tokens - 2


def test_session_pool_keeps_the_most_recent_within_bounds(folders):
    target, runner = load_pair(folders["target"], folders["drafter"])
    pool = SessionPool(target, runner, max_bytes=2**40, max_sessions=2)
    sessions = []
    for i in range(3):
        s, held = pool.take([10 + i] * 5, True)
        assert held == 0 and s.drafter is not runner  # its own drafter cache
        s.tokens = [10 + i] * 5
        pool.give_back(s)
        sessions.append(s)
    assert pool.idle == sessions[1:]  # the least recently used went first
    s, held = pool.take([12] * 5 + [1], True)
    assert s is sessions[2] and held == 5
    tight = SessionPool(target, runner, max_bytes=0, max_sessions=8)
    s, _ = tight.take([1, 2], True)
    from mlx_dflash.engine import generate_rounds

    list(generate_rounds(s, [5, 6, 7], GenerationConfig(max_tokens=2)))
    tight.give_back(s)
    assert tight.idle == []  # over the memory bound, nothing is kept


# ---- thinking --------------------------------------------------------------------------------


def test_thinking_is_returned_apart(folders):
    # (mlx-lm's tokenizer wrapper defaults enable_thinking to whether the vocabulary has
    # <think> tokens; the tiny one has not, so the server default turns thinking on here.)
    server, app, url = start(folders["thinker"], mode="ar", thinking=True)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": QUESTION}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16)
        msg = r.choices[0].message
        # The template opened <think>, the tiny model never closes it: all of it is reasoning.
        assert msg.model_extra["reasoning_content"] and msg.content == ""
        off = c.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=16,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert off.choices[0].message.content
        assert not off.choices[0].message.model_extra.get("reasoning_content")
        parts = list(
            c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, stream=True)
        )
        streamed = "".join(
            (p.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            for p in parts
            if p.choices
        )
        assert streamed == msg.model_extra["reasoning_content"]
    finally:
        server.shutdown()
        app.worker.stop()
    # The server-wide default: --no-thinking.
    server, app, url = start(folders["thinker"], mode="ar", thinking=False)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16)
        assert r.choices[0].message.content == off.choices[0].message.content
    finally:
        server.shutdown()
        app.worker.stop()


def test_generate_thinking_switch(run_cli, folders):
    outs = {}
    for flag in ("--thinking", "--no-thinking"):
        code, out, err = run_cli(
            "generate",
            "-m",
            folders["thinker"],
            "--mode",
            "ar",
            "-p",
            QUESTION,
            "-n",
            "8",
            "--json",
            flag,
        )
        assert code == 0, err
        outs[flag] = json.loads(out)
    # --no-thinking renders the closed empty block: a longer prompt, another answer.
    assert outs["--no-thinking"]["prompt_tokens"] > outs["--thinking"]["prompt_tokens"]


def test_text_pieces():
    s = StopStrings(["END", "xyz"])
    got = [s.feed(p) for p in ("abc E", "N", "D more")]
    assert got == [("abc ", None), ("", None), ("", "END")]
    s = StopStrings(["END"])
    assert s.feed("abc EN") == ("abc ", None) and s.flush() == "EN"
    t = ThinkingSplitter(False)
    pieces = [t.feed(p) for p in ("<thi", "nk>\nI think", " so</th", "ink>\n\nYes.")]
    assert "".join(r for r, _ in pieces) == "I think so"
    assert "".join(c for _, c in pieces) == "Yes."
    t = ThinkingSplitter(False)
    assert t.feed("Plain <think> text") == ("", "Plain <think> text")
    assert prompt_opens_thinking("<|assistant|><think>\n")
    assert not prompt_opens_thinking("<|assistant|><think>\n\n</think>\n\n")


# ---- bad requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,status,match",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"messages": "hi"}, 400, "'messages' must be a non-empty list"),
        ({"messages": []}, 400, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, 400, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "'stop'"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "'stream'"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "unknown role"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "gpt-9"),
        ({"messages": [{"role": "user", "content": "hi " * 5000}]}, 400, "context"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "context"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n=1"),
    ],
)
def test_bad_requests_get_4xx_json(served, body, status, match):
    code, err = post(served[1], "/v1/chat/completions", body)
    assert code == status and match in err["error"]["message"], err
    assert err["error"]["type"]
    # ... and the server keeps serving.
    ok, r = post(served[1], "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok == 200 and r["usage"]["completion_tokens"] == 2


def test_bad_completion_requests(served):
    for body, match in (({"prompt": ["a", "b"]}, "'prompt'"), ({"prompt": "  "}, "empty")):
        code, err = post(served[1], "/v1/completions", body)
        assert code == 400 and match in err["error"]["message"]
    code, err = post(served[1], "/v1/nowhere", {})
    assert code == 404


def test_api_key(folders):
    server, app, url = start(folders["target"], folders["drafter"], api_key="sekret")
    try:
        body = {"prompt": "Hi", "max_tokens": 2}
        code, err = post(url, "/v1/completions", body)
        assert code == 401 and err["error"]["type"] == "authentication_error"
        code, _ = post(url, "/v1/completions", body, {"Authorization": "Bearer wrong"})
        assert code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        server.shutdown()
        app.worker.stop()


# ---- disconnects and load --------------------------------------------------------------------


def test_client_leaving_mid_stream_frees_the_worker(client, served):
    app = served[0]
    before = len(app.worker.finishes)
    stream = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=3000, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.time() + 20
    while len(app.worker.finishes) == before and time.time() < deadline:
        time.sleep(0.05)
    assert app.worker.finishes[before:] == ["cancelled"]
    assert not app.worker.busy
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_non_streaming_client_leaving_is_noticed(served):
    import socket

    app, url = served
    before = len(app.worker.finishes)
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 3000}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.3)
    deadline = time.time() + 20
    while len(app.worker.finishes) == before and time.time() < deadline:
        time.sleep(0.05)
    assert app.worker.finishes[before:] == ["cancelled"]


def test_load_50_requests_from_4_threads(client):
    prompts = [f"Question {i}: what comes next?" for i in range(5)]
    want = {
        p: client.completions.create(model="tiny", prompt=p, max_tokens=12).choices[0].text
        for p in prompts
    }

    def ask(i):
        p = prompts[i % len(prompts)]
        if i % 2:
            parts = client.completions.create(model="tiny", prompt=p, max_tokens=12, stream=True)
            return p, "".join(c.choices[0].text for c in parts)
        return p, client.completions.create(model="tiny", prompt=p, max_tokens=12).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(50)))
    assert len(answers) == 50
    assert all(text == want[p] for p, text in answers)


def test_anthropic_messages(served):
    url = served[1]
    body = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": QUESTION}]}
    code, r = post(url, "/v1/messages", body)
    assert code == 200 and r["type"] == "message" and r["stop_reason"] == "max_tokens"
    assert r["usage"]["output_tokens"] == 10 and r["content"][-1]["type"] == "text"
    chat_code, chat = post(url, "/v1/chat/completions", {**body})
    assert r["content"][-1]["text"] == chat["choices"][0]["message"]["content"]
    req = urllib.request.Request(
        url + "/v1/messages", data=json.dumps({**body, "stream": True}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    events = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    deltas = [
        json.loads(line[len("data: ") :])["delta"]["text"]
        for line in lines
        if line.startswith("data: ") and '"text_delta"' in line
    ]
    assert "".join(deltas) == r["content"][-1]["text"]
    code, err = post(url, "/v1/messages", {"messages": [{"role": "user", "content": "x"}]})
    assert code == 400 and err["type"] == "error" and "max_tokens" in err["error"]["message"]


def test_serve_command_rejects_a_busy_port(run_cli, folders):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run_cli(
            "serve", "-m", folders["target"], "--mode", "ar", "--port", str(port)
        )
    assert code != 0 and "Cannot listen on" in err and "Traceback" not in err


def test_other_thinking_tags():
    t = ThinkingSplitter(True, ("<|think:start|>", "<|think:end|>"))
    assert t.feed("hmm<|think:") == ("hmm", "") and t.feed("end|>\n\nOK") == ("", "OK")


def test_model_without_chat_template():
    """The embedded stories260K pair (the default with no --model) has no chat template:
    completions are served as they are, and chat continues the messages' plain text."""
    server, app, url = start(None)
    try:
        assert app.config.model_name == "tiny" and not app.templated
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        text = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20)
        chat = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=20
        )
        assert chat.choices[0].message.content == text.choices[0].text
        assert "reasoning_content" not in chat.choices[0].message.model_extra
    finally:
        server.shutdown()
        app.worker.stop()


# ---- what a load and abuse test found (issue 30, item 8) --------------------------------------


def raw_exchange(url: str, head: bytes, body: bytes, wait: float = 10.0) -> tuple[int, dict]:
    """Send a hand-made request (`Connection: close`; the body possibly short of its
    Content-Length) over a socket and read the reply until the server closes: (status, JSON)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    data = b""
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(head + b"Connection: close\r\n" + body)
        while chunk := s.recv(65536):
            data += chunk
    head_part, _, payload = data.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(payload)


def test_lone_surrogate_and_deep_nesting_get_a_400_not_a_dropped_connection(served):
    url = served[1]
    for path, body in (
        ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ):
        code, err = post(url, path, body)
        assert code == 400 and "not valid Unicode" in err["error"]["message"], err
        assert "Error" not in err["error"]["message"]  # no internal exception text
    deep = b'{"prompt": "hi", "x": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    code, err = post(url, "/v1/completions", deep)
    assert code == 400 and "nests too deeply" in err["error"]["message"]
    ok, r = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok == 200


def test_a_body_shorter_than_its_content_length_times_out_with_a_400(folders):
    server, app, url = start(folders["target"], folders["drafter"])
    server.RequestHandlerClass.timeout = 1.0  # the real one is 30 s
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        body = b'{"prompt": "Hi", "max_tokens": 2}'
        t0 = time.perf_counter()
        code, err = raw_exchange(url, head + b"Content-Length: 500\r\n", b"\r\n" + body)
        assert code == 400 and "shorter than its Content-Length" in err["error"]["message"]
        assert time.perf_counter() - t0 < 8
        code, err = raw_exchange(url, head + b"Content-Length: -1\r\n", b"\r\n" + body)
        assert code == 400 and "Content-Length" in err["error"]["message"]
        assert app.worker.served == 0  # the truncated request never ran
    finally:
        server.shutdown()
        app.worker.stop()


def test_every_stop_string_is_honoured_up_to_the_stated_limit(client, served):
    text = client.completions.create(model="tiny", prompt="Once", max_tokens=12).choices[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    many = [f"never-{i}" for i in range(199)] + [stop]  # the real one is the 200th
    r = client.completions.create(model="tiny", prompt="Once", max_tokens=12, stop=many)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert text.startswith(r.choices[0].text)
    body = {"prompt": "Once", "max_tokens": 2, "stop": [f"s{i}" for i in range(300)]}
    code, err = post(served[1], "/v1/completions", body)
    assert code == 400 and "at most 256" in err["error"]["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": ["hi"]}, "messages"),
    ],
)
def test_error_bodies_name_the_field_in_param(served, body, param):
    code, err = post(served[1], "/v1/chat/completions", body)
    assert code == 400
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"


def listen_backlog(port: int) -> int | None:
    """The kernel's accept-queue limit of the socket listening on `port` (ss's Send-Q)."""
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        return None
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
    fields = out.stdout.split()
    return int(fields[2]) if len(fields) > 2 else None


def test_a_burst_of_50_async_requests_is_all_answered(client, served):
    """50 requests at once from the async client: the listening backlog of 5 reset 10-33 of
    them before (on a loaded machine: here a burst alone may get through either way, so the
    backlog itself is checked too); now every one is answered, and answered right."""
    import asyncio

    backlog = listen_backlog(int(served[1].rsplit(":", 1)[1]))
    assert backlog is None or backlog >= 64, backlog

    prompts = [f"Question {i}: what comes next?" for i in range(5)]
    want = {
        p: client.completions.create(model="tiny", prompt=p, max_tokens=6).choices[0].text
        for p in prompts
    }
    base = str(client.base_url)

    async def burst():
        async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as aclient:
            calls = [
                aclient.completions.create(model="tiny", prompt=prompts[i % 5], max_tokens=6)
                for i in range(50)
            ]
            return await asyncio.gather(*calls)

    answers = asyncio.run(burst())
    assert len(answers) == 50
    assert all(a.choices[0].text == want[prompts[i % 5]] for i, a in enumerate(answers))


# ---- logprobs (issue 30, item 6) ---------------------------------------------------------------


def test_logprobs_equal_plain_decodings(client, served):
    """Read from the verify passes of a DFlash server: the same values mlx-lm's own decoding
    reports for the same rendered prompt, in chat (plain and streamed) and completions."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    app = served[0]
    msgs = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, logprobs=True, top_logprobs=3
    )
    ids = app.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    steps = list(generate_step(mx.array(ids), app.target.model, max_tokens=16,
                               sampler=lambda x: mx.argmax(x, axis=-1)))  # fmt: skip
    want = [(int(t), np.array(lp)) for t, lp in steps]
    entries = r.choices[0].logprobs.content
    assert len(entries) == 16
    for e, (t, vec) in zip(entries, want, strict=True):
        assert e.token == app.tokenizer.decode([t]) and abs(e.logprob - float(vec[t])) < 1e-4
        tops = [app.tokenizer.encode(a.token, add_special_tokens=False) for a in e.top_logprobs]
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob
        assert abs(e.top_logprobs[2].logprob - float(np.sort(vec)[-3])) < 1e-4, tops
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, logprobs=True, stream=True
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    np.testing.assert_allclose(
        [e.logprob for e in streamed], [e.logprob for e in entries], atol=1e-4
    )  # (this one's prompt came from the prefix cache)
    assert all(e.top_logprobs == [] for e in streamed)
    c = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=8, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, top_logprobs=2)


def test_min_p_in_a_request(client, served):
    """min_p (mlx_lm.server's request field): 1.0 keeps only the most probable token."""
    greedy = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=16).choices[0]
    hot = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=16, temperature=1.5,
                                    seed=4, extra_body={"min_p": 1.0}).choices[0]  # fmt: skip
    assert hot.text == greedy.text
    status, body = post(served[1], "/v1/completions", {"model": "tiny", "prompt": "x", "min_p": 2})
    assert status == 400 and "min_p" in json.dumps(body)
    for field, bad in (("xtc_probability", 1.5), ("xtc_threshold", 0.7)):
        status, body = post(
            served[1], "/v1/completions", {"model": "tiny", "prompt": "x", field: bad}
        )
        assert status == 400 and field in json.dumps(body)
    same = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=16, temperature=1.5,
                                     seed=4, extra_body={"min_p": 1.0, "xtc_probability": 1.0,
                                                         "xtc_threshold": 0.5})  # fmt: skip
    assert same.choices[0].text == greedy.text  # (one token above 0.5 at most: none excluded)
