"""Text verifiers from ProRL's task mix: an answer in `<answer>` tags compared with the gold
answer (Reasoning Gym's prompt format), and a multiple-choice letter (GPQA-style STEM questions).

Both look only at the text after the reasoning: after the last `</think>`, or all of it without
think tags; a response that opens `<think>` and never closes it (cut off by the length limit) has
no answer, as in the math verifier. Binary reward, no format reward.

Every step is a single pass or a bounded scan (no regex that can backtrack more than a few
characters per position), so a 1 MB response costs a few linear passes. A lone surrogate is just
a character here: it compares unequal to the gold answer, and the answer reported in info is made
encodable.

Deviations from Reasoning Gym's per-task verifiers: one normalized string comparison for every
task (no partial credit, no task-specific parsing); the gold may be a list, any of which counts.
"""

from __future__ import annotations

import re
from typing import Any

from asyncrl.reward.answers import Unanswered, answer_region, gold_answers, last_boxed

INFO_ANSWER_CHARS = 200
_TRAILING_PUNCT = ".,;:?"  # not "!": "5!" is a factorial, not an excited 5
_MATH_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"))
_TEXT_WRAPPERS = ("\\text{", "\\textbf{", "\\textrm{", "\\mathrm{")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CHOICE = re.compile(r"(?:(?:option|choice)\s?)?(?:\(([A-J])\)|\[([A-J])\]|([A-J])(?:[.):](?!\S)|$))",
                     re.IGNORECASE)
# "answer is (B)", "Answer: B", "the final answer is **C**"; a bare letter must be upper case
# ("the answer is a bit long" is no choice), one in parentheses may be either case. Possessive
# quantifiers give nothing back, so a long run of spaces after "answer" costs one pass.
_ANSWER_PHRASE = re.compile(r"(?i:answer)(?:\s++is)?+\s*+:?+[\s*$]*+"
                            r"(?:\(([A-Ja-j])\)|\[([A-Ja-j])\]|([A-J])(?![A-Za-z0-9]))")


def last_answer_tag(text: str) -> str | None:
    """Content of the last closed `<answer>...</answer>` (tags in lower case), or None."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>") : end]


def _closing_brace(text: str, open_at: int) -> int:
    """Index of the brace closing the one at open_at, or -1."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def unwrap(text: str) -> str:
    """Strip whitespace, trailing punctuation, one surrounding `$...$`/`$$...$$`/`\\(...\\)` and
    one `\\text{...}` (or textbf/textrm/mathrm) that wraps the whole answer; twice, so that
    `$\\text{Paris}$.` and `\\text{$5$}` come out bare."""
    for _ in range(2):
        text = text.strip().rstrip(_TRAILING_PUNCT).strip()
        for left, right in _MATH_WRAPPERS:
            if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
                text = text[len(left) : -len(right)].strip()
                break
        for left in _TEXT_WRAPPERS:
            if text.startswith(left) and _closing_brace(text, len(left) - 1) == len(text) - 1:
                text = text[len(left) : -1].strip()
                break
    return text


def normalize_answer(text: str) -> str:
    """The comparison key: unwrapped, inner whitespace collapsed, case-folded, and thousands
    separators dropped when the whole answer is one number ("1,000" -> "1000"; "1,2" and
    "1,000 apples" keep their commas)."""
    text = " ".join(unwrap(text).split()).casefold()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _golds(metadata: Any, bad: str) -> list[str]:
    if not isinstance(metadata, dict):
        raise Unanswered("bad_input")
    return gold_answers(metadata.get("answer"), bad)


def _printable(text: str) -> str:
    return text[:INFO_ANSWER_CHARS].encode("utf-8", "replace").decode("utf-8")


class AnswerTagReward:
    """1 if the last `<answer>` after the reasoning equals `metadata["answer"]` (a string, number
    or list of them), exactly (after stripping surrounding whitespace) or, with normalize, after
    `normalize_answer` on both sides.

    info: `outcome` (exact, normalized, wrong, no_answer_tag, no_ground_truth, bad_input) and
    `answer`, cut to INFO_ANSWER_CHARS. bad_input: a response that is not a string, metadata that
    is not a dict, or a gold of another type. An empty response is no_answer_tag.
    """

    def __init__(self, normalize: bool = True):
        self.normalize = normalize

    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        info: dict[str, Any] = {}
        try:
            golds = _golds(metadata, bad="bad_input")
            if not isinstance(response, str):
                raise Unanswered("bad_input")
            answer = last_answer_tag(answer_region(response, unfinished="no_answer_tag"))
            if answer is None:
                raise Unanswered("no_answer_tag")
            info["answer"] = _printable(answer.strip())
            reward, outcome = self._grade(answer, golds)
        except Unanswered as e:
            reward, outcome = 0.0, e.outcome
        info["outcome"] = outcome
        return reward, info

    def _grade(self, answer: str, golds: list[str]) -> tuple[float, str]:
        if answer.strip() in {g.strip() for g in golds}:
            return 1.0, "exact"
        if self.normalize and normalize_answer(answer) in {normalize_answer(g) for g in golds}:
            return 1.0, "normalized"
        return 0.0, "wrong"


def parse_choice(text: str) -> str | None:
    """The upper-case letter A-J that `text` names as a whole: "B", "(b)", "[B]", "B.", "B) text",
    "B: text", "Option B", `$\\text{B}$`; None otherwise ("Because", "B7", "K")."""
    match = _CHOICE.match(unwrap(text))
    if match is None:
        return None
    return next(g for g in match.groups() if g).upper()


def predicted_choice(region: str) -> str | None:
    """The letter chosen in the answer region: from the last `<answer>` tag if there is one, else
    from the last `\\boxed{}`, else from the last "answer is (X)" / "Answer: X" phrase. The first
    of these that is present decides: a tag that names no letter is no choice."""
    tagged = last_answer_tag(region)
    if tagged is not None:
        return parse_choice(tagged)
    try:
        return parse_choice(last_boxed(region))
    except Unanswered:
        pass  # no usable box: the phrase decides
    match = None
    for match in _ANSWER_PHRASE.finditer(region):
        pass
    if match is None:
        return None
    return next(g for g in match.groups() if g).upper()


class MultipleChoiceReward:
    """1 if the letter chosen after the reasoning is the gold letter `metadata["answer"]` (A-J in
    any case, optionally "(B)", "B." or "B) text").

    info: `outcome` (correct, wrong, no_choice, no_ground_truth, bad_gold, bad_input) and `choice`.
    bad_gold: a gold that names no letter A-J; bad_input: a response that is not a string or
    metadata that is not a dict.
    """

    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        info: dict[str, Any] = {}
        try:
            golds = _golds(metadata, bad="bad_gold")
            gold = parse_choice(golds[0]) if len(golds) == 1 else None
            if gold is None:
                raise Unanswered("bad_gold")
            if not isinstance(response, str):
                raise Unanswered("bad_input")
            choice = predicted_choice(answer_region(response, unfinished="no_choice"))
            if choice is None:
                raise Unanswered("no_choice")
            info["choice"] = choice
            reward, outcome = (1.0, "correct") if choice == gold else (0.0, "wrong")
        except Unanswered as e:
            reward, outcome = 0.0, e.outcome
        info["outcome"] = outcome
        return reward, info
