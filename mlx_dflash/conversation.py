"""A multi-turn conversation on one long-lived Session (chat, and later the server).

Every turn renders the whole history (prompts.render) and hands it to the Session, whose
`rewind` keeps the longest cached token prefix: only the new text of a turn is prefilled, with
no bookkeeping here about what the cache holds.
"""

from __future__ import annotations

from collections.abc import Callable

from .engine import GenerationConfig, Session, Stats, stream_generate
from .prompts import render, thinking_kwargs, use_template


class Conversation:
    """A conversation: messages, the Session whose cache outlives turns, and running totals."""

    def __init__(
        self,
        target,
        runner,
        cfg: GenerationConfig,
        system: str | None = None,
        chat_template: bool | None = None,
        thinking: bool | None = None,
        kv=None,
        max_kv_size: int | None = None,
    ):
        self.tokenizer = target.tokenizer
        self.templated = use_template(self.tokenizer, chat_template)
        self.template_kwargs = thinking_kwargs(self.tokenizer, self.templated, thinking)
        self.cfg = cfg
        # kv, max_kv_size: a quantized or rotating KV cache (--kv-bits, --max-kv-size)
        self.session = Session(target, runner if cfg.uses_drafter else None, kv, max_kv_size)
        self.system = system or None
        self.messages: list[dict[str, str]] = []
        self.total = Stats()
        self.turns = 0
        self.last_prompt_tokens = 0  # length of the last rendered conversation

    def render(self, user: str) -> list[int]:
        """Token ids of the whole conversation plus `user`, ready for the answer."""
        msgs = [*self.messages, {"role": "user", "content": user}]
        return render(self.tokenizer, msgs, self.system, self.templated, **self.template_kwargs)

    def turn(
        self,
        user: str,
        write: Callable[[str], None] = lambda s: None,
        stopped: Callable[[], bool] = lambda: False,
    ) -> tuple[str, Stats]:
        """Answer one message, streaming text to `write`; `stopped()` or Ctrl-C ends it early.

        An interrupted answer is kept (as far as it got) in the history, and the session stays
        usable: its caches always hold a consistent prefix of what was decided.
        """
        ids = self.render(user)
        self.last_prompt_tokens = len(ids)
        stats, tokens, printed = Stats(), [], []  # (stats: the last chunk's running totals)
        gen = stream_generate(self.session, ids, self.cfg)
        try:
            for chunk in gen:
                stats = chunk.stats
                tokens += chunk.tokens
                printed.append(chunk.text)
                write(chunk.text)
                if stopped() and not stats.finish:
                    stats.finish = "interrupted"
                    break
        except KeyboardInterrupt:
            stats.finish = "interrupted"
        finally:
            gen.close()
        answer = self.tokenizer.decode([t for t in tokens if t not in self.cfg.stop_ids])
        shown = "".join(printed)
        if answer.startswith(shown) and len(answer) > len(shown):
            write(answer[len(shown) :])  # the detokenizer's held-back tail after a stop
        self.messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer},
        ]
        self.turns += 1
        self.total.merge(stats)
        return answer, stats

    def reset(self) -> None:
        self.messages = []

    def save(self, path, model: str) -> int:
        """Write the conversation and its session's caches to a prompt cache file (chat's
        /save), for `chat --prompt-cache-file` or `generate --prompt-cache-file` to go on from;
        the tokens saved."""
        from . import prompt_cache as pc

        pc.save(path, self.session, model, source="chat", messages=list(self.messages),
                system=self.system, chat_template=self.templated)  # fmt: skip
        return len(self.session.tokens)

    def resume(self, meta, arrays) -> None:
        """Go on from a prompt cache file chat's /save wrote: its messages, its system message
        and its caches."""
        from . import prompt_cache as pc
        from .errors import DFlashError

        if meta.source != "chat":
            raise DFlashError(
                "This prompt cache holds one open prompt (`dflash-mlx cache`): continue it with "
                "generate --prompt-cache-file; chat reads the files its /save writes."
            )
        pc.restore(self.session, meta, arrays, self.session.target.folder)
        self.messages, self.system = list(meta.messages), meta.system

    def turn_line(self, stats: Stats) -> str:
        """The short line after each answer."""
        d = stats.to_dict()
        reused = self.last_prompt_tokens - stats.prompt_tokens
        line = (
            f"{d['generated_tokens']} tok @ {d['generation_tps']:.1f} tok/s | "
            f"tau {d['mean_tau']:.2f} | "
            f"prefill {stats.prompt_tokens} new of {self.last_prompt_tokens} ({reused} cached)"
        )
        if stats.finish == "length":  # the answer stops mid-thought: say why
            return line + f" | cut at --max-tokens {self.cfg.max_tokens}"
        return line + (" | interrupted" if stats.finish == "interrupted" else "")

    def stats_text(self) -> str:
        s = self.total
        d = s.to_dict()
        dec = s.t_decode or 1.0
        hist = " ".join(f"{k}:{v}" for k, v in d["tau_histogram"].items()) or "-"
        tps = max(s.tokens - self.turns, 0) / s.t_decode if s.t_decode else 0.0
        return "\n".join(
            [
                f"turns {self.turns} | messages in history {len(self.messages)} | "
                f"context {len(self.session.tokens)} tokens cached",
                f"generated {s.tokens} tok @ {tps:.1f} tok/s | mean tau {d['mean_tau']:.2f} "
                f"[{hist}]",
                f"prefilled {s.prompt_tokens} tok in {s.t_prefill:.2f} s | "
                f"draft {100 * s.t_draft / dec:.0f}% verify {100 * s.t_verify / dec:.0f}% "
                f"other {100 * s.t_other / dec:.0f}%",
                f"mode {self.cfg.mode} | system message: "
                + (repr(self.system) if self.system else "none (/system sets one)"),
            ]
        )
