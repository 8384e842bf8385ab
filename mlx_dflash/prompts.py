"""Messages to token ids: the one prompt renderer behind generate, chat, bench, train and serve.

With a chat template the messages go through it (generation prompt appended). Without one, a
model only continues text: the system message, then each message, each answer followed by a
newline, so the tokens of earlier turns stay a prefix of later ones (the session cache reuses
them). A BOS token is added where the tokenizer asks for one.
"""

from __future__ import annotations

from typing import Any

from .errors import DFlashError


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_template(tokenizer, chat_template: bool | None) -> bool:
    """Whether to render through the chat template: `chat_template` None means when there is
    one; True without one is a one-sentence error."""
    if chat_template and not has_template(tokenizer):
        raise DFlashError("This model has no chat template; drop --chat-template.")
    return has_template(tokenizer) if chat_template is None else bool(chat_template)


def render(
    tokenizer,
    messages: list[dict[str, Any]],
    system: str | None = None,
    templated: bool = True,
    **template_kwargs,
) -> list[int]:
    """Token ids for `messages` (role/content dicts, the last one the user's), ready for the
    answer; a last assistant message is the answer's start, which the model continues
    (--prefill-response). `template_kwargs` reach the chat template (enable_thinking=False
    for Qwen3)."""
    if templated:
        prefilled = bool(messages) and messages[-1]["role"] == "assistant"  # the answer's start
        return _templated(tokenizer, messages, system, prefilled, **template_kwargs)
    text = f"{system}\n\n" if system else ""
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        text += m["content"] + ("\n" if m["role"] == "assistant" and not last else "")
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


def _templated(tokenizer, messages: list, system: str | None, open_last: bool, **template_kwargs):
    """Token ids through the chat template: the last message left open for the model to
    continue (`open_last`), else followed by the generation prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + list(messages)
    ids = tokenizer.apply_chat_template(
        msgs, add_generation_prompt=not open_last, continue_final_message=open_last,
        tokenize=True, **template_kwargs,
    )  # fmt: skip
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def render_open(
    tokenizer, text: str, system: str | None = None, templated: bool = True
) -> list[int]:
    """A user message left open, for a prompt cache (`dflash-mlx cache`, as mlx-lm's
    cache_prompt renders it): a later prompt continues it (`continuation`)."""
    if not text.strip():
        raise DFlashError("The prompt is empty.")
    msgs = [{"role": "user", "content": text}]
    if templated:
        return _templated(tokenizer, msgs, system, open_last=True)
    return render(tokenizer, msgs, system, False)


def continuation(tokenizer, prompt: str, templated: bool = True, **template_kwargs) -> list[int]:
    """The tokens that follow an open user message (`render_open`) with `prompt`: the rest of
    the message and the generation prompt, found as mlx-lm's generate finds them (the text
    of the template from where the user's content begins)."""
    if not prompt.strip():
        raise DFlashError("The prompt is empty.")
    if not templated:
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    marker = "<query>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False,
        **template_kwargs,
    )  # fmt: skip
    rest = text[text.index(marker) :].replace(marker, prompt, 1)
    return list(tokenizer.encode(rest, add_special_tokens=False))


def thinking_kwargs(tokenizer, templated: bool, thinking: bool | None) -> dict:
    """The chat-template switch for thinking models (Qwen3 / Qwen3.5 `enable_thinking`);
    None leaves the template's default."""
    if thinking is None:
        return {}
    if not templated:
        raise DFlashError("--thinking/--no-thinking needs the model's chat template.")
    return {"enable_thinking": bool(thinking)}


def encode_prompt(
    tokenizer,
    prompt: str,
    chat_template: bool | None = None,
    system: str | None = None,
    thinking: bool | None = None,
    prefill_response: str | None = None,
) -> list[int]:
    """One user prompt, through the chat template when the model has one (or as asked);
    `prefill_response`: the start of the answer, which the model continues."""
    if not prompt.strip():
        raise DFlashError("The prompt is empty.")
    templated = use_template(tokenizer, chat_template)
    kwargs = thinking_kwargs(tokenizer, templated, thinking)
    msgs = [{"role": "user", "content": prompt}]
    if prefill_response:
        msgs.append({"role": "assistant", "content": prefill_response})
    return render(tokenizer, msgs, system, templated, **kwargs)


def xtc_special_ids(tokenizer) -> tuple[int, ...]:
    """What XTC never excludes: a newline and the end-of-text tokens (mlx-lm's)."""
    newline = tokenizer.encode("\n", add_special_tokens=False)
    return tuple(newline) + tuple(sorted(stop_ids(tokenizer)))


def stop_ids(tokenizer) -> frozenset[int]:
    """The tokens that end an answer: the tokenizer's end-of-sequence ids."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
