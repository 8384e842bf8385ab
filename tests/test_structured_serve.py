"""Structured output through `serve`, with the real clients: OpenAI's response_format
(json_schema, json_object), the Responses API's text.format, Anthropic's output_format and
strict tools, on a tiny random model speaking Qwen2.5's vocabulary through its real template.

A random model left alone would never write JSON; under the grammar every answer must parse and
validate, and the greedy answer must be plain constrained decoding's (mlx-lm's generate_step
with llguidance's bitmask, test_grammar.reference's processor) on the same rendered prompt.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from test_grammar import library_processor
from test_serve import serving
from test_tools import ASK, WEATHER
from tool_models import qwen25_header, write_qwen25_tool_model

from mlx_dflash.engine.grammar import GrammarSpec
from mlx_dflash.prompts import stop_ids
from mlx_dflash.server.structured import tool_grammar

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    with serving(str(write_qwen25_tool_model(root / "m", qwen25_header(root))), None, "ar") as s:
        yield s


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0)


# x-guidance (llguidance's own schema option) keeps a random model from writing whitespace for
# ever; real models end their JSON by themselves.
PERSON = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


def constrained_reference(app, prompt_ids, schema, n):
    proc = library_processor(app.target, GrammarSpec.json_schema(schema), len(prompt_ids))
    tok = app.tokenizer
    out = []
    for t, _ in generate_step(mx.array(prompt_ids), app.target.model, max_tokens=n,
                              sampler=lambda x: mx.argmax(x, axis=-1), logits_processors=[proc]):  # fmt: skip
        if int(t) in stop_ids(tok):
            break
        out.append(int(t))
    return tok.decode(out)


def test_json_schema_response_format_is_plain_constrained_decoding(served, client):
    app = served[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                       response_format=fmt)  # fmt: skip
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert r.choices[0].finish_reason == "stop"
    prompt = app.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)
    assert text == constrained_reference(app, prompt, PERSON, 60)
    # streamed: the same text in pieces
    stream = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                            response_format=fmt, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_json_object_starts_an_object(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=30,
                                       response_format={"type": "json_object"})  # fmt: skip
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_responses_text_format_and_anthropic_output_format(served, client):
    r = client.responses.create(
        model="tiny", input="Where?", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), PERSON)
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a dev dependency")
    claude = anthropic.Anthropic(base_url=served[1], api_key="none", max_retries=0)
    m = claude.messages.create(
        model="tiny", max_tokens=60, messages=[{"role": "user", "content": "Where?"}],
        extra_body={"output_format": {"type": "json_schema", "schema": PERSON}},
    )  # fmt: skip
    jsonschema.validate(json.loads(m.content[0].text), PERSON)


STRICT = {
    "type": "function",
    "function": {**WEATHER["function"], "strict": True, "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}}},
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}  # fmt: skip


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_strict_tools_arguments_follow_the_schema(client, choice):
    """A random model forced to call: without strict its arguments are noise (the test in
    test_tools shows it comes back as text); with strict they are valid."""
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=80,
                                       tools=[STRICT, TIME], tool_choice=choice)  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1, r.choices[0].message.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (STRICT, TIME)}
    fn = calls[0].function
    jsonschema.validate(json.loads(fn.arguments), schemas[fn.name])
    if isinstance(choice, dict):
        assert fn.name == "get_weather"


def test_strict_responses_tool_follows_its_schema_and_is_echoed(client):
    """The Responses API's flat tools: `strict` constrains the call as in chat and comes back
    in the answer's `tools`."""
    r = client.responses.create(model="tiny", input="Weather?", max_output_tokens=80,
                                tools=[{"type": "function", **STRICT["function"]}],
                                tool_choice="required")  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output_text
    jsonschema.validate(json.loads(calls[0].arguments), STRICT["function"]["parameters"])
    assert r.tools[0].strict is True


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"response_format": {"type": "xml"}}, "'text', 'json_object' or 'json_schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "JSON Schema object"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
         "cannot be compiled"),
    ],
)  # fmt: skip
def test_bad_formats_are_a_400_with_the_reason(client, extra, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, extra_body=extra)
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert r.choices[0].finish_reason == "length"  # the server keeps serving


def test_strict_tools_under_auto_constrain_calls_and_leave_text_free(served, client):
    """tool_choice auto: text stays free (a random model writes text), and a call, when the
    answer makes one, is valid; the grammar itself lets text end the answer, or open calls."""
    from mlx_dflash.engine.grammar import compile_grammar
    from mlx_dflash.server.tools import parse_tools

    app = served[0]
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12,
                                       tools=[STRICT, TIME])  # fmt: skip
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    tools = parse_tools({"tools": [STRICT, TIME]})
    spec = tool_grammar(app.tokenizer, tools, {"get_weather", "get_time"})
    tok = app.tokenizer
    end = sorted(stop_ids(tok))[0]

    def accepts(text: str) -> bool:
        g = compile_grammar(spec, tok, app.target.vocab_size, stop_ids(tok))
        ids = tok.encode(text, add_special_tokens=False) + [end]
        return g.matcher.validate_tokens(ids) == len(ids)

    good = 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone":"UTC"}}\n</tool_call>'
    assert accepts("Just text, no call.") and accepts(good)
    again = good.removeprefix("Sure.")
    assert accepts(good + "\n" + again)  # parallel calls
    assert not accepts(good.replace('"UTC"', '"PST"'))  # an argument outside its enum
    tools.parallel = False
    spec = tool_grammar(app.tokenizer, tools, {"get_weather", "get_time"})
    assert not accepts(good + "\n" + again)


def test_strict_tool_without_parameters_is_an_empty_parameter_list(served, client):
    """OpenAI's `parameters` are optional (none: an empty parameter list), strict tools too."""
    from mlx_dflash.engine.grammar import compile_grammar
    from mlx_dflash.server.tools import parse_tools

    bare = {"type": "function", "function": {"name": "ping", "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, tools=[bare],
                                       tool_choice="required")  # fmt: skip
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    app, tok = served[0], served[0].tokenizer
    spec = tool_grammar(tok, parse_tools({"tools": [bare]}), {"ping"})
    g = compile_grammar(spec, tok, app.target.vocab_size, stop_ids(tok))
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    ids = tok.encode(call, add_special_tokens=False) + [sorted(stop_ids(tok))[0]]
    assert g.matcher.validate_tokens(ids) == len(ids)


def test_anthropic_strict_tool(served):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a dev dependency")
    claude = anthropic.Anthropic(base_url=served[1], api_key="none", max_retries=0)
    f = STRICT["function"]
    tool = {"name": f["name"], "description": f["description"], "input_schema": f["parameters"],
            "strict": True}  # fmt: skip
    r = claude.messages.create(model="tiny", max_tokens=80, messages=ASK, tools=[tool],
                               tool_choice={"type": "tool", "name": f["name"]})  # fmt: skip
    use = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(use) == 1
    jsonschema.validate(use[0].input, f["parameters"])
