"""Every shell command shown in README.md and docs/ is run: here, by a named test, or by CI.

The commands are the lines of the fenced ```bash / ```sh blocks (tests/docs_commands.py). Each one
must be covered in one of three ways, or this test fails naming it:

- run here, because it is cheap: `--help`, `tools/gen_config_reference.py --check`,
  `launch/scale.py` (it only writes a request file);
- run here as a dry run: `asyncrl run ...` (or its shim `python launch/run.py ...`) with
  `--print-config` (the recipe, every override and the model's lengths are resolved; nothing
  starts), `asyncrl study ...` with `--plan` (every run of the study is planned; none starts);
- listed in RUN_BY with the tests or CI script that run it (expensive: installs, training runs,
  clusters, tools that start vLLM). This test checks that each named test exists, and that each
  `--flag` of a listed tool command is one its script defines.

A heredoc command is listed by its first line. Inline `code` in prose is not a command here; the
tools it names must exist with the flags it gives (test_tools_named_in_the_docs_exist).
"""

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_commands import ROOT, Command, all_commands, commands_in, doc_files  # noqa: E402

INSTALL_DEMO = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[cpu]" && python launch/run.py'
INSTALL_TEST = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[cpu,test]" && python -m pytest tests'

RAY_JOB = "tests/e2e/test_launch_run.py::test_launch_run_as_a_ray_job_trains_saves_and_the_policy_generates_in_vllm"
FIRST_HOUR = "tests/e2e/test_first_hour.py::test_own_model_and_data_in_a_minimal_recipe_trains_like_the_demo"
PRINT_OWN = "tests/e2e/test_first_hour.py::test_print_config_resolves_a_base_recipe_and_overrides"
OFFLINE = "tests/integration/test_offline_tools.py"
OWN_ENV = "tests/e2e/test_own_environment.py::test_the_guides_own_environment_trains_as_written"
MULTI_NODE_TESTS = "tests/integration/test_multi_node.py"
MULTI_NODE = f"{MULTI_NODE_TESTS}::test_every_process_listens_on_its_own_node_address"

# command as the docs show it -> what runs it (a test as path::function, or a CI script)
RUN_BY = {
    # CI installs from pyproject.toml into a fresh venv and runs the README's test command;
    # the e2e test runs launch/run.py with the default config (3 steps) on a Ray cluster
    INSTALL_DEMO: (".ci/run", RAY_JOB),
    INSTALL_TEST: (".ci/run",),
    # the walk-through of one's own model and data (the same recipe fields, 4 steps); its model
    # comes from the tiny_model_path fixture, which calls what the script calls (ensure_tiny_model)
    "MODEL=$(python tools/build_tiny_model.py | head -1)": (FIRST_HOUR,),
    "python - <<'PY'": (FIRST_HOUR,),
    "cat > mine.yaml <<YAML": (FIRST_HOUR,),
    "asyncrl run --config mine.yaml --print-config | head -20": (PRINT_OWN,),
    "asyncrl run --config mine.yaml --print-config": (PRINT_OWN,),
    "asyncrl run --config mine.yaml total_steps=100": (FIRST_HOUR,),
    "asyncrl evaluate --model runs/mine/final": (RAY_JOB,),
    # the environments guide's own environment: its file, then the run on the tiny agent's model
    "cat > mycalc.py <<'PY'": (OWN_ENV,),
    "asyncrl run --config configs/tiny_tool.yaml env.type=import:mycalc:Multiplier 'env.import_path=[.]' "
    "name=mycalc total_steps=50": (OWN_ENV,),
    # the trained policy in the tools
    "asyncrl sample --model runs/tiny-cpu/final": (RAY_JOB,),
    "asyncrl evaluate --model runs/tiny-cpu/final --n 8": (RAY_JOB,),
    "asyncrl evaluate runs/tiny-cpu": (f"{OFFLINE}::test_evaluate_a_run_writes_eval_json_with_one_engine",),
    "asyncrl filter-difficulty --config my.yaml --n 16 --out train.filtered.jsonl":
        (f"{OFFLINE}::test_filter_difficulty_keeps_the_sometimes_solved",),
    "asyncrl choose-checkpoint sft/epoch1 sft/epoch3 sft/epoch5 --config my.yaml --band 0.3 0.5":
        (f"{OFFLINE}::test_choose_checkpoint_measures_log_v_for_a_uniform_policy",),
    "asyncrl plot runs/a runs/b --out plots/": ("tests/e2e/test_study.py::test_study_resumes_skips_and_reports",),
    "python tools/fault_matrix.py --steps 12": ("tests/integration/test_fault_matrix.py::test_every_fault_is_survived_and_accounted",),
    "touch runs/tiny-cpu/RESET_REFERENCE": ("tests/integration/test_algo_in_loop.py::"
                                            "test_reference_resets_zero_kl_and_restart_the_optimizer",),
    # `ray start --head --block` in the background, the wait for its job agent, `ray job submit ...
    # launch/run.py`, the head stopped by a signal (not `ray stop`), with token auth
    "export RAY_AUTH_MODE=token": (RAY_JOB,),
    "ray start --head --num-cpus 4 --block > /dev/null &": (RAY_JOB,),
    "HEAD=$!": (RAY_JOB,),
    "timeout 120 sh -c 'until ray job submit --no-wait -- true > /dev/null 2>&1; do sleep 2; done'": (RAY_JOB,),
    "ray job submit --working-dir . -- python launch/run.py --config configs/tiny_cpu.yaml "
    "observe.output_dir=$PWD/runs": (RAY_JOB,),
    "kill $HEAD": (RAY_JOB,),
    # several nodes: a head with 0 CPUs and nodes tagged with custom resources (a Ray cluster of
    # loopback addresses, one node started by `ray start --address ... --resources ... --block`),
    # the learner and the actor placed by learner.resources / rollout.resources, launch/run.py
    # joining it; the job submission itself is RAY_JOB's
    "ray start --head --num-cpus 0 --port 6379": (MULTI_NODE,),
    "ray start --address $HEAD_IP:6379 --resources '{\"learner_node\": 8}'": (MULTI_NODE,),
    "ray start --address $HEAD_IP:6379 --resources '{\"rollout_node\": 8}'": (MULTI_NODE,),
    "ray job submit --address http://$HEAD_IP:8265 --working-dir . -- python launch/run.py "
    "'learner.resources={learner_node: 1}' 'rollout.resources={rollout_node: 1}' observe.output_dir=/shared/runs":
        (f"{MULTI_NODE_TESTS}::test_a_run_directory_every_node_sees_resumes_after_sigterm", RAY_JOB),
}

