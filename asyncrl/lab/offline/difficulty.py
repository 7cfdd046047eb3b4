"""The offline difficulty filter's rule: a prompt's pass rate under the initial policy, and which
prompts to keep (difficulty_filter.py samples and scores; this decides).

A group whose n samples are all correct or all wrong has zero advantage under GRPO and teaches
nothing, so such prompts only cost generation. Skywork-OR1 (section 6.2, model-aware difficulty
estimation) samples each problem 16 times (8 for code) at temperature 1 with the model about to
be trained and drops those solved 0/N or N/N times; Ring-lite (section 2.3, data curation) drops
problems its distilled model always solves and those no model solves. Both are the default here:
keep a prompt when min_rate < pass rate < max_rate with (0, 1). Raising min_rate or lowering
max_rate drops the nearly-never / nearly-always solved too (a choice neither paper made).

Pass rate: the fraction of a prompt's samples whose reward is at least `threshold` (1: correct),
the same rule as pass@k (algo/pass_at_k.py), so partial credit does not count as solved.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DifficultyRule:
    min_rate: float = 0.0
    """Drop a prompt whose pass rate is at or below this (too hard)."""
    max_rate: float = 1.0
    """Drop a prompt whose pass rate is at or above this (too easy)."""
    threshold: float = 1.0
    """A sample counts as solved when its reward is at least this."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_rate < self.max_rate <= 1.0:
            raise ValueError(f"need 0 <= min_rate < max_rate <= 1, got min_rate={self.min_rate}, "
                             f"max_rate={self.max_rate}")

    def verdict(self, rate: float) -> str:
        """`kept`, `too_hard` or `too_easy`."""
        if rate <= self.min_rate:
            return "too_hard"
        if rate >= self.max_rate:
            return "too_easy"
        return "kept"


def pass_rate(rewards: list[float], threshold: float = 1.0) -> float:
    """The fraction of `rewards` at or above `threshold`."""
    if not rewards:
        raise ValueError("a pass rate needs at least one scored sample")
    return sum(r >= threshold for r in rewards) / len(rewards)


@dataclass
class FilterResult:
    rates: dict[int, float]
    """Record index -> pass rate, for every record that was sampled."""
    verdicts: dict[int, str]
    """Record index -> kept / too_hard / too_easy / too_long (not sampled: the prompt leaves no
    room in the context for max_tokens, so a run could not train on it either)."""

    def kept(self) -> list[int]:
        return sorted(i for i, v in self.verdicts.items() if v == "kept")

    def counts(self) -> dict[str, int]:
        out = {"kept": 0, "too_hard": 0, "too_easy": 0, "too_long": 0}
        for v in self.verdicts.values():
            out[v] += 1
        return out


def apply_rule(num_records: int, rewards_by_record: dict[int, list[float]], rule: DifficultyRule) -> FilterResult:
    """Pass rates and verdicts of records 0..num_records-1; a record without rewards is too_long."""
    rates = {i: pass_rate(r, rule.threshold) for i, r in rewards_by_record.items()}
    verdicts = {i: rule.verdict(rates[i]) if i in rates else "too_long" for i in range(num_records)}
    return FilterResult(rates, verdicts)
