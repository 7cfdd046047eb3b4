"""The environments guide's own environment (docs/guides/environments.md), step by step: the
class its heredoc writes answers a call, reports a bad one as a tool error and ends at an answer.
tests/e2e/test_own_environment.py runs the guide's command with it."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from docs_commands import commands_in  # noqa: E402

from asyncrl.env.base import Step, Turn  # noqa: E402


def guide_module(tmp_path):
    [write] = [c for c in commands_in(ROOT / "docs/guides/environments.md") if c.text == "cat > mycalc.py <<'PY'"]
    path = tmp_path / "mycalc.py"
    path.write_text(write.heredoc + "\n")
    spec = importlib.util.spec_from_file_location("mycalc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def turn(text, index=0):
    return Turn(index, text, [], "stop")


def test_the_guides_multiplier_answers_calls_counts_tool_errors_and_ends_at_an_answer(tmp_path):
    env = guide_module(tmp_path).Multiplier({"answer": "1081"})
    assert env.stop == ("</calc>",)
    assert env.step(turn("<calc>23*47</calc>")) == Step(observation="<result>1081</result>", info={"tool_calls": 1})
    assert env.step(turn("<calc>23*x</calc>", 1)) == Step(observation="<result>error</result>",
                                                           info={"tool_calls": 1, "tool_errors": 1})
    assert env.step(turn("<calc>2*3</calc>", 2)) == Step(done=True)  # max_calls=2 used up
    fresh = guide_module(tmp_path).Multiplier({}, max_calls=1)
    assert fresh.step(turn("\\boxed{1081}")) == Step(done=True)
