"""What the built-in tools share: finding the call that ends a model turn, and the call limit
(the rule is explained in calculator.py's docstring)."""

from __future__ import annotations

from asyncrl.env.base import Step, Turn


def ending_call(text: str, tag: str) -> str | None:
    """The body of the `<tag>...</tag>` call that ends the turn (trailing whitespace aside): what
    lies between the last `<tag>` and the closing tag; "" when there is no opening tag. None: the
    turn does not end with a call (a final answer, or a turn cut off by its token limit)."""
    close = f"</{tag}>"
    head = text.rstrip()
    if not head.endswith(close):
        return None
    _, opened, body = head[: -len(close)].rpartition(f"<{tag}>")
    return body if opened else ""


def refuse_past_limit(calls: int, max_calls: int, tag: str) -> Step | None:
    """The answer to call number `calls` (counted from 1) when it is past `max_calls`: the first
    one is refused and the episode goes on, the next ends it (module docstring). None: within."""
    if calls <= max_calls:
        return None
    return Step(observation=f"<{tag}>error: too many calls</{tag}>", done=calls > max_calls + 1,
                info={"tool_calls": 1, "tool_errors": 1})


class ToolEnvironment:
    """A tool answered once per call: the call that ends a turn (`<call_tag>...</call_tag>`) is
    answered `<answer_tag>...</answer_tag>` by `answer(body)`; a turn without one ends the
    episode; `max_calls` bounds the calls (refuse_past_limit). Subclasses set the tags and
    `answer`, which returns the answer's text and whether it is a tool error."""

    call_tag: str
    answer_tag: str

    def __init__(self, max_calls: int):
        if max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {max_calls}")
        self.max_calls, self.calls = max_calls, 0

    stop: tuple[str, ...]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.stop = (f"</{cls.call_tag}>",)  # a class attribute: Calculator.stop reads without an instance

    def answer(self, body: str) -> tuple[str, bool]:
        raise NotImplementedError

    def step(self, turn: Turn) -> Step:
        body = ending_call(turn.text, self.call_tag)
        if body is None:
            return Step(done=True)
        self.calls += 1
        refused = refuse_past_limit(self.calls, self.max_calls, self.answer_tag)
        if refused is not None:
            return refused
        text, error = self.answer(body)
        return Step(observation=f"<{self.answer_tag}>{text}</{self.answer_tag}>",
                    info={"tool_calls": 1, "tool_errors": int(error)})
