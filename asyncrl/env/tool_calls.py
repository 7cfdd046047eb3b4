"""What the built-in tools share: finding the call that ends a model turn, and the call limit
(the rule is explained in calculator.py's docstring)."""

from __future__ import annotations

from asyncrl.env.base import Step


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
