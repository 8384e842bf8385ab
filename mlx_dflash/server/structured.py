"""Structured output requests: OpenAI's `response_format`, the Responses API's `text.format`,
Anthropic's `output_format`, and `strict` tools, as grammars for the engine (engine/grammar.py).

Schemas are handed to llguidance as they come (no schema-to-grammar code here); what this
module writes is only the frame a strict tool call sits in: the family's call markup around
`%json {parameters schema}`, in llguidance's Lark dialect.
"""

from __future__ import annotations

import json
from typing import Any

from ..engine.grammar import GrammarSpec, compile_grammar
from ..errors import DFlashError
from .errors import APIError
from .tools import Tools, parser_family


def _schema_format(fmt: Any, param: str, nested: bool) -> GrammarSpec | None:
    """{"type": "text" | "json_object" | "json_schema", ...}: OpenAI's chat shape (`nested`:
    the schema under "json_schema") or the Responses / Anthropic shape (schema at the top)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(
            400, f"'{param}' must have type 'text', 'json_object' or 'json_schema'.", param=param
        )
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return GrammarSpec("json_object")
    holder = fmt.get("json_schema") if nested else fmt
    if not isinstance(holder, dict) or not isinstance(holder.get("schema"), dict):
        where = f"{param}.json_schema.schema" if nested else f"{param}.schema"
        raise APIError(400, f"'{where}' must be a JSON Schema object.", param=param)
    return GrammarSpec.json_schema(holder["schema"])


def response_format(body: dict, kind: str) -> GrammarSpec | None:
    """The grammar a request's body asks for, by endpoint: chat `response_format`, responses
    `text.format`, messages `output_format`; completions take none."""
    if kind == "chat":
        return _schema_format(body.get("response_format"), "response_format", nested=True)
    if kind == "responses":
        text = body.get("text")
        if text is None:
            return None
        if not isinstance(text, dict):
            raise APIError(400, "'text' must be an object.", param="text")
        return _schema_format(text.get("format"), "text.format", nested=False)
    if kind == "messages":
        return _schema_format(body.get("output_format"), "output_format", nested=False)
    return None


def strict_names(body: dict, anthropic: bool) -> set[str]:
    """The tools the client marked `strict: true` (OpenAI: on the function; Anthropic: on
    the tool)."""
    out = set()
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        f = t if anthropic else t.get("function")
        if isinstance(f, dict) and f.get("strict") is True and isinstance(f.get("name"), str):
            out.add(f["name"])
    return out


def tool_grammar(tokenizer, tools: Tools, strict: set[str]) -> GrammarSpec | None:
    """The grammar of the answer when some tools are strict: their calls' arguments are valid
    under the function's parameters schema. A forced call (tools.py's forced_prefix already
    opened it in the prompt) continues with exactly one call, then the end marker; under
    `auto` the answer is free text, then any number of calls (one without parallel calls).
    None when nothing is strict.

    Written for the JSON-in-markers family (`json_tools`: Qwen2.5/3, Hermes): other families
    write arguments in their own markup, which a JSON schema does not describe."""
    if not strict or tools.choice == "none":
        return None
    family = parser_family(tokenizer)
    if family != "json_tools":
        raise APIError(
            400,
            f"'strict' tools are supported for JSON tool calls (json_tools); this model's "
            f"tool-call format is {family}.",
            param="tools",
        )
    specs = {}
    for fn in (s["function"] for s in tools.specs):
        params = fn.get("parameters")  # optional (OpenAI): none is an empty parameter list
        specs[fn["name"]] = {"type": "object", "properties": {}} if params is None else params
    start, end = (
        _literal(tokenizer, m) for m in (tokenizer.tool_call_start, tokenizer.tool_call_end)
    )
    rules = [f"args_{i}: %json {json.dumps(specs[n] if n in strict else {'type': 'object'})}"
             for i, n in enumerate(sorted(specs))]  # fmt: skip
    index = {n: i for i, n in enumerate(sorted(specs))}
    if tools.choice == "function":
        assert tools.name is not None
        one = f'start: args_{index[tools.name]} "}}\\n" {end}'
        return GrammarSpec("lark", "\n".join([one, *rules]))
    call = " | ".join(
        f'"{{\\"name\\": \\"{n}\\", \\"arguments\\": " args_{index[n]} "}}"' for n in sorted(specs)
    )
    if tools.choice == "required":
        head = [f'start: "\\n" call "\\n" {end}']
    else:
        one = f'{start} "\\n" call "\\n" {end}'
        calls = f"({one} WS?)+" if tools.parallel else one
        head = ["start: TEXT? calls?", f"calls: {calls}", "TEXT: /(?s:.+)/", "WS: /[ \\n]+/"]
    return GrammarSpec("lark", "\n".join([*head, f"call: {call}", *rules]))


def _literal(tokenizer, text: str) -> str:
    """A marker in llguidance's Lark: its special token by id when it is one, else the text."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) == 1:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def check_grammar(spec: GrammarSpec | None, target, stop_ids, param: str) -> None:
    """Compile now, so that a schema llguidance refuses is a 400 with its reason, before any
    streaming starts."""
    if spec is None:
        return
    try:
        compile_grammar(spec, target.tokenizer, target.vocab_size, stop_ids)
    except DFlashError as e:
        raise APIError(400, str(e), param=param) from None