COMMANDS = all_commands()


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"doc_cmd_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the scripts in launch/ that are shims over an `asyncrl` command (asyncrl/cli/): run.py for
# `ray job submit -- python launch/run.py`, scale.py for the cluster guide
SHIMS = {"launch/run.py": "run", "launch/scale.py": "scale"}


def _argv(cmd: Command, script: str) -> list[str] | None:
    """The arguments of `python <script> ...` when the command is exactly that, else None."""
    if any(op in cmd.text for op in ("|", "&&", ";", "$(", ">", "<")):
        return None
    words = shlex.split(cmd.text)
    return words[2:] if words[:2] == ["python", script] else None


def _cli(cmd: Command, command: str) -> list[str] | None:
    """The arguments of `asyncrl <command> ...` or of its shim script, else None."""
    if any(op in cmd.text for op in ("|", "&&", ";", "$(", ">", "<")):
        return None
    words = shlex.split(cmd.text)
    if words[:2] == ["asyncrl", command]:
        return words[2:]
    script = next((path for path, name in SHIMS.items() if name == command), None)
    return _argv(cmd, script) if script else None


def _run_print_config(cmd: Command, args: list[str], capsys, monkeypatch) -> None:
    from asyncrl.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a run puts the working directory on it
    rc = main(["run", *args, *([] if "--print-config" in args else ["--print-config"])])
    out, err = capsys.readouterr()
    assert rc == 0, f"{cmd.where()}: `{cmd.text}` --print-config: {err}"
    assert "total_steps:" in out


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.where()} {c.text[:60]}")
def test_every_command_in_the_docs_is_run(cmd, capsys, monkeypatch, tmp_path):
    if cmd.text in RUN_BY:
        return  # the named tests exist: test_run_by_names_existing_tests
    if (args := _cli(cmd, "run")) is not None:
        _run_print_config(cmd, args, capsys, monkeypatch)
    elif (args := _cli(cmd, "study")) is not None:
        proc = _run(["-m", "asyncrl", "study", *args, *([] if "--plan" in args else ["--plan"])], ROOT)  # writes nothing
        assert proc.returncode == 0 and "-m asyncrl run" in proc.stdout, f"{cmd.where()}: {proc.stderr[-2000:]}"
    elif (args := _cli(cmd, "scale")) is not None:
        run_dir = tmp_path / args[0]
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text("name: x\n")
        proc = _run(["-m", "asyncrl", "scale", *args], tmp_path)
        assert proc.returncode == 0, f"{cmd.where()}: {proc.stderr}"
        assert (run_dir / "SCALE_ACTORS").read_text().strip() == args[args.index("--actors") + 1]
    elif (words := cmd.text.split())[:1] in (["python"], ["asyncrl"]) and words[-1] in ("--help", "--check"):
        proc = _run(words[1:] if words[0] == "python" else ["-m", *words], ROOT)
        assert proc.returncode == 0, f"{cmd.where()}: `{cmd.text}` exit {proc.returncode}: {proc.stderr[-2000:]}"
    else:
        pytest.fail(f"{cmd.where()}: nothing runs `{cmd.text}`. Give it a test (and list it in RUN_BY), "
                    "or show it in a form this test runs (--help, --print-config, --plan).")


