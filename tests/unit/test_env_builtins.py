"""The built-in calculator and guess-number environments (asyncrl/env/calculator.py,
guess_number.py), driven turn by turn as an episode would drive them, and the python tool's
output formatting (its runs are in tests/integration/test_env_python_tool.py)."""

import time

import pytest

from asyncrl.config import SandboxConfig
from asyncrl.env.base import Step, Turn
from asyncrl.env.calculator import Calculator, evaluate
from asyncrl.env.guess_number import GuessNumber, make_records
from asyncrl.env.python_tool import format_output
from asyncrl.env.tool_calls import ending_call
from asyncrl.reward.sandbox import RunResult


def turn(text, index=0):
    return Turn(index=index, text=text, token_ids=[], finish_reason="stop")


def calc(expression, env=None):
    return (env or Calculator({})).step(turn(f"Let me compute. <calc>{expression}</calc>"))


@pytest.mark.parametrize("expression, shown", [
    ("12*34", "408"),
    ("2+3*4", "14"),
    ("(2+3)*4", "20"),
    ("2**3**2", "512"),  # right-associative
    ("-2**2", "-4"),  # the power binds first
    ("7/2", "3.5"),
    ("8/2", "4"),
    ("123456789012/2", "61728394506"),  # a whole float prints all its digits
    ("1e20", "1e+20"),  # past float's exact integers: not as an int
    ("7//2", "3"),
    ("-7 % 3", "2"),
    ("1/3", "0.3333333333"),
    ("2.5*2", "5"),
    ("0.1+0.2", "0.3"),
    ("2**-1", "0.5"),
    (" 48 * 52 ", "2496"),
])
def test_calculator_values(expression, shown):
    assert calc(expression) == Step(observation=f"<result>{shown}</result>",
                                     info={"tool_calls": 1, "tool_errors": 0})


@pytest.mark.parametrize("expression, why", [
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0**-1", "division by zero"),
    ("x+1", "not allowed: name 'x'"),
    ("abs(-3)", "not allowed: function call"),
    ("(1).real", "not allowed: attribute"),
    ("__import__('os').system('true')", "not allowed: function call"),
    ("'a'*3", "not a number: 'a'"),
    ("True+1", "not a number: True"),
    ("2j*2", "not a number: 2j"),
    ("(-8)**0.5", "complex result"),
    ("2^3", "^ is not a power, use **"),
    ("1 +", "syntax error"),
    ("", "empty expression"),
    ("[1, 2]", "not allowed: list"),
    ("1e308*10", "result too large"),
])
def test_calculator_errors_are_answered_and_counted(expression, why):
    assert calc(expression) == Step(observation=f"<result>error: {why}</result>",
                                     info={"tool_calls": 1, "tool_errors": 1})


def test_a_huge_power_is_refused_before_it_is_computed():
    start = time.monotonic()
    for expression in ("9**9**9", "10**10**10", "2**(10**6)", "0.5**-100000", "(10**60)*(10**60)"):
        assert calc(expression).observation == "<result>error: result too large</result>", expression
    assert time.monotonic() - start < 0.5
    assert evaluate("10**99") == 10**99  # under the cap: exact
    assert evaluate("(-1)**(10**50)") == 1  # a power of +-1 is cheap at any exponent


def test_the_last_call_of_the_turn_is_evaluated():
    step = Calculator({}).step(turn("First <calc>1+1</calc> was wrong, so <calc>2+2</calc>\n"))
    assert step.observation == "<result>4</result>"
    assert ending_call("answer: 3 <calc>1</calc> and then more", "calc") is None  # not at the end
    assert ending_call("no opening</calc>", "calc") == ""


def test_a_turn_without_a_call_ends_the_episode():
    env = Calculator({})
    assert env.step(turn("The answer is \\boxed{408}.")) == Step(done=True)
    cut = Turn(index=0, text="Let me compute <calc>12*3", token_ids=[], finish_reason="length")
    assert Calculator({}).step(cut) == Step(done=True)


