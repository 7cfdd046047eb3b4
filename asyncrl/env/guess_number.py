"""Guess the number: a multi-turn task where the environment, not a verifier, gives the reward.

    model: I'll start in the middle. <guess>50</guess>
    env:   <feedback>higher</feedback>             (the secret is higher than 50)
    model: <guess>75</guess>
    env:   <feedback>lower</feedback>              (the secret is lower than 75)
    model: <guess>62</guess>                       (correct: reward 1.0, done)

The secret is the prompt record's answer (`metadata["answer"]`, an int or a numeric string), a
whole number in [low, high]. A guess is the body of the `<guess>...</guess>` that ends the turn,
a whole number; one that is not, or lies outside [low, high], is answered
`<feedback>error: ...</feedback>`, counts as a tool error and uses up a guess. A turn without a
guess ends the episode with reward 0.0, as does the last of `max_guesses` wrong guesses. The
summed reward is read by the `episode` verifier: 1.0 when the number was found, else 0.0. It
rewards finding the number within the budget, not finding it fast; a binary search needs
ceil(log2(high - low + 1)) guesses at most (7 for 1..100).

make_records builds the prompts for a run's data (records as data/records.py reads them).
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from asyncrl.env.base import Step, Turn
from asyncrl.env.tool_calls import ending_call

DATA_SOURCE = "guess_number"
_WHOLE_NUMBER = re.compile(r"[+-]?\d{1,18}")  # no int() on a thousand-digit string


class GuessNumber:
    """The `guess_number` environment: `GuessNumber(metadata, low=1, high=100, max_guesses=7)`."""

    stop = ("</guess>",)

    def __init__(self, metadata: dict[str, Any], low: int = 1, high: int = 100, max_guesses: int = 7):
        if low > high or max_guesses < 1:
            raise ValueError(f"need low <= high and max_guesses >= 1, got {low}, {high}, {max_guesses}")
        self.secret = _whole(metadata.get("answer"))
        if not low <= self.secret <= high:  # records made for another range than the options say
            raise ValueError(f"guess_number: the answer {self.secret} is outside [{low}, {high}]")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.guesses = 0

    def step(self, turn: Turn) -> Step:
        body = ending_call(turn.text, "guess")
        if body is None:
            return Step(reward=0.0, done=True)
        self.guesses += 1
        out_of_guesses = self.guesses >= self.max_guesses
        if not _WHOLE_NUMBER.fullmatch(body.strip()):
            return _feedback("error: not a whole number", out_of_guesses, error=True)
        guess = int(body.strip())
        if not self.low <= guess <= self.high:
            return _feedback(f"error: out of range {self.low}..{self.high}", out_of_guesses, error=True)
        if guess == self.secret:
            return Step(observation="", reward=1.0, done=True, info={"tool_calls": 1, "tool_errors": 0})
        return _feedback("higher" if self.secret > guess else "lower", out_of_guesses)


def _whole(answer: Any) -> int:
    """The secret from the record: an int, or a string like "42" or "42.0"."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer
    if isinstance(answer, str):
        try:
            value = float(answer)
        except ValueError:
            value = math.nan
        if value.is_integer():
            return int(value)
    raise ValueError(f"guess_number: the answer must be a whole number, got {answer!r:.40}")


def _feedback(text: str, done: bool, error: bool = False) -> Step:
    return Step(observation=f"<feedback>{text}</feedback>", reward=0.0 if done else None, done=done,
                info={"tool_calls": 1, "tool_errors": int(error)})


def make_prompt(low: int, high: int, max_guesses: int) -> str:
    return (f"I am thinking of a whole number from {low} to {high}. Find it in at most {max_guesses} "
            "guesses. Write one guess per turn as <guess>N</guess>. I will answer "
            "<feedback>higher</feedback> if my number is higher than N, <feedback>lower</feedback> "
            "if it is lower, and nothing more once you have found it.")


def make_records(n: int, seed: int, low: int = 1, high: int = 100, max_guesses: int = 7) -> list[dict[str, Any]]:
    """`n` prompt records with secrets drawn uniformly from [low, high], the same for the same
    arguments. max_guesses only goes into the prompt's text: give the environment the same."""
    rng = random.Random(f"{DATA_SOURCE}:{seed}:{low}:{high}")  # a str seed is hashed stably
    prompt = make_prompt(low, high, max_guesses)
    return [{"prompt": prompt, "answer": str(rng.randint(low, high)), "data_source": DATA_SOURCE}
            for _ in range(n)]
