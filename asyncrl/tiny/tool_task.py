"""The built-in tool task: two-digit by two-digit multiplication with a calculator.

    prompt    "23*47="
    model     "<calc>23*47</calc>"          (the stop string "</calc>" ends the turn)
    calculator "<result>1081</result>"     (asyncrl/env/calculator.py, loss mask 0)
    model     "\\boxed{1081}"               (then end of sequence: the episode is done)

Why this task: the tiny character model cannot multiply two-digit numbers in its head (it would
have to learn 8,100 products), but using the tool is only copying: the operands from the prompt
into the call, the digits of the result into the box. So the tool is the only way to the reward,
a warm start stopped early uses it correctly only some of the time, and RL has something to raise.
The split is by problem, as the arithmetic task's (task.split_of), so held-out prompts are
problems never trained on. Nothing heavy is imported here.
"""

from __future__ import annotations

import random

from asyncrl.env.calculator import Calculator
from asyncrl.env.base import Turn
from asyncrl.tiny import task as tiny_task

DATA_SOURCE = "tiny_calc"
VERSION = 2
"""Part of the tool model's cache key: bump it when the problems, their order or the traces change."""
LOW, HIGH = 10, 100  # operands in [10, 100): two digits each
EVAL_FRACTION = 0.2


def all_problems(split: tiny_task.Split) -> list[tuple[int, int]]:
    """Every (a, b) of one split, in a fixed shuffled order: any prefix (eval.max_prompts) is a
    uniform draw, not the problems of a = 10 and 11, whose products have three digits."""
    problems = [(a, b) for a in range(LOW, HIGH) for b in range(LOW, HIGH)
                if tiny_task.split_of(a, "*", b, EVAL_FRACTION) == split]
    random.Random(f"{DATA_SOURCE}:{split}").shuffle(problems)
    return problems


def make_record(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}*{b}=", "answer": str(a * b), "data_source": DATA_SOURCE}


def make_problems(num: int, seed: int, split: tiny_task.Split = "train") -> list[dict[str, str]]:
    """`num` records drawn with replacement from one split, reproducible by seed."""
    pool = all_problems(split)
    rng = random.Random(f"{DATA_SOURCE}:{split}:{seed}")
    return [make_record(*rng.choice(pool)) for _ in range(num)]


def trace(a: int, b: int) -> list[tuple[str, str]]:
    """The tool-using answer as (origin, text) segments: what the warm start imitates, with loss
    on the "model" segments only (the calculator's answer is read, never written, by the model)."""
    call = f"<calc>{a}*{b}</calc>"
    result = Calculator({}).step(Turn(0, call, [], "stop")).observation
    return [("model", call), ("env", result), ("model", tiny_task.format_response(a * b))]


def encode_trace(a: int, b: int, tokenizer) -> tuple[list[int], list[int]]:
    """Prompt + trace + eos as ids, and the supervised labels (-100 on the prompt and the
    calculator's answer)."""
    ids = tokenizer.encode(make_record(a, b)["prompt"])
    labels = [-100] * len(ids)
    for origin, text in trace(a, b):
        part = tokenizer.encode(text)
        ids += part
        labels += part if origin == "model" else [-100] * len(part)
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
