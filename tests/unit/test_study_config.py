"""Study files: validation naming the field, grid arms, --quick, how a run's fields are merged,
and the shipped presets."""

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config, parse_override
from asyncrl.config.load import format_override
from asyncrl.lab.study.config import load_study
from asyncrl.lab.study.plan import plan_study

STUDIES = sorted((Path(__file__).resolve().parents[2] / "configs" / "studies").glob("*.yaml"))

GOOD = """
name: mini
base: tiny_cpu
overrides: {algo.eps_high: 0.2, eval.every_steps: 25}
total_steps: 100
seeds: [0, 1]
arms:
  - {name: a, overrides: {buffer.max_staleness: 0}}
  - {name: b, overrides: {buffer.max_staleness: 2, algo.eps_high: 0.28}, steps_factor: 2}
grid: {algo.decoupled: [false, true], buffer.token_budget: [256, 512]}
grid_names: {algo.decoupled: dec, buffer.token_budget: phi}
quick: {total_steps: 10, seeds: [7], overrides: {eval.every_steps: 0}, grid: {buffer.token_budget: [256]}}
findings:
  - name: b keeps more entropy
    source: paper 1
    checks:
      - {kind: compare, left: {arm: b}, op: gt, right: {arm: a}}
      - {kind: ordered, arms: [dec0-phi256, dec1-phi256], stat: final, direction: increasing}
"""


def write(tmp_path, text, name="s.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_grid_arms_are_named_and_quick_shrinks(tmp_path):
    study = load_study(write(tmp_path, GOOD))
    assert [a.name for a in study.arm_specs(quick=False)] == [
        "a", "b", "dec0-phi256", "dec0-phi512", "dec1-phi256", "dec1-phi512"]
    assert [a.name for a in study.arm_specs(quick=True)] == ["a", "b", "dec0-phi256", "dec1-phi256"]
    assert study.arm_specs(quick=False)[3].overrides == {"algo.decoupled": False, "buffer.token_budget": 512}


def test_plan_merges_study_quick_arm_steps_and_command_line(tmp_path):
    path = write(tmp_path, GOOD)
    plan = plan_study(load_study(path), path, quick=True, cli_overrides=[f"observe.output_dir={tmp_path}/out",
                                                                         "observe.tensorboard=false"])
    assert plan.study_dir == (tmp_path / "out" / "mini-quick").resolve()
    assert [r.name for r in plan.runs] == ["a-s7", "b-s7", "dec0-phi256-s7", "dec1-phi256-s7"]
    b = plan.runs[1]
    assert b.fields == {"algo.eps_high": 0.28, "eval.every_steps": 0, "buffer.max_staleness": 2, "total_steps": 20,
                        "observe.tensorboard": False, "seed": 7, "name": "b-s7",
                        "observe.output_dir": str(plan.study_dir)}
    assert plan.settings["b"] == "buffer.max_staleness=2, algo.eps_high=0.28, steps x2"
    argv = b.argv(plan.base)
    assert argv[1:4] == ["-m", "asyncrl", "run"] and argv[4:6] == ["--config", str(plan.base)]
    cfg = load_config(plan.base, argv[6:])  # the command line is a valid run config with the fields
    assert cfg.algo.eps_high == 0.28 and cfg.total_steps == 20 and cfg.seed == 7 and cfg.run_dir == b.run_dir


def test_full_plan_uses_the_study_steps_seeds_and_the_base_output_dir(tmp_path):
    path = write(tmp_path, GOOD)
    plan = plan_study(load_study(path), path, quick=False, cli_overrides=["total_steps=30"])
    assert plan.study_dir == (Path("runs") / "mini").resolve()
    assert len(plan.runs) == 6 * 2 and plan.runs[0].fields["eval.every_steps"] == 25
    assert [r.fields["total_steps"] for r in plan.runs[:4]] == [30, 30, 60, 60]


def test_plan_of_some_arms(tmp_path):
    path = write(tmp_path, GOOD)
    plan = plan_study(load_study(path), path, quick=True, cli_overrides=[], only=["b", "dec1-phi256"])
    assert [r.name for r in plan.runs] == ["b-s7", "dec1-phi256-s7"] and list(plan.settings) == ["b", "dec1-phi256"]
    with pytest.raises(ConfigError, match="no arm named 'dec1-phi512'"):  # not an arm under --quick
        plan_study(load_study(path), path, quick=True, cli_overrides=[], only=["dec1-phi512"])


@pytest.mark.parametrize("cli, message", [
    (["buffer.max_staleness=3"], "'buffer.max_staleness' is what arm 'a' varies"),
    (["seed=3"], "'seed'"),
    (["algo.eps_low=2"], "arm 'a'"),  # a bad value is named with the arm
    (["nosuch.field=1"], "nosuch"),
])
def test_plan_rejects_overrides(tmp_path, cli, message):
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError) as e:
        plan_study(load_study(path), path, quick=False, cli_overrides=cli)
    assert message in str(e.value)