def _defined_tests(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_run_by_names_existing_tests():
    for command, runners in RUN_BY.items():
        for runner in runners:
            path, _, name = runner.partition("::")
            assert (ROOT / path).is_file(), f"{command!r}: {path} does not exist"
            if name:
                assert name in _defined_tests(ROOT / path), f"{command!r}: no test {name} in {path}"


def test_run_by_lists_only_commands_the_docs_show():
    shown = {c.text for c in COMMANDS}
    assert not set(RUN_BY) - shown, f"RUN_BY rows no doc shows any more: {sorted(set(RUN_BY) - shown)}"


def test_flags_of_listed_tool_commands_exist():
    """The expensive commands are not run here: at least their options must be the script's."""
    for command in RUN_BY:
        for script, flags in _tool_uses(command):
            source = _source(script)
            for flag in flags:
                assert f'"{flag}"' in source, f"{command!r}: {script} has no option {flag}"


def _source(script: str) -> str:
    """A script's source, and the `asyncrl` command's module behind it if it is a shim."""
    name = SHIMS.get(script) or (script.split()[1] if script.startswith("asyncrl ") else None)
    cli = ROOT / "asyncrl" / "cli" / f"{name.replace('-', '_')}.py" if name else None
    return "".join(p.read_text() for p in (ROOT / script, cli) if p is not None and p.is_file())


def _tool_uses(text: str) -> list[tuple[str, list[str]]]:
    """(script path or `asyncrl <command>`, its --flags) for each `tools/x.py`, `launch/x.py` or
    `asyncrl <command>` in a command line."""
    out = []
    for m in re.finditer(r"((?:tools|launch)/\w+\.py|(?<![\w/.-])asyncrl [a-z][\w-]*)([^|&;`]*)", text):
        out.append((m.group(1), re.findall(r"(?<!\S)(--[\w-]+)", m.group(2))))
    return out


def test_tools_named_in_the_docs_exist():
    """Inline mentions such as `tools/bench_actor.py --rounds 5`: the script and its options exist."""
    for path in doc_files():
        for code in re.findall(r"`([^`\n]+)`", path.read_text()):
            for script, flags in _tool_uses(code):
                source = _source(script)
                assert source, f"{path.relative_to(ROOT)}: `{code}`: no {script}"
                for flag in flags:
                    assert f'"{flag}"' in source, f"{path.relative_to(ROOT)}: `{code}`: {script} has no {flag}"


def test_ci_runs_the_readme_test_command():
    readme = {c.text for c in commands_in(ROOT / "README.md")}
    assert INSTALL_DEMO in readme and INSTALL_TEST in readme
    ci = (ROOT / ".ci/run").read_text()
    assert 'pip install -q -e ".[cpu,test]"' in ci and "python -m pytest tests" in ci


def test_the_extractor_reads_continuations_comments_and_heredocs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\n# a comment line\npython a.py --x 1   # why\npython b.py \\\n"
                    "    --y 2\ncat > f <<EOF\nbody # not a comment\nEOF\n```\n\n```python\nprint(1)\n```\n"
                    "- item\n\n  ```sh\n  ray stop\n  ```\n")
    got = [(c.line, c.text, c.heredoc) for c in commands_in(page, tmp_path)]
    assert got == [(5, "python a.py --x 1", ""), (6, "python b.py --y 2", ""),
                   (8, "cat > f <<EOF", "body # not a comment"), (19, "ray stop", "")]
