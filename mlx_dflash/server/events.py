"""A job's events, in order, from the worker to the handler that answers it: pieces of text,
logprobs and tool calls as the answer goes, then one Done or Failed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Text:
    reasoning: str | None  # inside the thinking block
    content: str | None


@dataclass
class Logprobs:
    tokens: list[int]
    logprobs: list  # per token: (its logprob, [(alternative, logprob)])


@dataclass
class ToolCalls:
    calls: list[dict]


@dataclass
class Failed:
    message: str


@dataclass
class Done:
    finish: str  # "stop" | "length" | "cancelled" | "tool_calls"
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stats: dict
