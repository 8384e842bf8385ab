"""Tool calls through `serve`, with the real `openai` and `anthropic` clients, on a tiny model
that speaks Qwen2.5-Coder's vocabulary through its real tool-capable chat template.

A random model does not call tools by itself, so most tests script what it says: the engine's
rounds are replaced by the tokens of a given answer (everything after them, detokenizing,
thinking, the call parser, both APIs' shapes, is the server's real path). The unscripted tests
check that the tools reach the template (greedy output equals mlx-lm's on the rendered prompt)
and that text a parser cannot read comes back as text.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from tool_models import FAMILY_TEMPLATES, qwen25_header, with_template, write_qwen25_tool_model

from mlx_dflash.engine import stream as engine_stream
from mlx_dflash.engine.session import Round
from mlx_dflash.server.text import ToolCallSplitter

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    return write_qwen25_tool_model(root / "qwen25-tools", qwen25_header(root))


@pytest.fixture(scope="module")
def served(folder):
    from test_serve import serving

    with serving(str(folder), None, "ar") as s:
        yield s


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def script(served, monkeypatch):
    """script(text): the model's next answers are these texts, then its end-of-turn token.
    Returns the prompts (as text) the engine was given, to see what the template wrote."""
    app = served[0]
    tok = app.tokenizer
    prompts: list[str] = []
    answers: list[str] = []

    def rounds(session, prompt, cfg):
        prompts.append(tok.decode(prompt))
        ids = list(tok.encode(answers.pop(0), add_special_tokens=False)) + [tok.eos_token_id]
        yield Round(tokens=[], accepted=0, drafted=0, prefill=True, prefill_tokens=len(prompt))
        for i in range(0, len(ids), 3):  # pieces of 3 tokens: markers arrive split
            piece = ids[i : i + 3]
            done = "stop" if i + 3 >= len(ids) else None
            yield Round(tokens=piece, accepted=len(piece), drafted=0, finished=done)

    monkeypatch.setattr(engine_stream, "generate_rounds", rounds)

    def set_answers(*texts):
        answers[:] = list(texts)
        return prompts

    return set_answers


# ---- pieces ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_splitter_finds_calls_whatever_the_pieces(size):
    text = "Sure." + CALL + "\n" + CALL.replace("Paris", "Rome") + "<tool_ca"
    split = ToolCallSplitter("<tool_call>", "</tool_call>")
    content, calls = "", []
    for i in range(0, len(text), size):
        for kind, piece in split.feed(text[i : i + size]):
            if kind == "text":
                content += piece
            else:
                calls.append(piece)
    rest, unfinished = split.flush()
    assert content + rest == "Sure.\n<tool_ca" and unfinished is None
    assert [json.loads(c)["arguments"]["city"] for c in calls] == ["Paris", "Rome"]
    forced = ToolCallSplitter("<tool_call>", "</tool_call>", inside='\n{"name": "f", ')
    got = forced.feed('"arguments": {}}\n</tool_call>')
    assert got == [("call", '\n{"name": "f", "arguments": {}}\n')]


# ---- the template sees the tools ---------------------------------------------------------------


def test_greedy_with_tools_equals_mlx_lm_on_the_rendered_prompt(served, client):
    app = served[0]
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=12)
    prompt = app.tokenizer.apply_chat_template(
        ASK, tools=[WEATHER], add_generation_prompt=True, tokenize=True
    )
    assert "get_weather" in app.tokenizer.decode(prompt) and "<tools>" in app.tokenizer.decode(
        prompt
    )
    steps = generate_step(mx.array(prompt), app.target.model, max_tokens=12,
                          sampler=lambda x: mx.argmax(x, axis=-1))  # fmt: skip
    want = app.tokenizer.decode([int(t) for t, _ in steps])
    assert r.choices[0].message.content == want
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_a_forced_call_the_parser_cannot_read_comes_back_as_text(served, client):
    """tool_choice required on an untrained model: the prompt opens the call, the random
    continuation is no JSON, and the client gets it as text with a 200."""
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=8
    )
    msg = r.choices[0].message
    assert msg.tool_calls is None and msg.content.startswith("<tool_call>")
    assert r.choices[0].finish_reason == "length"


# ---- OpenAI chat completions ---------------------------------------------------------------------


def test_tool_call_non_streamed(client, script):
    script("Let me check. " + CALL)
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_tool_call_streamed(client, script):
    script("Checking. " + CALL + "\n" + CALL.replace("get_weather", "get_time"))
    chunks = list(client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], stream=True))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.strip() == "Checking."
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    firsts = [d for d in deltas if d.id]
    assert [d.function.name for d in firsts] == ["get_weather", "get_time"]
    assert all(d.function.arguments == "" for d in firsts)  # id and name come first
    args = {0: "", 1: ""}
    for d in deltas:
        args[d.index] += d.function.arguments or ""
    assert json.loads(args[0]) == json.loads(args[1]) == {"city": "Paris", "days": 2}
    assert sum(1 for d in deltas if not d.id) >= 4  # the arguments come in fragments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_two_step_agent_loop(client, script):
    """call -> the tool's result -> an answer: the assistant's call and the tool message
    reach the template (Qwen2.5 writes them as <tool_call> and <tool_response>)."""
    prompts = script(CALL, "It is sunny in Paris.")
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    assert '"city": "Paris"' in prompts[1] and '<tool_response>\n{"sky": "sunny"}' in prompts[1]


def test_tool_choice_required_and_named_open_the_call_in_the_prompt(client, script):
    prompts = script('\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                     '{"city": "Oslo"}}\n</tool_call>')  # fmt: skip
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required"
    )
    assert prompts[0].endswith("<|im_start|>assistant\n<tool_call>")
    assert r.choices[0].message.tool_calls[0].function.name == "get_time"
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=named
    )
    assert prompts[1].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"
    }


def test_tool_choice_none_and_no_parallel_calls(client, script):
    prompts = script(CALL, CALL + CALL.replace("Paris", "Rome"))
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none"
    )
    assert "<tools>" not in prompts[0]  # no tools offered, and none parsed
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], parallel_tool_calls=False
    )
    assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"


def test_unreadable_call_is_text_not_a_500(client, script):
    script("<tool_call>\n{not json\n</tool_call> done")
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == "<tool_call>\n{not json\n</tool_call> done"
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "'name'"),
    ({"tools": [{"type": "retrieval"}]}, r"tools\[0\] must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not among"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER, WEATHER]}, "share a name"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize("extra, match", BAD, ids=[m for _, m in BAD])
def test_bad_tools_are_a_400_and_the_server_keeps_serving(client, extra, match):
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, **extra)
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.body["param"] in ("tools", "tool_choice", "parallel_tool_calls")
    assert client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices


def test_tools_for_a_model_without_tool_support_are_a_400(tmp_path):
    """The THINKING_TEMPLATE model of test_serve has a template with no tool markers."""
    from test_serve import THINKING_TEMPLATE, serving

    from mlx_dflash.models.tiny import write_tiny_target

    folder = write_tiny_target(tmp_path / "m", "qwen3")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "chat_template": THINKING_TEMPLATE})
    )
    with serving(str(folder), None, "ar") as (_, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no tool-call support"):
            c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=2)


# ---- Anthropic messages ------------------------------------------------------------------------

A_WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture
def claude(served):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a dev dependency")
    return anthropic.Anthropic(base_url=served[1], api_key="none", max_retries=0)


def test_anthropic_tool_use_and_result(claude, script):
    prompts = script("Checking. " + CALL, "Sunny.")
    r = claude.messages.create(model="tiny", max_tokens=64, messages=ASK, tools=[A_WEATHER])
    assert r.stop_reason == "tool_use"
    text, use = r.content
    assert text.type == "text" and text.text == "Checking. "
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "Paris", "days": 2}
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]  # fmt: skip
    r2 = claude.messages.create(model="tiny", max_tokens=64, messages=history, tools=[A_WEATHER])
    assert r2.content[0].text == "Sunny." and r2.stop_reason == "end_turn"
    assert "<tool_response>\nsunny" in prompts[1]


def test_anthropic_tool_use_streamed(claude, script):
    script(CALL.removeprefix("<tool_call>"))  # tool_choice "any": the prompt opened the call
    with claude.messages.stream(
        model="tiny", max_tokens=64, messages=ASK, tools=[A_WEATHER],
        tool_choice={"type": "any"},
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert "content_block_start" in kinds and "message_stop" in kinds
    partial = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert partial and json.loads("".join(e.delta.partial_json for e in partial)) == {
        "city": "Paris",
        "days": 2,
    }
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.input == {"city": "Paris", "days": 2} and final.stop_reason == "tool_use"


# ---- the other parser families our registry targets use ---------------------------------------

FAMILY_CALLS = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
}


@pytest.fixture(scope="module", params=sorted(FAMILY_TEMPLATES))
def family(request, folder, tmp_path_factory):
    """(family, app, url): the Qwen2.5 vocabulary behind another family's template, thinking."""
    from test_serve import serving

    out = tmp_path_factory.mktemp(request.param) / "model"
    with_template(folder, out, FAMILY_TEMPLATES[request.param], think=True)
    with serving(str(out), None, "ar") as (app, url):
        yield request.param, app, url


