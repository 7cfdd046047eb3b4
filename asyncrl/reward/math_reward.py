"""Binary math reward with math-verify, after Skywork-OR1 section 7.1.

The paper's recipe: take the answer that follows the reasoning, parse it with math-verify, reward 1
if its string form equals the gold answer, else fall back to math-verify's `verify` with the gold
answer wrapped in `\\boxed{}` (parsing a bare gold answer can change it); 0 otherwise. No format
reward. "The answer" here is the last box after the reasoning, found by matching braces:

- The reasoning ends at the last `</think>`; a response that opens `<think>` and never closes it
  (cut off by the length limit) has no answer. Without think tags the whole response counts.
- A box is `\\boxed{...}`, `\\fbox{...}` (math-verify's own box extraction accepts both) or
  `\\boxed 5` without braces, whose answer is the next run of non-space characters up to a `$`,
  trailing `.`/`,` dropped: TeX would box one token only, but `\\boxed 15` means 15.
- Only the last box counts, even when a model boxes the parts of one answer separately
  (math-verify's own `boxed="all"` would join them).
- A box that never closes (cut-off or malformed output) scores 0, where math-verify would take the
  rest of the text; content over MAX_ANSWER_CHARS is not an answer (bad_input). The response
  itself never reaches math-verify, so a 1 MB response costs one regex pass.

Deviations from Skywork-OR1's released code, which parses the whole text after `</think>` with
math-verify's default extraction: an answer must be boxed (no credit for "the answer is 5");
math-verify sees only the box and extracts LaTeX only (its plain-expression fallback could pick a
stray number out of malformed LaTeX); the string comparison ignores whitespace. Gold answers are
normalized: `$...$`, `\\(...\\)` and `\\[...\\]` unwrapped, a boxed gold replaced by its content;
a list of gold answers means any of them. Answers nested too deep are refused before parsing, and
two classes of right answers math-verify rejects get a second chance (math_checks.py): a number
with words or units in \\text{} against a bare-number gold, and expressions of special constants
(or degrees) equal to the gold in value.

math-verify's timeouts arm SIGALRM per operation and raise outside the main thread, so they are
off; one deadline (timeout_s) covers the whole call instead, armed only in a main thread whose
timer is free. Elsewhere the reward pool's hard per-call kill is the only limit, as it is for work
that never returns to the interpreter.

info: `outcome` (string_match, verified, wrong, no_boxed, no_ground_truth, parse_error, bad_input,
verify_timeout) and `answer`, the extracted answer cut to INFO_ANSWER_CHARS.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from math_verify import LatexExtractionConfig, parse, verify

from asyncrl.reward.answers import BOX as _BOX
from asyncrl.reward.answers import Unanswered, answer_region, gold_answers, last_boxed
from asyncrl.reward.math_checks import (bare_number, equal_as_constants, number_in_words, too_deep,
                                        with_degrees_as_radians)

INFO_ANSWER_CHARS = 200
DEFAULT_TIMEOUT_S = 10.0

_MATH_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_EXTRACTION = [LatexExtractionConfig()]
T = TypeVar("T")


def _not_timeout_disabled(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


# math-verify warns once per process that its timeouts are off; run_with_deadline replaces them
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_not_timeout_disabled)


class _Deadline(BaseException):
    """Raised by the alarm; a BaseException so math-verify's `except Exception` lets it through."""


def normalize_gold(gold: Any) -> list[str]:
    """Gold answers as bare LaTeX: math delimiters unwrapped, a boxed gold replaced by its
    content; raises `Unanswered` when there is none (no_ground_truth) or one is unusable."""
    out = []
    for g in gold_answers(gold, bad="bad_input"):
        text = _unwrap_math(g)
        if _BOX.search(text):
            try:
                text = _unwrap_math(last_boxed(text, max_chars=len(text)))
            except Unanswered:
                raise Unanswered("bad_input") from None
        if text:
            out.append(text)
    if not out:
        raise Unanswered("no_ground_truth")
    return out


