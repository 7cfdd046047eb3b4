"""Reward errors made loud: a verifier that raises (or returns something that is not a reward)
costs its sample reward 0, which on its own looks like a policy that is wrong, so a user's bug
could run for hours unseen.

`RewardErrorMonitor.observe` is called with every scored sample. The first error of each kind
(verifier and exception type) comes back as a report, the traceback and the input that caused
it, for the console and events.jsonl; further errors of that kind are reported at most once a
minute with their count. It raises `RewardErrorsExceeded`, naming the function and an input that
made it fail, once the errors show with confidence that more than `max_error_frac` of the samples
err: at least `min_errors` errors, and the lower end of the error rate's Wilson score interval
(`error_rate_floor`, CONFIDENCE_Z standard deviations, one-sided) above the limit. A fraction
alone, judged early, stopped a run whose tool failed on 2% of calls at 4 errors in 50 (8% then);
with the bound, a 2% rate goes on for good against a 5% limit, and a rate far above the limit still
stops early: an environment that always fails stops at its 10th episode. Pure bookkeeping: no Ray,
no I/O.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncrl.types import RunFailed

ERROR_OUTCOMES = ("verifier_error", "bad_reward")
ENV_OUTCOMES = ("env_error",)
SHOWN_CHARS = 300
MESSAGES_KEPT = 100  # distinct messages counted per kind of error (more: "100+")
CONFIDENCE_Z = 3.0  # one-sided: a rate this far above the limit is chance once in ~700 checks
MIN_ERRORS = 10


def error_rate_floor(errors: int, n: int, z: float = CONFIDENCE_Z) -> float:
    """The lower end of the Wilson score interval of a rate of `errors` in `n` (0 for n = 0)."""
    if n == 0:
        return 0.0
    p, zz = errors / n, z * z
    centre = p + zz / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + zz / (4 * n * n))
    return max(0.0, (centre - margin) / (1 + zz / n))  # 0 errors: 0, not a rounding below it


class RewardErrorsExceeded(RunFailed):
    """More of the samples made the verifier fail than reward.max_error_frac allows."""


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


class RewardErrorMonitor:
    """`outcomes`: what counts as an error; `limit`: the config field of max_frac, named when the
    run stops (the environment's errors have a monitor of their own, `env_error_monitor`)."""

    def __init__(self, max_frac: float, min_errors: int = MIN_ERRORS, repeat_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, outcomes: tuple[str, ...] = ERROR_OUTCOMES,
                 limit: str = "reward.max_error_frac", subject: str = "the reward function"):
        self.max_frac, self.min_errors, self.repeat_every_s = max_frac, min_errors, repeat_every_s
        self.clock, self.outcomes, self.limit, self.subject = clock, outcomes, limit, subject
        self.scored = 0
        self.errors: Counter = Counter()  # (verifier, error type) -> count
        self.examples: dict[tuple[str, str], dict[str, Any]] = {}  # the first report of each kind
        self._reported: dict[tuple[str, str], tuple[float, int]] = {}  # kind -> (time, count then)
        # per kind, its messages (up to MESSAGES_KEPT) and the latest: errors of one type may say
        # different things (another key, another input), and a repeat should not read as the first
        self._messages: dict[tuple[str, str], set[str]] = {}
        self._latest: dict[tuple[str, str], str] = {}

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def observe(self, info: dict[str, Any], response: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
        """Count one scored sample; returns a report when this error should be shown now."""
        self.scored += 1
        report = None
        if info.get("outcome") in self.outcomes:
            error = str(info.get("error", info["outcome"]))
            kind = (str(info.get("verifier")), error.split("(", 1)[0].split(":", 1)[0])
            self.errors[kind] += 1
            seen = self._messages.setdefault(kind, set())
            if len(seen) < MESSAGES_KEPT:
                seen.add(error)
            self._latest[kind] = error
            if kind not in self.examples:
                self.examples[kind] = {
                    "verifier": kind[0], "outcome": info["outcome"], "error": error,
                    "traceback": info.get("traceback"), "data_source": info.get("data_source"),
                    "response": _short(response),
                    "metadata": _short({k: v for k, v in metadata.items() if k != "record_key"})}
            report = self._maybe_report(kind)
        self._check()
        return report

    def _maybe_report(self, kind: tuple[str, str]) -> dict[str, Any] | None:
        now, count = self.clock(), self.errors[kind]
        last = self._reported.get(kind)
        if last is not None and now - last[0] < self.repeat_every_s:
            return None
        self._reported[kind] = (now, count)
        report = dict(self.examples[kind], count=count, scored=self.scored)
        if last is not None:  # a repeat: the count and the latest message; the traceback was shown once
            report.pop("traceback", None)
            report.update(error=self._latest[kind], messages=len(self._messages[kind]))
        return report

    def _check(self) -> None:
        if self.num_errors < self.min_errors or error_rate_floor(self.num_errors, self.scored) <= self.max_frac:
            return
        kind, count = self.errors.most_common(1)[0]
        ex = self.examples[kind]
        raise RewardErrorsExceeded(
            f"{self.subject} {kind[0]} failed on {self.num_errors} of {self.scored} scored samples "
            f"({self.num_errors / self.scored:.0%}; at least {error_rate_floor(self.num_errors, self.scored):.1%} "
            f"with {CONFIDENCE_Z:g}-sigma confidence, above {self.limit}={self.max_frac}); "
            f"most often ({count}x): {ex['error']}, e.g. on response {ex['response']!r} with metadata "
            f"{ex['metadata']}. The first traceback is in events.jsonl (event {self.event}).")

    @property
    def event(self) -> str:
        return "env_error" if self.outcomes == ENV_OUTCOMES else "reward_error"

    def metrics(self) -> dict[str, float]:
        return {f"{'env' if self.outcomes == ENV_OUTCOMES else 'reward'}/errors_total": self.num_errors}


def env_error_monitor(max_frac: float) -> RewardErrorMonitor:
    """Episodes that ended with an environment error (rollout/episode.py), against env.max_error_frac."""
    return RewardErrorMonitor(max_frac, outcomes=ENV_OUTCOMES, limit="env.max_error_frac",
                              subject="the environment")


def format_report(r: dict[str, Any]) -> str:
    """The console text of a report: one line, plus the traceback the first time."""
    n = r.get("messages", 1)
    latest = f"{n}{'+' if n >= MESSAGES_KEPT else ''} different messages, the latest: " if n > 1 else ""
    head = (f"{'environment' if r['outcome'] in ENV_OUTCOMES else 'reward'} error in {r['verifier']} "
            f"(data source {r['data_source']!r}, {r['count']} of {r['scored']} samples so far): {latest}{r['error']}")
    if not r.get("traceback"):
        return head
    return f"{head}\n  on response {r['response']!r}, metadata {r['metadata']}\n{r['traceback'].rstrip()}"
