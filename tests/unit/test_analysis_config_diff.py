"""The report's settings column for plain runs: what differs between the arms' config.yaml files
(asyncrl/lab/analysis/config_diff.py)."""

from asyncrl.lab.analysis.config_diff import config_diff, flatten, settings_text


def cfg(eps_high=0.2, staleness=0, seed=0, name="x", output_dir="runs", stages=(1, 2)):
    return {"name": name, "seed": seed, "resume": None, "algo": {"eps_high": eps_high, "decoupled": True},
            "buffer": {"max_staleness": staleness}, "observe": {"output_dir": output_dir},
            "data": {"stages": list(stages)}, "extra": {}}


def test_flatten_gives_dotted_keys_and_keeps_lists_whole():
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": {}}) == {"a.b": 1, "a.c.d": None, "e": [1, 2],
                                                                               "f": {}}


def test_only_the_keys_that_differ_between_arms():
    diff = config_diff({"low": [cfg(name="low", output_dir="/a")],
                        "high": [cfg(eps_high=0.28, staleness=4, name="high", output_dir="/b", stages=(1, 3))]})
    # name, resume and observe.* are not settings; seed and decoupled are the same in both
    assert diff == {"low": {"algo.eps_high": "0.2", "buffer.max_staleness": "0", "data.stages": "[1, 2]"},
                    "high": {"algo.eps_high": "0.28", "buffer.max_staleness": "4", "data.stages": "[1, 3]"}}
    assert settings_text(diff["high"]) == "algo.eps_high=0.28, buffer.max_staleness=4, data.stages=[1, 3]"


def test_a_key_that_differs_between_seeds_of_one_arm_is_left_out():
    diff = config_diff({"a": [cfg(seed=0), cfg(seed=1)], "b": [cfg(seed=0, eps_high=0.3), cfg(seed=1, eps_high=0.3)]})
    assert diff == {"a": {"algo.eps_high": "0.2"}, "b": {"algo.eps_high": "0.3"}}
    # ungrouped runs: the seed is what differs
    assert config_diff({"a-s0": [cfg(seed=0)], "a-s1": [cfg(seed=1)]}) == {"a-s0": {"seed": "0"}, "a-s1": {"seed": "1"}}


def test_a_key_one_arm_lacks_is_unset_there_and_a_run_without_config_takes_no_part():
    older = cfg()
    del older["algo"]["decoupled"]
    diff = config_diff({"new": [cfg()], "old": [older], "bare": [{}]})
    assert diff == {"new": {"algo.decoupled": "true"}, "old": {"algo.decoupled": "(unset)"}}
    assert config_diff({"only": [cfg()]}) == {"only": {}}
