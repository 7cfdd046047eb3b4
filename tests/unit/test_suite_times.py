"""tools/suite_times.py: pytest's durations lines summed by file, the table and the JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from suite_times import idle_per_file, per_file  # noqa: E402

LOG = """\
============================= slowest durations ==============================
277.13s call     tests/integration/test_fault_matrix.py::test_every_fault_is_survived_and_accounted
60.44s setup    tests/integration/test_reward_in_loop.py::test_hanging_verifier_costs_rewards_not_steps
117.68s call     tests/e2e/test_recipe_runs.py::test_recipe_runs[tiny_lora]
1.50s teardown tests/e2e/test_recipe_runs.py::test_recipe_runs[tiny_lora]
2.25s call     tests/integration/test_reward_in_loop.py::test_a_case[a::b]
tests/e2e/test_recipe_runs.py::test_recipe_runs[grpo] PASSED             [  2%]
(7492 durations < 0.5s hidden.)
====== machine idle per test (core-seconds; 2.0 or more available) ======
idle 230.5 of 554.3 core-s  tests/integration/test_fault_matrix.py::test_every_fault_is_survived_and_accounted
idle 12.0 of 120.9 core-s  tests/integration/test_reward_in_loop.py::test_hanging_verifier_costs_rewards_not_steps
idle 0.5 of 4.5 core-s  tests/integration/test_reward_in_loop.py::test_a_case[a::b]
=== 2580 passed, 13 deselected, 3 xfailed, 47 warnings in 4397.22s (1:13:17) ===
"""


def test_setup_call_and_teardown_add_up_per_file_and_other_lines_are_ignored():
    assert per_file(LOG.splitlines()) == {
        "tests/integration/test_fault_matrix.py": 277.13,
        "tests/integration/test_reward_in_loop.py": 60.44 + 2.25,
        "tests/e2e/test_recipe_runs.py": 117.68 + 1.50,
    }


def test_idle_core_seconds_add_up_per_file():
    assert idle_per_file(LOG.splitlines()) == {
        "tests/integration/test_fault_matrix.py": (230.5, 554.3),
        "tests/integration/test_reward_in_loop.py": (12.0 + 0.5, 120.9 + 4.5),
    }


def test_the_suites_own_idle_lines_are_read_by_the_tool():
    from conftest import idle_line  # tests/conftest.py, which writes them

    lines = [idle_line("tests/e2e/test_x.py::test_y[a::b]", 12.34, 60.0), idle_line("tests/e2e/test_x.py::z", 1, 3)]
    assert idle_per_file(lines) == {"tests/e2e/test_x.py": (12.3 + 1.0, 60.0 + 3.0)}


def test_the_command_line_ranks_files_and_fails_on_a_log_without_durations(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text(LOG)
    out = subprocess.run([sys.executable, "tools/suite_times.py", str(log), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert list(got["files"]) == ["tests/integration/test_fault_matrix.py", "tests/e2e/test_recipe_runs.py",
                                  "tests/integration/test_reward_in_loop.py"]
    assert got["total_s"] == round(277.13 + 60.44 + 2.25 + 117.68 + 1.50, 1)
    assert got["idle_core_s"] == {"tests/integration/test_fault_matrix.py": 230.5,
                                  "tests/integration/test_reward_in_loop.py": 12.5}
    table = subprocess.run([sys.executable, "tools/suite_times.py", str(log), "--top", "1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert table[0].split() == ["277.1", "s", "42%", "idle", "tests/integration/test_fault_matrix.py"]
    assert table[1].startswith("    459.0 s  in all (3 files")
    log.write_text("=== 3 passed in 1.0s ===\n")
    empty = subprocess.run([sys.executable, "tools/suite_times.py", str(log)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 1 and "--durations=0" in empty.stderr


def test_calibration_times_loops_imports_and_counts_cores():
    from suite_times import calibrate

    got = calibrate(loop=1000, imports={"import_json_s": "import json"})
    assert set(got) == {"python_loop_s", "two_loops_s", "import_json_s", "cpus"}
    assert 0 <= got["python_loop_s"] < 1 and got["two_loops_s"] > 0 and got["import_json_s"] > 0
    assert got["cpus"] >= 1


def test_a_failing_import_fails_the_calibration():
    from suite_times import calibrate

    with pytest.raises(RuntimeError, match="no_such_module_here"):
        calibrate(loop=10, imports={"import_missing_s": "import no_such_module_here"})