def _unwrap_math(text: str) -> str:
    text = text.strip()
    for left, right in _MATH_WRAPPERS:
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            return text[len(left) : -len(right)].strip()
    return text


def _parse_boxed(latex: str) -> list:
    """math-verify's [sympy object, normalized string], [string] if sympy failed, or []."""
    return parse(f"\\boxed{{{latex}}}", extraction_config=_EXTRACTION, parsing_timeout=None)


def _squash(text: str) -> str:
    return "".join(text.split())


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def run_with_deadline(fn: Callable[[], T], seconds: float | None) -> T:
    """fn(), interrupted by `_Deadline` after `seconds` when called in a main thread whose
    real-time timer is free; otherwise (a thread, an alarm set by someone else) plain fn()."""
    if (not seconds or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        return fn()
    armed = True

    def on_alarm(signum, frame):
        if armed:  # an alarm delivered just after fn returned is ignored
            raise _Deadline

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)  # one shot: it fires at most once
        try:
            return fn()
        finally:
            armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)


class MathReward:
    """The Skywork-OR1 math verifier; `metadata["answer"]` holds the gold answer (or a list)."""

    def __init__(self, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s

    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        info: dict[str, Any] = {}
        try:
            if not isinstance(metadata, dict):
                raise Unanswered("bad_input")
            golds = normalize_gold(metadata.get("answer"))
            if not isinstance(response, str) or not response.strip():
                raise Unanswered("bad_input")
            answer = last_boxed(answer_region(response, unfinished="no_boxed"))
            info["answer"] = answer[:INFO_ANSWER_CHARS]
            if _has_surrogate(answer) or any(_has_surrogate(g) for g in golds):
                info["answer"] = info["answer"].encode("utf-8", "replace").decode("utf-8")
                raise Unanswered("bad_input")
            if too_deep(answer) or any(too_deep(g) for g in golds):
                raise Unanswered("bad_input")  # before parsing: see math_checks
            reward, outcome = run_with_deadline(lambda: self._grade(answer, golds), self.timeout_s)
        except Unanswered as e:
            reward, outcome = 0.0, e.outcome
        except _Deadline:
            reward, outcome = 0.0, "verify_timeout"
        except Exception as e:  # a math-verify/sympy bug on odd LaTeX costs the sample, not the run
            # the type only: formatting a sympy object from a failed comparison can itself hang
            reward, outcome = 0.0, "parse_error"
            info["error"] = type(e).__name__
        info["outcome"] = outcome
        return reward, info

    def _grade(self, answer: str, golds: list[str]) -> tuple[float, str]:
        gold_keys = {_squash(g) for g in golds}
        if _squash(answer) in gold_keys:
            return 1.0, "string_match"
        pred = _parse_boxed(answer)
        if pred and isinstance(pred[-1], str) and _squash(pred[-1]) in gold_keys:
            return 1.0, "string_match"
        understood = len(pred) == 2
        targets = []
        for gold in golds:
            target = _parse_boxed(gold)
            if pred and target and verify(target, pred, timeout_seconds=None):
                return 1.0, "verified"
            understood = understood and len(target) == 2
            targets.append(target)
        if _second_chance(answer, pred, golds, targets):
            return 1.0, "verified"
        return 0.0, ("wrong" if understood else "parse_error")


def _second_chance(answer: str, pred: list, golds: list[str], targets: list[list]) -> bool:
    """The two classes of right answers math-verify rejects (math_checks): a number in words
    against a bare-number gold, and special constants (or degrees) equal in value."""
    value = number_in_words(answer)
    if value is not None and value in {bare_number(g) for g in golds}:
        return True
    candidates = [pred]
    degrees = with_degrees_as_radians(answer)
    if degrees is not None:
        candidates.append(_parse_boxed(degrees))
    return any(len(c) == 2 and len(t) == 2 and equal_as_constants(c[0], t[0]) for c in candidates for t in targets)
