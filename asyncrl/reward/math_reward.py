"""Binary math reward with math-verify, after Skywork-OR1 section 7.1.

Take the answer after the reasoning (the last `\\boxed{...}`, braces matched, after `</think>`
if present); reward 1 if its string equals the gold answer, else fall back to math-verify's
`verify` against the gold wrapped in `\\boxed{}`; 0 otherwise, and 0 (never an exception) for a
response without a boxed answer or one math-verify cannot parse. No format reward.
"""

from __future__ import annotations

from typing import Any

from math_verify import parse, verify

BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with nested braces matched, or None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    i = start + len(BOXED)
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


class MathReward:
    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        gold = metadata.get("answer")
        if gold is None:
            return 0.0, {"outcome": "no_ground_truth"}
        answer_part = response.rsplit("</think>", 1)[-1]
        pred = last_boxed(answer_part)
        if pred is None:
            return 0.0, {"outcome": "no_boxed"}
        if pred.strip() == str(gold).strip():
            return 1.0, {"outcome": "string_match"}
        try:
            ok = verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}"))
        except Exception as e:  # math-verify can raise on pathological LaTeX; a bad sample gets 0
            return 0.0, {"outcome": "verify_error", "error": repr(e)[:200]}
        return (1.0, {"outcome": "verified"}) if ok else (0.0, {"outcome": "wrong"})
