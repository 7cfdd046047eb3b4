"""Reading jsonl records, checked one by one, into the form the prompt source consumes.

A record needs a prompt (the `data.prompt_field`, default `prompt`, or a `messages` chat list) and
what its verifier reads: the reference answer (`data.answer_field`, default `answer`, or
`ground_truth`) for math_verify, answer_tag and multiple_choice, a `tests` list for code, and the
answer for a user function (`import:`) seen reading `metadata["answer"]` when preflight calls it
once (reward/registry.py `reads_answer`). Which verifier a record gets depends on its `data_source`
(or `domain`), as in reward/registry.py.

Every problem is reported as `file:line: what is missing`, with the closest field the record does
have, so `{"prompt": ..., "solution": ...}` says: no 'answer' field; did you mean 'solution'? set
data.answer_field=solution.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError

# Names other datasets use for the same thing, tried before a spelling match.
PROMPT_NAMES = ("question", "problem", "query", "input", "instruction", "prompt_text", "text")
ANSWER_NAMES = ("solution", "ground_truth", "gold", "target", "label", "final_answer", "reference",
                "expected_answer", "output", "response")
NEEDS_ANSWER = ("math_verify", "answer_tag", "multiple_choice")

# Files up to this size are checked whole before Ray starts; of a larger one, the first records
# (the rest is checked when the run reads it, still before the first prompt is generated).
FULL_CHECK_BYTES = 64 << 20
SAMPLE_RECORDS = 10_000


class RecordError(ConfigError):
    """A record that cannot be used; the message names file, line and field."""


def data_source_of(rec: dict[str, Any]) -> str:
    return str(rec.get("data_source", rec.get("domain", "unknown")))


def closest_field(rec: dict[str, Any], wanted: str, known: tuple[str, ...]) -> str | None:
    present = [k for k in rec if isinstance(k, str)]
    for name in known:
        if name in present:
            return name
    close = difflib.get_close_matches(wanted, present, n=1, cutoff=0.6)
    return close[0] if close else None


def _missing(where: str, rec: dict[str, Any], field: str, known: tuple[str, ...], setting: str,
             why: str) -> RecordError:
    guess = closest_field(rec, field, known)
    hint = (f"; did you mean {guess!r}? set {setting}={guess}" if guess
            else f"; the record has {', '.join(map(repr, rec)) or 'no fields'}")
    return RecordError(f"{where}: no {field!r} field{why}{hint}")


def normalize(rec: Any, where: str, prompt_field: str = "prompt", answer_field: str = "answer",
              verifier_of: Callable[[str], str | None] | None = None,
              needs_answer: Collection[str] = NEEDS_ANSWER) -> dict[str, Any]:
    """The record with its prompt under `prompt` and its answer under `answer`, or RecordError.
    `verifier_of(data_source)` names the verifier that will score it (None: no answer check);
    the verifiers in `needs_answer` need the answer (user functions seen reading it, among them)."""
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    out = dict(rec)
    if "messages" not in rec:
        if prompt_field not in rec:
            raise _missing(where, rec, prompt_field, PROMPT_NAMES, "data.prompt_field", " (and no 'messages')")
        prompt = rec[prompt_field]
        if not isinstance(prompt, str) or not prompt:
            raise RecordError(f"{where}: {prompt_field!r} must be a non-empty string, got {prompt!r:.80}")
        out["prompt"] = prompt
    elif not isinstance(rec["messages"], list) or not rec["messages"]:
        raise RecordError(f"{where}: 'messages' must be a non-empty list of chat messages")
    answer = rec.get(answer_field)
    if answer is None and answer_field == "answer":
        answer = rec.get("ground_truth")
    out["answer"] = answer
    verifier = verifier_of(data_source_of(rec)) if verifier_of else None
    if verifier in needs_answer and answer is None:
        who = (f"the reward function {verifier.partition(':')[2]} reads as metadata['answer']"
               if verifier.startswith("import:") else f"the {verifier} verifier of data source "
               f"{data_source_of(rec)!r} needs")
        raise _missing(where, rec, answer_field, ANSWER_NAMES, "data.answer_field", f", which {who}")
    if verifier == "code" and not rec.get("tests"):
        raise RecordError(f"{where}: no 'tests' field (a non-empty list), which the code verifier of "
                          f"data source {data_source_of(rec)!r} needs")
    return out


def iter_jsonl(path: str | Path, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line; a line that is not JSON is a RecordError."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None:
                if limit == 0:
                    return
                limit -= 1
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{lineno}: not valid JSON ({e})") from None


def read_records(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 verifier_of: Callable[[str], str | None] | None = None,
                 limit: int | None = None, needs_answer: Collection[str] = NEEDS_ANSWER) -> list[dict[str, Any]]:
    """Every record of a jsonl file (or the first `limit`), normalized and checked."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"data file {path.absolute()} does not exist")
    records = [normalize(rec, f"{path}:{lineno}", prompt_field, answer_field, verifier_of, needs_answer)
               for lineno, rec in iter_jsonl(path, limit)]
    if not records:
        raise RecordError(f"{path}: no records (an empty file)")
    return records


def check_file(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
               verifier_of: Callable[[str], str | None] | None = None,
               needs_answer: Collection[str] = NEEDS_ANSWER) -> int:
    """Check a data file before anything starts: all of it up to FULL_CHECK_BYTES, else its first
    SAMPLE_RECORDS records. Returns how many records were checked."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"data file {path.absolute()} does not exist")
    limit = None if path.stat().st_size <= FULL_CHECK_BYTES else SAMPLE_RECORDS
    return len(read_records(path, prompt_field, answer_field, verifier_of, limit, needs_answer))
