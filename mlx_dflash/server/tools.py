"""Tool calls: the request's tools into the chat template, the model's calls back out.

No parser is written here. mlx-lm's tokenizer wrapper already knows, from the chat template,
the markers around a call (`tool_call_start` / `tool_call_end`) and the parser of that family
(json_tools, qwen3_coder, kimi_k2, minimax_m2, gemma4, glm47, ...). We cut the streamed text at
those markers (text.py's ToolCallSplitter) and hand each call's text to that parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import APIError

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")

# What forcing a named function writes after the start marker, per mlx-lm parser family: the
# model then only fills in the arguments. Families missing here accept "required" but not a name.
NAMED_HEADS = {
    "json_tools": '\n{{"name": "{name}", "arguments": ',
    "qwen3_coder": "\n<function={name}>\n",
}


@dataclass
class Tools:
    """A request's tools, checked: `specs` as chat templates take them (OpenAI's function
    tools as the client sent them; Anthropic's rewritten so), and how the model may use them."""

    specs: list[dict]
    choice: str = "auto"  # "auto" | "none" | "required" | "function"
    name: str | None = None  # the function tool_choice names
    parallel: bool = True


def _schema(params: Any, where: str) -> dict:
    """A function's parameters: a JSON Schema object (checked for shape, not validated)."""
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise APIError(400, f"{where} must be a JSON Schema object.", param="tools")
    if "type" in params and not isinstance(params["type"], str | list):
        raise APIError(400, f"{where}.type must be a string or a list.", param="tools")
    if "properties" in params and not isinstance(params["properties"], dict):
        raise APIError(400, f"{where}.properties must be an object.", param="tools")
    if "required" in params and not (
        isinstance(params["required"], list) and all(isinstance(r, str) for r in params["required"])
    ):
        raise APIError(400, f"{where}.required must be a list of names.", param="tools")
    return params


def _function(name: Any, description: Any, params: Any, where: str) -> dict:
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(
            400,
            f"{where} needs a 'name' of letters, digits, '_', '-', '.' or ':' (1-128).",
            param="tools",
        )
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string.", param="tools")
    fn = {"name": name, "parameters": _schema(params, f"{where}.parameters")}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def _specs(body: dict, anthropic: bool) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list.", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise APIError(400, f"tools[{i}] must be an object.", param="tools")
        if anthropic:
            out.append(_function(t.get("name"), t.get("description"), t.get("input_schema"),
                                 f"tools[{i}]"))  # fmt: skip
            continue
        if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise APIError(
                400,
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.",
                param="tools",
            )
        f = t["function"]
        _function(f.get("name"), f.get("description"), f.get("parameters"), f"tools[{i}].function")
        out.append(t)  # as sent: templates write tools out verbatim (key order included)
    names = [s["function"]["name"] for s in out]
    if len(set(names)) != len(names):
        raise APIError(400, "Two tools share a name.", param="tools")
    return out


def parse_tools(body: dict, anthropic: bool = False) -> Tools | None:
    """The request's `tools` and `tool_choice` (OpenAI's shapes, or Anthropic's), or None."""
    specs = _specs(body, anthropic)
    raw = body.get("tool_choice")
    if not specs:
        if raw not in (None, "none", "auto") and not (anthropic and isinstance(raw, dict)
                                                      and raw.get("type") in ("auto", "none")):  # fmt: skip
            raise APIError(400, "'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    tools = Tools(specs)
    if anthropic:
        _anthropic_choice(tools, raw)
    else:
        _openai_choice(tools, raw)
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise APIError(
                400, "'parallel_tool_calls' must be true or false.", param="parallel_tool_calls"
            )
        tools.parallel = parallel
    if tools.name is not None and tools.name not in {s["function"]["name"] for s in specs}:
        raise APIError(
            400,
            f"'tool_choice' names '{tools.name}', which is not among the tools.",
            param="tool_choice",
        )
    return tools


def _openai_choice(tools: Tools, raw: Any) -> None:
    if raw is None or raw in ("auto", "none", "required"):
        tools.choice = raw or "auto"
    elif isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        tools.choice, tools.name = "function", fn.get("name") if isinstance(fn, dict) else None
    else:
        raise APIError(
            400,
            "'tool_choice' must be 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}.",
            param="tool_choice",
        )


def _anthropic_choice(tools: Tools, raw: Any) -> None:
    if raw is None:
        return
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(
            400,
            "'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}.",
            param="tool_choice",
        )
    tools.choice = {"any": "required", "tool": "function"}.get(kind, str(kind))
    if kind == "tool":
        tools.name = raw.get("name")
    tools.parallel = not raw.get("disable_parallel_tool_use", False)


# ---- the model's side ----------------------------------------------------------------------


def parser_family(tokenizer) -> str | None:
    """The mlx-lm tool parser module's name for this tokenizer (json_tools, ...), or None."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(tokenizer, "has_tool_calling", False):
        return None
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None


def forced_prefix(tokenizer, tools: Tools) -> str:
    """What the answer must start with for tool_choice required / a named function: the
    start marker (and, for a name, the family's head up to the arguments). '' for auto."""
    if tools.choice not in ("required", "function"):
        return ""
    start = tokenizer.tool_call_start
    if tools.choice == "required":
        return start
    family = parser_family(tokenizer)
    head = NAMED_HEADS.get(family or "")
    if head is None:
        raise APIError(
            400,
            f"A 'tool_choice' naming a function is not supported for this model's tool-call "
            f"format ({family}); use 'required' or 'auto'.",
            param="tool_choice",
        )
    return start + head.format(name=tools.name)


def parse_call(tokenizer, text: str, tools: Tools) -> list[dict] | None:
    """A call's text (between the markers) as OpenAI tool calls, with the arguments a JSON
    string; None when the parser cannot read it (the caller sends the text as it came)."""
    try:
        parsed = tokenizer.tool_parser(text, tools.specs)
    except Exception:  # any parser failure: the text goes back as text, never a 500
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", {})
        if isinstance(args, str):  # some parsers hand back the JSON text itself
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        if not isinstance(args, dict):  # clients read an object of arguments
            return None
        args = json.dumps(args, ensure_ascii=False)
        out.append(
            {
                "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c["name"], "arguments": args},
            }
        )
    return out
