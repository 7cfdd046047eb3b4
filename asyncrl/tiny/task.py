"""The built-in synthetic task: small-operand addition with a `\\boxed{}` answer.

Why addition of single digits: a sub-million-parameter character model learns part of it in
tens of seconds on 2 CPU cores, so a warm start stopped early samples correct answers some of the
time at temperature 1 (groups of samples have mixed rewards), and the 79 train problems are few
enough that RL's 300 demo steps visit each about 20 times: measured here, RL then raised the
reward of a start stopped at 0.3 sampled accuracy by +0.29 in 300 steps. With operands up to 20
(363 train problems, each visited ~5 times) the same start and algorithm gained only +0.06 to
+0.13, and harder tasks (chained operations, operands up to 50) barely move under supervised
training in the same time (~1% accuracy after 600 steps).

Prompts look like ``"7+5="`` and the target completion is ``"\\boxed{12}"``: the final answer in
``\\boxed{}`` is what the math verifier checks. No reasoning prefix: at this size it only adds
tokens to learn.

The train / eval split is by problem, not by sample: a deterministic hash of ``(a, op, b)`` puts
each problem on one side, so held-out accuracy measures generalisation, never memorisation. This
module imports nothing heavy so the data pipeline and tests can use it freely.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from typing import Literal

DATA_SOURCE = "tiny_arith"

Split = Literal["train", "eval"]


@dataclasses.dataclass(frozen=True)
class TinyTaskSpec:
    """Difficulty knobs of the tiny task; part of the tiny model's cache key."""

    max_operand: int = 10
    """Operands are drawn uniformly from [0, max_operand)."""
    ops: str = "+"
    """Operators to draw from: any of "+", "-", "*". Subtraction keeps a >= b (no negatives)."""
    eval_fraction: float = 0.2
    """Fraction of distinct problems held out for evaluation (never trained on): 0.2 of the 100
    problems leaves 21 held out, enough for avg@8 over 168 samples."""


def solve(a: int, op: str, b: int) -> int:
    """The ground-truth result, computed directly."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unsupported operator {op!r}; allowed: '+', '-', '*'")


def format_prompt(a: int, op: str, b: int) -> str:
    """The prompt text, e.g. ``"7+5="``. Kept minimal: every prompt token costs step time."""
    return f"{a}{op}{b}="


def format_response(answer: str | int) -> str:
    """The target completion: just the boxed answer (the eos token is added by the tokenizer)."""
    return f"\\boxed{{{answer}}}"


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, or None if there is none."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def is_correct(response: str, answer: str) -> bool:
    """Exact-match check used by the warm start's accuracy measurement.

    The RL reward uses math-verify; for the integer answers of this task the two agree.
    """
    return extract_boxed(response) == answer


def split_of(a: int, op: str, b: int, eval_fraction: float) -> Split:
    """Which side of the split a problem is on: a stable hash, independent of any seed."""
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if bucket < eval_fraction else "train"


def all_problems(spec: TinyTaskSpec, split: Split) -> list[tuple[int, str, int]]:
    """Every distinct ``(a, op, b)`` of one split, in a fixed order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    problems = []
    for op in spec.ops:
        for a in range(spec.max_operand):
            for b in range(spec.max_operand):
                if op == "-" and a < b:
                    continue
                if split_of(a, op, b, spec.eval_fraction) == split:
                    problems.append((a, op, b))
    if not problems:
        raise ValueError(f"the {split} split of {spec} is empty; change max_operand or eval_fraction")
    return problems


def make_record(a: int, op: str, b: int) -> dict[str, str]:
    """One plain record as the prompt source consumes it."""
    return {"prompt": format_prompt(a, op, b), "answer": str(solve(a, op, b)), "data_source": DATA_SOURCE}


def make_problems(num: int, seed: int, split: Split = "train", spec: TinyTaskSpec | None = None) -> list[dict[str, str]]:
    """``num`` records drawn uniformly (with replacement) from one split, reproducible by seed.

    The split name is mixed into the seed so that train and eval draws are independent streams
    even for the same seed.
    """
    spec = spec or TinyTaskSpec()
    pool = all_problems(spec, split)
    rng = random.Random(f"{DATA_SOURCE}:{split}:{seed}")
    return [make_record(*rng.choice(pool)) for _ in range(num)]


def task_alphabet(spec: TinyTaskSpec | None = None) -> str:
    """Every character a prompt or response of this task can contain (sorted, unique)."""
    spec = spec or TinyTaskSpec()
    chars = set("0123456789=") | set(spec.ops) | set(format_response(0))
    return "".join(sorted(chars))