def test_each_family_parses_its_calls_apart_from_the_thinking(family, monkeypatch):
    name, app, url = family
    assert app.tokenizer.tool_parser.__module__.endswith(name)
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    answers = ["Paris, two days.</think>\n\n" + FAMILY_CALLS[name], "Sunny.</think>\n\nSunny."]
    prompts = []

    def rounds(session, prompt, cfg):
        prompts.append(app.tokenizer.decode(prompt))
        ids = list(app.tokenizer.encode(answers.pop(0), add_special_tokens=False))
        yield Round(tokens=[], accepted=0, drafted=0, prefill=True, prefill_tokens=len(prompt))
        yield Round(
            tokens=ids + [app.tokenizer.eos_token_id], accepted=1, drafted=0, finished="stop"
        )

    monkeypatch.setattr(engine_stream, "generate_rounds", rounds)
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Paris, two days."
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
    r = c.chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "Sunny."
    assert "get_weather" in prompts[1] and "Paris" in prompts[1]  # the call went back in
    # this template thinks first and has no switch to skip it: a call cannot be forced
    with pytest.raises(openai.BadRequestError, match="cannot be forced"):
        c.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required"
        )


# ---- the Responses API -------------------------------------------------------------------------

R_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_text_equals_chat(client):
    r = client.responses.create(model="tiny", input="What is the weather in Paris?",
                                max_output_tokens=10)  # fmt: skip
    chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=10)
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 10 and r.usage.input_tokens > 5


