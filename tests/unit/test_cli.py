"""The `asyncrl` command's dispatch, and how the lab starts its child processes: by module
(`python -m asyncrl`), with a checkout (never site-packages) put first on their PYTHONPATH."""

import os
import re
import site
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.cli import COMMANDS, main
from asyncrl.lab.study import runner
from asyncrl.lab.study.conduct import study_file


def test_no_command_or_an_unknown_one_is_a_usage_error(capsys):
    assert main([]) == 2
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "no command 'trian'" in err and all(name in err for name in COMMANDS)


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    assert "asyncrl <command>" in capsys.readouterr().out


def test_run_prints_the_config_of_a_shipped_recipe_by_its_name(capsys):
    assert main(["run", "--config", "grpo", "--print-config", "total_steps=2"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["name"] == "grpo-tiny" and cfg["total_steps"] == 2


def test_a_bad_override_exits_2_with_one_line(capsys):
    assert main(["run", "--print-config", "buffer.no_such_field=1"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_a_study_is_found_by_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert study_file("staleness").name == "staleness.yaml" and study_file("staleness").is_file()


def test_children_import_this_asyncrl_and_never_put_site_packages_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    home = str(Path(runner.asyncrl.__file__).resolve().parents[1])
    path = runner.child_env()["PYTHONPATH"].split(os.pathsep)
    assert path[-1] == "/elsewhere"
    installed = {str(Path(p).resolve()) for p in site.getsitepackages()}
    assert path[0] == home if home not in installed else path == ["/elsewhere"]


def test_a_study_run_and_its_evaluation_start_by_module(tmp_path):
    from asyncrl.lab.study.config import load_study
    from asyncrl.lab.study.plan import plan_study

    path = tmp_path / "s.yaml"
    path.write_text("name: s\nbase: tiny_cpu\ntotal_steps: 2\nseeds: [0]\n"
                    "arms: [{name: a, overrides: {algo.eps_high: 0.2}}]\n")
    plan = plan_study(load_study(path), path, quick=False, cli_overrides=[f"observe.output_dir={tmp_path}"])
    assert plan.runs[0].argv(plan.base)[:4] == [sys.executable, "-m", "asyncrl", "run"]


def help_description(command: str, capsys) -> str:
    """The text `asyncrl <command> --help` prints between its usage and its first argument list."""
    with pytest.raises(SystemExit):
        COMMANDS[command].parse_args(["--help"])
    text = capsys.readouterr().out
    body = text.split("\n\n", 1)[1]  # after the usage lines
    return re.split(r"\n(?:positional arguments|options):\n", body)[0].strip()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_help_says_what_it_does_in_full_sentences(command, capsys):
    description = help_description(command, capsys)
    assert description, f"asyncrl {command} --help has no description"
    # a sentence ends in . ! or ?, maybe inside a closing bracket or quote; a description cut at its
    # first line (`asyncrl scale` once) ends mid-sentence
    assert re.search(r"[.!?][)`'\"]*$", description), \
        f"asyncrl {command} --help ends mid-sentence: ...{description[-80:]!r}"
    doc = COMMANDS[command].__doc__ or ""
    if command != "run":  # run's help is asyncrl/launch.py's docstring
        assert " ".join(doc.split()) in " ".join(description.split())


def test_scenario_overrides_may_follow_the_options():
    """`asyncrl plan-cluster SCENARIO --gpus 16 model.params=...` as a user types it."""
    from asyncrl.cli import plan_cluster, twin

    args = plan_cluster.parse_args(["s.yaml", "--gpus", "16", "model.params=7e9", "workload.lengths.mean=4000"])
    assert (args.scenario, args.gpus) == ("s.yaml", 16)
    assert args.overrides == ["model.params=7e9", "workload.lengths.mean=4000"]
    args = twin.parse_args(["s.yaml", "--no-charge", "split.gen_gpus=5"])
    assert args.no_charge and args.overrides == ["split.gen_gpus=5"]