@pytest.mark.parametrize("change, field", [
    (("  - {name: a,", "  - {name: a, colour: red,"), "arms.0.colour"),
    (("total_steps: 100", "total_steps: -1"), "total_steps"),
    (("op: gt", "op: ge"), "findings.0.checks.0.compare.op"),
    (("direction: increasing", "direction: up"), "findings.0.checks.1.ordered.direction"),
    (("right: {arm: a}", "right: {arm: zz}"), "no arm named 'zz'"),
    (("stat: final, direction", "stat: mean_abs_dev, direction"), "target is required"),
    (("quick: {total_steps: 10,", "quick: {arms: [nope], total_steps: 10,"), "quick.arms: no arm named 'nope'"),
    (("grid_names: {algo.decoupled: dec,", "grid_names: {algo.decouple: dec,"), "grid_names"),
    (("name: mini", "name: mini study"), "name"),
])
def test_bad_study_files_name_the_field(tmp_path, change, field):
    assert change[0] in GOOD
    with pytest.raises(ConfigError) as e:
        load_study(write(tmp_path, GOOD.replace(*change)))
    assert field in str(e.value)


def test_unknown_field_lists_the_allowed_ones(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_study(write(tmp_path, GOOD.replace("op: gt", "op: gt, margin: 1")))
    assert "findings.0.checks.0.compare.margin: unknown field" in str(e.value) and "factor" in str(e.value)


def test_a_key_given_twice_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="given twice"):
        load_study(write(tmp_path, GOOD + "total_steps: 5\n"))


@pytest.mark.parametrize("value", [3, 1e-3, 0.28, True, False, None, "lines", [1, 2], {"a": "b"}, "builtin:tiny"])
def test_format_override_parses_back(value):
    assert parse_override(format_override("a.b", value)) == ("a.b", value)


def test_a_string_that_reads_as_a_number_cannot_be_an_override():
    with pytest.raises(ConfigError):
        format_override("name", "12")


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
@pytest.mark.parametrize("quick", [False, True])
def test_every_shipped_study_plans(path, quick, tmp_path):
    study = load_study(path)
    plan = plan_study(study, path, quick=quick, cli_overrides=[f"observe.output_dir={tmp_path}"])
    assert plan.runs and study.findings
    if quick:
        assert all(r.fields["eval.every_steps"] == 0 for r in plan.runs)


def test_the_aa_arm_runs_twice_under_two_names_with_the_same_settings_but_its_sampling():
    from asyncrl.lab.study.config import StudyConfig

    study = StudyConfig.model_validate({"name": "s", "total_steps": 4, "aa_arm": "b",
                                        "arms": [{"name": "a", "overrides": {"seed": 1}},
                                                 {"name": "b", "overrides": {"algo.eps_high": 0.3}, "steps_factor": 2}]})
    arms = study.arm_specs(quick=False)
    assert [a.name for a in arms] == ["a", "b", "b-aa"]
    # the same settings, prompts and seeds; another sampling seed, or the copy would be its source
    # to the last digit (runs of a seed are deterministic) and its spread 0
    assert arms[2].overrides == {**arms[1].overrides, "rollout.sampling_seed_offset": 1_000_003}
    assert arms[2].steps_factor == 2
    first = StudyConfig.model_validate({"name": "s", "total_steps": 4, "aa_arm": "a",
                                        "arms": [{"name": "a"}, {"name": "b"}]})
    assert [a.name for a in first.arm_specs(quick=False)] == ["a", "a-aa", "b"]  # right after its source
    assert study.aa_pair == ("b", "b-aa")
    with pytest.raises(ValueError, match="aa_arm: no arm named 'c'"):
        StudyConfig.model_validate({"name": "s", "total_steps": 4, "aa_arm": "c", "arms": [{"name": "a"}]})


def test_every_shipped_study_has_an_aa_arm():
    assert STUDIES
    for path in STUDIES:
        assert load_study(path).aa_pair is not None, path
