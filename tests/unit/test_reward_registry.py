"""The verifier registry: routing by data_source / domain / default, user functions loaded by
`import:`, start-time checks, and what the router returns when a verifier misbehaves."""

import math
import sys

import pytest

from asyncrl.config import ConfigError, RewardConfig
from asyncrl.reward.math_reward import MathReward
from asyncrl.reward.registry import RewardRouter, build_verifier, check_functions, check_sources
from asyncrl.reward.text_rewards import AnswerTagReward, MultipleChoiceReward

USER_MODULE = "asyncrl_test_user_rewards"
USER_CODE = '''
import math

SHARED = {"outcome": "mine"}
not_callable = 3


def half(response, metadata):
    return 0.5


def tagged(response, metadata):
    return 1.0, {"outcome": "mine", "length": len(response)}


def no_outcome(response, metadata):
    return 0.25, {}


def shared_info(response, metadata):
    return 1.0, SHARED


def negative(response, metadata):
    return -0.5


def above_one(response, metadata):
    return 2, {"outcome": "bonus"}


def boolean(response, metadata):
    return response == "yes"


def nan(response, metadata):
    return math.nan


def inf(response, metadata):
    return math.inf, {}


def text(response, metadata):
    return "1"


def nothing(response, metadata):
    pass


def info_not_dict(response, metadata):
    return 1.0, "fine"


def raises(response, metadata):
    raise RuntimeError("verifier bug " + "x" * 10_000)


class Graders:
    @staticmethod
    def strict(response, metadata):
        return float(response == metadata["answer"])
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{USER_MODULE}.py").write_text(USER_CODE)
    (tmp_path / "asyncrl_test_broken.py").write_text("raise ImportError('needs a missing package')\n")
    (tmp_path / "asyncrl_test_syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (USER_MODULE, "asyncrl_test_broken", "asyncrl_test_syntax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield USER_MODULE
    for name in (USER_MODULE, "asyncrl_test_broken", "asyncrl_test_syntax"):
        sys.modules.pop(name, None)


def user(fn):
    return f"import:{USER_MODULE}:{fn}"


# ------------------------------------------------------------------ built-in names


@pytest.mark.parametrize("name,cls", [("math_verify", MathReward), ("answer_tag", AnswerTagReward),
                                      ("multiple_choice", MultipleChoiceReward)])
def test_builtin_names(name, cls):
    assert isinstance(build_verifier(name, RewardConfig()), cls)


def test_code_gets_the_code_config_and_a_time_budget_inside_the_timeout():
    from asyncrl.reward.code_reward import CodeReward

    cfg = RewardConfig(code={"mode": "fraction"}, timeout_s=40)
    verifier = build_verifier("code", cfg)
    assert isinstance(verifier, CodeReward) and verifier.cfg is cfg.code
    assert verifier.time_budget_s == pytest.approx(36.0)  # stops starting tests before the pool kills it


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown verifier 'regex'"):
        build_verifier("regex", RewardConfig())


# ------------------------------------------------------------------ routing


def router(**cfg):
    return RewardRouter(RewardConfig(**cfg))


def test_routes_by_data_source_then_default():
    r = router(type="answer_tag", by_source={"gpqa": "multiple_choice"})
    assert set(r.verifiers) == {"answer_tag", "multiple_choice"}
    assert r.verifier_for("gpqa") == "multiple_choice"
    assert r.verifier_for("reasoning_gym") == "answer_tag"
    assert r("<answer>B</answer>", {"answer": "B", "data_source": "gpqa"}) == (
        1.0, {"choice": "B", "outcome": "correct", "verifier": "multiple_choice", "data_source": "gpqa"})
    assert r("<answer>B</answer>", {"answer": "B", "data_source": "puzzles"}) == (
        1.0, {"answer": "B", "outcome": "exact", "verifier": "answer_tag", "data_source": "puzzles"})


def test_routes_by_domain_when_no_data_source():
    r = router(type="answer_tag", by_source={"stem": "multiple_choice"})
    _, info = r("Answer: C", {"answer": "C", "domain": "stem"})
    assert (info["verifier"], info["data_source"], info["outcome"]) == ("multiple_choice", "stem", "correct")
    _, info = r("Answer: C", {"answer": "C", "data_source": "puzzles", "domain": "stem"})
    assert info["verifier"] == "answer_tag"  # data_source wins, as in the prompt source


def test_no_source_uses_the_default():
    r = router(type="multiple_choice", by_source={"stem": "answer_tag"})
    assert r("Answer: C", {"answer": "C"}) == (
        1.0, {"choice": "C", "outcome": "correct", "verifier": "multiple_choice", "data_source": None})
    assert r("Answer: C", None) == (
        0.0, {"outcome": "bad_input", "verifier": "multiple_choice", "data_source": None})


def test_no_verifier_without_default():
    r = router(type=None, by_source={"stem": "multiple_choice"})
    assert r.verifier_for("puzzles") is None
    assert r("<answer>B</answer>", {"answer": "B", "data_source": "puzzles"}) == (
        0.0, {"outcome": "no_verifier", "verifier": None, "data_source": "puzzles"})


def test_verifiers_are_built_once(monkeypatch):
    built = []
    import asyncrl.reward.registry as registry

    real = registry.build_verifier
    monkeypatch.setattr(registry, "build_verifier", lambda name, cfg: built.append(name) or real(name, cfg))
    RewardRouter(RewardConfig(type="answer_tag", by_source={"a": "answer_tag", "b": "multiple_choice",
                                                            "c": "multiple_choice"}))
    assert sorted(built) == ["answer_tag", "multiple_choice"]


# ------------------------------------------------------------------ start-time checks


def test_check_sources_names_every_unrouted_source():
    cfg = RewardConfig(type=None, by_source={"gsm8k": "math_verify"})
    with pytest.raises(ValueError) as err:
        check_sources(cfg, ["gsm8k", "zebra", "gpqa", "zebra"])
    message = str(err.value)
    assert "'gpqa', 'zebra'" in message and "gsm8k" not in message and "reward.by_source" in message
    check_sources(cfg, ["gsm8k"])
    check_sources(cfg, [])


def test_check_sources_passes_with_a_default():
    check_sources(RewardConfig(type="answer_tag"), ["anything", "else"])


def test_check_functions_imports_user_functions_and_names_the_field():
    check_functions(RewardConfig(type="import:asyncrl.reward.fault_injection:scripted"))
    check_functions(RewardConfig(by_source={"x": "math_verify"}))  # built-ins are not imported here
    with pytest.raises(ConfigError, match=r"reward\.by_source\.zebra: .*cannot import module 'nope_mod'"):
        check_functions(RewardConfig(by_source={"zebra": "import:nope_mod:fn"}))
    with pytest.raises(ConfigError, match=r"reward\.type: .*has no attribute 'missing'"):
        check_functions(RewardConfig(type="import:asyncrl.reward.fault_injection:missing"))


# ------------------------------------------------------------------ user functions


@pytest.mark.parametrize("fn,response,reward,info", [
    ("half", "x", 0.5, {"outcome": "custom"}),
    ("tagged", "abc", 1.0, {"outcome": "mine", "length": 3}),
    ("no_outcome", "x", 0.25, {"outcome": "custom"}),
    ("negative", "x", -0.5, {"outcome": "custom"}),
    ("above_one", "x", 2.0, {"outcome": "bonus"}),
    ("boolean", "yes", 1.0, {"outcome": "custom"}),
    ("boolean", "no", 0.0, {"outcome": "custom"}),
    ("Graders.strict", "42", 1.0, {"outcome": "custom"}),
])
def test_user_function(user_module, fn, response, reward, info):
    r = router(type=user(fn))
    got, got_info = r(response, {"answer": "42", "data_source": "mine"})
    assert type(got) is float
    assert (got, got_info) == (reward, {**info, "verifier": user(fn), "data_source": "mine"})


@pytest.mark.parametrize("fn", ["nan", "inf", "text", "nothing", "info_not_dict"])
def test_user_function_bad_reward(user_module, fn):
    reward, info = router(type=user(fn))("x", {"data_source": "mine"})
    assert reward == 0.0 and not math.isnan(reward)
    assert info["outcome"] == "bad_reward" and info["error"]


def test_user_function_shared_info_is_not_mutated(user_module):
    r = router(type=user("shared_info"))
    r("x", {"data_source": "mine"})
    assert sys.modules[USER_MODULE].SHARED == {"outcome": "mine"}


def test_verifier_exception_is_caught(user_module):
    reward, info = router(type="answer_tag", by_source={"buggy": user("raises")})(
        "x", {"data_source": "buggy"})
    assert reward == 0.0
    assert info["outcome"] == "verifier_error" and info["verifier"] == user("raises")
    assert info["error"].startswith("RuntimeError('verifier bug") and len(info["error"]) <= 500


@pytest.mark.parametrize("path,match", [
    ("import:asyncrl_test_no_such_module:f", "cannot import module 'asyncrl_test_no_such_module'"),
    ("import:asyncrl_test_broken:f", "needs a missing package"),
    ("import:asyncrl_test_syntax:f", "cannot import module 'asyncrl_test_syntax'"),
    (f"import:{USER_MODULE}:missing", "has no attribute 'missing'"),
    (f"import:{USER_MODULE}:Graders.lenient", "has no attribute 'Graders.lenient'"),
    (f"import:{USER_MODULE}:not_callable", "is not callable"),
    (f"import:{USER_MODULE}", "expected package.module:function"),
])
def test_bad_import_path_fails_at_build(user_module, path, match):
    with pytest.raises(ValueError, match=match) as err:
        build_verifier(path, RewardConfig())
    assert repr(path[len("import:"):]) in str(err.value)


def test_bad_import_path_fails_when_the_router_is_built(user_module):
    with pytest.raises(ValueError, match="asyncrl_test_no_such_module"):
        RewardRouter(RewardConfig(type="answer_tag", by_source={"x": "import:asyncrl_test_no_such_module:f"}))
