"""What users look at after a generation: speeds, acceptance length tau, its histogram and
the round-by-round lengths, and where the time went."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .session import Round


@dataclass
class Stats:
    """Aggregates rounds into what users look at: speeds, tau and its histogram, time split."""

    prompt_tokens: int = 0
    t_prefill: float = 0.0
    tokens: int = 0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_other: float = 0.0
    t_build: float = 0.0  # Python building graphs, inside draft + verify
    taus: list[int] = field(default_factory=list)
    tau_total: int = 0  # sum(taus), kept as rounds come: every streamed chunk reads the mean
    draft_rounds: int = 0  # rounds that ran the drafter (auto's pauses and plain steps do not)
    finish: str | None = None
    peak_memory: float = 0.0  # GB that MLX held at most (mx.get_peak_memory, as mlx-lm reports)
    # Structured output (engine/grammar.py): draft nodes the grammar pruned, its certain drafts
    # verified and accepted, and the time inside the grammar library.
    grammar_pruned: int = 0
    grammar_drafts: int = 0
    grammar_drafts_accepted: int = 0
    t_grammar: float = 0.0

    def merge(self, other: Stats) -> None:
        """Add another generation's totals (a chat session's running stats)."""
        mine = vars(self)
        for name, value in vars(other).items():
            if name == "peak_memory":
                self.peak_memory = max(self.peak_memory, value)
            elif name != "finish":
                mine[name] += value  # counts and times add, `taus` extends

    def add(self, r: Round) -> None:
        if r.prefill:
            self.prompt_tokens += r.prefill_tokens
            self.t_prefill += r.t_prefill
            self.t_other += r.t_other  # sampling the first token
        else:
            self.taus.append(r.accepted)
            self.tau_total += r.accepted
            self.draft_rounds += r.t_draft > 0
            self.t_draft += r.t_draft
            self.t_verify += r.t_verify
            self.t_other += r.t_other
            self.t_build += r.t_build
        self.grammar_pruned += r.pruned
        self.grammar_drafts += r.certain
        self.grammar_drafts_accepted += r.certain_accepted
        self.t_grammar += r.t_grammar
        self.tokens += len(r.tokens)
        self.finish = r.finished or self.finish

    @property
    def t_decode(self) -> float:
        return self.t_draft + self.t_verify + self.t_other

    @property
    def generation_tps(self) -> float:
        """Tokens per second of decoding (the first token comes from the prefill)."""
        t = self.t_decode
        return (self.tokens - 1) / t if t > 0 and self.tokens > 1 else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.t_prefill if self.t_prefill else 0.0

    @property
    def mean_tau(self) -> float:
        return self.tau_total / len(self.taus) if self.taus else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.taus).items()))

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": self.prompt_tps,
            "generated_tokens": self.tokens,
            "generation_tps": self.generation_tps,
            "rounds": len(self.taus),
            "draft_rounds": self.draft_rounds,
            "mean_tau": self.mean_tau,
            "tau_histogram": self.histogram,
            # Round by round, to compare with other implementations (the last rounds draft
            # no further than the remaining token budget, so they may be shorter).
            "acceptance_lengths": list(self.taus),
            "time_draft_s": self.t_draft,
            "time_verify_s": self.t_verify,
            "time_other_s": self.t_other,
            "time_build_s": self.t_build,
            "time_prefill_s": self.t_prefill,
            "peak_memory_gb": self.peak_memory,
            "grammar_pruned": self.grammar_pruned,
            "grammar_drafts": self.grammar_drafts,
            "grammar_drafts_accepted": self.grammar_drafts_accepted,
            "time_grammar_s": self.t_grammar,
            "finish_reason": self.finish,
        }

    def line(self) -> str:
        d = self.to_dict()
        total = self.t_decode or 1.0
        hist = " ".join(f"{k}:{v}" for k, v in d["tau_histogram"].items())
        grammar = (
            f" | grammar: {self.grammar_drafts_accepted}/{self.grammar_drafts} certain drafts"
            f" taken, {self.grammar_pruned} pruned, {100 * self.t_grammar / total:.1f}% of time"
            if self.t_grammar
            else ""
        )
        return (
            f"prompt {d['prompt_tokens']} tok @ {d['prompt_tps']:.1f} tok/s | "
            f"gen {d['generated_tokens']} tok @ {d['generation_tps']:.1f} tok/s | "
            f"tau {d['mean_tau']:.2f} [{hist}] | "
            f"draft {100 * self.t_draft / total:.0f}% verify {100 * self.t_verify / total:.0f}% "
            f"other {100 * self.t_other / total:.0f}%{grammar}"
        )