def test_past_max_calls_one_refusal_then_the_episode_ends():
    env = Calculator({}, max_calls=2)
    assert [calc("1+1", env).observation for _ in range(2)] == ["<result>2</result>"] * 2
    refused = calc("1+1", env)
    assert refused == Step(observation="<result>error: too many calls</result>", done=False,
                           info={"tool_calls": 1, "tool_errors": 1})
    assert calc("1+1", env).done  # a second call past the limit
    with pytest.raises(ValueError):
        Calculator({}, max_calls=0)


def test_an_unknown_option_is_an_error():
    with pytest.raises(TypeError):
        Calculator({}, max_cals=3)


def guess(env, text):
    return env.step(turn(f"My guess: <guess>{text}</guess>"))


def test_guess_number_feedback_then_reward():
    env = GuessNumber({"answer": "62"})
    steps = [guess(env, n) for n in ("50", "75", "62")]
    assert [s.observation for s in steps] == ["<feedback>higher</feedback>", "<feedback>lower</feedback>", ""]
    assert [(s.reward, s.done) for s in steps] == [(None, False), (None, False), (1.0, True)]
    assert all(s.info == {"tool_calls": 1, "tool_errors": 0} for s in steps)


def test_guess_number_without_a_guess_ends_with_reward_zero():
    assert GuessNumber({"answer": 5}).step(turn("I give up.")) == Step(reward=0.0, done=True)


def test_guess_number_bad_guesses_are_tool_errors_and_use_a_guess():
    env = GuessNumber({"answer": 5}, max_guesses=3)
    bad = guess(env, "five")
    assert bad == Step(observation="<feedback>error: not a whole number</feedback>",
                       info={"tool_calls": 1, "tool_errors": 1})
    assert guess(env, "101").observation == "<feedback>error: out of range 1..100</feedback>"
    last = guess(env, " 4 ")
    assert (last.observation, last.reward, last.done) == ("<feedback>higher</feedback>", 0.0, True)


def test_guess_number_out_of_guesses():
    env = GuessNumber({"answer": 1}, low=1, high=10, max_guesses=2)
    first, second = guess(env, "5"), guess(env, "3")
    assert (first.reward, first.done) == (None, False)
    assert (second.observation, second.reward, second.done) == ("<feedback>lower</feedback>", 0.0, True)


def test_guess_number_checks_its_secret():
    assert GuessNumber({"answer": "42.0"}).secret == 42
    for answer in (None, "abc", "4.5", True, 0, 101):
        with pytest.raises(ValueError):
            GuessNumber({"answer": answer})


def test_make_records_is_deterministic_per_seed():
    records = make_records(20, seed=3, low=10, high=20)
    assert records == make_records(20, seed=3, low=10, high=20)
    assert [r["answer"] for r in records] != [r["answer"] for r in make_records(20, seed=4, low=10, high=20)]
    assert all(10 <= int(r["answer"]) <= 20 and r["data_source"] == "guess_number" for r in records)
    assert "from 10 to 20" in records[0]["prompt"] and "<guess>N</guess>" in records[0]["prompt"]
    for record in records:  # each record's secret is the one its environment hides
        assert GuessNumber({"answer": record["answer"]}, low=10, high=20).secret == int(record["answer"])


def test_python_tool_output_keeps_stdouts_head_and_stderrs_tail():
    limits = SandboxConfig()

    def tagged(*args):  # as the tool answers: inside <output> tags
        return f"<output>{format_output(*args)}</output>"

    crashed = RunResult("crashed", 1, b"o" * 1000, b"e" * 999 + b"E", 0.1)
    assert tagged(crashed, limits, 400) == (
        f"<output>{'o' * 200}\n[... 800 characters cut]\n[... 800 characters cut]\n{'e' * 199}E\n"
        "error: exit status 1\n</output>")
    short_out = RunResult("memory", -9, b"12", b"MemoryError" * 100, 0.1)
    assert tagged(short_out, limits, 40) == (
        "<output>12\n[... 1062 characters cut]\nError" + "MemoryError" * 3 + "\n"
        "error: out of memory (limit: 512 MiB)\n</output>")
    assert tagged(RunResult("killed", -15, b"", b"", 0.1), limits, 40) == (
        "<output>error: killed by SIGTERM\n</output>")
    assert tagged(RunResult("ok", 0, b"done\n", b"a warning\n", 0.1), limits, 40) == "<output>done\n</output>"