def test_responses_function_call_streamed_then_continued(client, script):
    """Codex CLI's loop: a streamed call, then its output sent with previous_response_id."""
    prompts = script("Checking. " + CALL, "It is sunny.")
    events = list(client.responses.create(
        model="tiny", instructions="Be brief.", input="What is the weather in Paris?",
        tools=[R_WEATHER], stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for k in ("response.output_item.added", "response.output_text.delta",
              "response.function_call_arguments.delta", "response.output_item.done"):  # fmt: skip
        assert k in kinds, k
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "Checking. " and json.loads(args) == {"city": "Paris", "days": 2}
    final = events[-1].response
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == json.loads(args)
    assert prompts[0].startswith("<|im_start|>system\nBe brief.")

    r = client.responses.create(
        model="tiny", previous_response_id=final.id, tools=[R_WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert r.output_text == "It is sunny." and r.status == "completed"
    assert '"city": "Paris"' in prompts[1] and "<tool_response>\nsunny" in prompts[1]
    # the same turn sent as items, as a client without previous_response_id does
    script("Sunny again.")
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]  # fmt: skip
    r = client.responses.create(model="tiny", input=items, tools=[R_WEATHER])
    assert r.output_text == "Sunny again." and "<tool_response>\nsunny" in prompts[2]


@pytest.mark.parametrize(
    "extra, match, param",
    [
        ({"previous_response_id": "resp_gone"}, "not kept by this server", "previous_response_id"),
        ({"previous_response_id": 3}, "must be a string", "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "only function tools", "tools"),
        ({"input": [{"type": "image_generation_call"}]}, "not supported", "input"),
        ({"input": 3}, "'input' must be", "input"),
    ],
)
def test_responses_bad_requests(client, extra, match, param):
    """One sentence, an invalid_request_error, naming the field at fault."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.responses.create(**body)
    error = err.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


# ---- keep-alive --------------------------------------------------------------------------------


@pytest.mark.parametrize("keepalive", [0.3, None])
def test_an_idle_timeout_client_survives_a_long_prefill(folder, monkeypatch, keepalive):
    """A client that drops a stream idle for 1 s, facing a 2.5 s prefill: comment frames every
    0.3 s keep it; without them (the control) it times out. The first token still streams
    the moment it exists."""
    import time

    from test_serve import serving

    def slow(session, prompt, cfg):
        time.sleep(2.5)  # the prefill of an agent's long context
        yield Round(tokens=[], accepted=0, drafted=0, prefill=True, prefill_tokens=len(prompt))
        yield Round(tokens=[app.tokenizer.encode("Hi")[0], app.tokenizer.eos_token_id],
                    accepted=2, drafted=0, finished="stop")  # fmt: skip

    monkeypatch.setattr(engine_stream, "generate_rounds", slow)
    with serving(str(folder), None, "ar", keepalive_s=keepalive or 60.0) as (app, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1.0)
        if keepalive is None:
            with pytest.raises(openai.APITimeoutError):
                list(c.chat.completions.create(model="tiny", messages=ASK, stream=True))
            return
        t0 = time.monotonic()
        chunks = list(c.chat.completions.create(model="tiny", messages=ASK, stream=True))
        assert time.monotonic() - t0 >= 2.5
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Hi"


# ---- /metrics ----------------------------------------------------------------------------------


def test_metrics_parse_with_prometheus_clients_own_parser(client, served):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6)
    client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6)  # a prefix hit
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    with urllib.request.urlopen(served[1] + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }

    def get(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    chat = "/v1/chat/completions"
    assert get("dflash_requests_total", endpoint=chat, status="200") >= 2
    assert get("dflash_requests_total", endpoint=chat, status="400") >= 1
    assert get("dflash_completion_tokens_total") >= 12
    assert get("dflash_prompt_tokens_total") > get("dflash_cached_prompt_tokens_total") > 0
    assert get("dflash_prefix_cache_hits_total") >= 1
    rounds = get("dflash_rounds_total", kind="plain") + get("dflash_rounds_total", kind="drafted")
    assert get("dflash_acceptance_length_count") == rounds > 0
    assert get("dflash_prefill_seconds_count") == get("dflash_decode_seconds_count") >= 2
    assert get("dflash_queue_depth") == 0 and ("dflash_busy", ()) in samples
