"""The environment edge: what a multi-turn episode asks of the world outside the model.

An episode runs inside a rollout actor (rollout/episode.py), one per sample:

    prompt ─► model turn ─► env.step(turn) ─► Step(observation, reward, done) ─► model turn ─► ...

A model turn is what the engine samples until one of the environment's stop strings (kept in
the turn, e.g. "</calc>"), the end-of-sequence token or the turn's token limit. The observation
is appended after it, and the model's next turn continues the same token sequence. The episode
ends when a step says `done`, at `env.max_turns`, or when the response reaches its token limit.

Token in, token out: the sample keeps the exact ids the engine sampled and the exact ids of each
observation (an observation given as text is tokenized once, by the actor; a model turn is never
re-tokenized), so the learner scores exactly the sequence the engine saw. The loss mask is 1 on
model tokens and 0 on observation tokens (types.Sample.loss_mask).

An environment is built once per episode by a factory, `factory(metadata, **env.options)`, where
`metadata` is the prompt record's (the answer, a secret number, ...). Its `step` may be a plain
function (the actor runs it in a worker thread) or a coroutine function (awaited on the actor's
loop); either way it is given `env.step_timeout_s`, and one that raises or times out ends its own
episode only (rollout/episode.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Turn:
    """One model turn as the environment sees it."""

    index: int
    """0 for the model's first turn."""
    text: str
    """The turn's tokens, decoded without special tokens (an end-of-sequence token is not in it;
    the stop string is)."""
    token_ids: list[int]
    finish_reason: str
    """"stop" (a stop string or the end-of-sequence token) or "length" (the turn's token limit)."""


@dataclass
class Step:
    """The environment's answer to one model turn."""

    observation: str | list[int] = ""
    """Appended to the context after the turn: text (the actor tokenizes it) or token ids (kept
    as they are). Ignored when `done`."""
    reward: float | None = None
    """Added to the episode's reward (the `episode` verifier reads the sum); None: no reward."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Counted into the episode's metrics: `tool_calls` and `tool_errors` (ints) are summed."""


class Environment(Protocol):
    stop: Sequence[str]
    """Stop strings that end a model turn (they stay in the turn's text); empty: only the
    end-of-sequence token or the token limit ends a turn."""

    def step(self, turn: Turn) -> Step | Awaitable[Step]:
        """React to one model turn."""
        ...


EnvFactory = Callable[..., Environment]
"""`factory(metadata, **options) -> Environment`: one environment per episode."""
