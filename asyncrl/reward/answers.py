"""What every text verifier reads the same way: the answer region after the reasoning, the last
boxed answer, and the gold answers of a sample. Failures raise `Unanswered` with the outcome the
verifier reports."""

from __future__ import annotations

import re
from typing import Any

MAX_ANSWER_CHARS = 1000
BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_SPACES = re.compile(r"\s*")
_BARE_ANSWER = re.compile(r"[^\s$]+")


class Unanswered(Exception):
    """No usable answer in a response or gold field; carries the outcome to report."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


def answer_region(response: str, unfinished: str) -> str:
    """The text after the reasoning: after the last `</think>`, all of it without think tags;
    raises `Unanswered(unfinished)` when the reasoning was opened and never closed."""
    _, sep, tail = response.rpartition("</think>")
    if sep:
        return tail
    if "<think>" in response:
        raise Unanswered(unfinished)
    return response


def gold_answers(gold: Any, bad: str) -> list[str]:
    """The gold answer (or list of them) as non-blank strings, None skipped; raises
    `Unanswered(bad)` for one that is neither a string nor a number (a bool included), and
    `Unanswered("no_ground_truth")` when none is left."""
    golds = list(gold) if isinstance(gold, (list, tuple)) else [gold]
    out = []
    for g in golds:
        if g is None:
            continue
        if isinstance(g, bool) or not isinstance(g, (str, int, float)):
            raise Unanswered(bad)
        if str(g).strip():
            out.append(str(g))
    if not out:
        raise Unanswered("no_ground_truth")
    return out


def last_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str:
    """Content of the last `\\boxed{...}`/`\\fbox{...}` (braces matched) or `\\boxed 5`, stripped;
    raises `Unanswered` when there is none (no_boxed), it never closes or is empty (parse_error)
    or it is longer than max_chars (bad_input). Scans at most max_chars past the box."""
    match = None
    for match in BOX.finditer(text):
        pass
    if match is None:
        raise Unanswered("no_boxed")
    i = _SPACES.match(text, match.end()).end()
    if i == len(text):
        raise Unanswered("parse_error")
    if text[i] != "{":
        bare = _BARE_ANSWER.match(text, i, i + max_chars + 1)
        if bare is None:
            raise Unanswered("parse_error")
        content = bare.group().rstrip(".,")
    else:
        depth, end, stop = 0, None, min(len(text), i + max_chars + 2)
        for j in range(i, stop):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    end = j
                    break
        if end is None:
            raise Unanswered("bad_input" if stop - i > max_chars + 1 else "parse_error")
        content = text[i + 1 : end]
    if len(content) > max_chars:
        raise Unanswered("bad_input")
    content = content.strip()
    if not content:
        raise Unanswered("parse_error")
    return content
