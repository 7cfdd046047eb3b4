"""A researcher's second hour, through `launch/run.py` as they run it: a run directory holds one
run, their own task lives in its own directory (data and reward module beside the recipe) and is
found from anywhere, and a label their reward function reads is checked like a built-in's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

REWARD = '''
def score(response, metadata):
    return 1.0 if metadata["answer"] in response else 0.0
'''


def run(args, cwd, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it: no PYTHONPATH
    proc = subprocess.run([sys.executable, str(ROOT / "launch/run.py"), *args], cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=timeout)
    return proc


def own_task(root: Path, label: str = "target") -> Path:
    """mytask/: data with its own field names, a reward module, a recipe naming them relatively."""
    task = root / "mytask"
    task.mkdir()
    (task / "my_reward.py").write_text(REWARD)
    rows = [{"q": f"{a}+{b}=", label: str(a + b)} for a in range(5) for b in range(5)]
    (task / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task / "sub.yaml").write_text("name: sub\ndata:\n  type: jsonl\n  path: train.jsonl\n  prompt_field: q\n"
                                   "  answer_field: target\nreward:\n  type: import:my_reward:score\n")
    return task / "sub.yaml"


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another live run: a process that holds the run directory's lock until it is killed."""
    code = ("import sys, time; from pathlib import Path; from asyncrl.orchestrator.run_lock import claim_run_dir; "
            "claim_run_dir(Path(sys.argv[1]), None); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_with_a_live_runs_name_exits_2_naming_the_directory(tmp_path):
    holder = hold_lock(tmp_path / "runs/dup")
    try:
        t0 = time.monotonic()
        proc = run(["name=dup", "rollout.engine=fake"], tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"error: run directory {tmp_path / 'runs/dup'} is in use by a live run (pid {holder.pid} on "
            f"{os.uname().nodename}, started {json.loads((tmp_path / 'runs/dup/run.lock').read_text())['started']}); "
            "give this run another name (name=...) or stop that one first"]
        assert time.monotonic() - t0 < 10  # before Ray starts
        # resuming a live run is refused too: two writers of one directory either way
        assert run(["name=dup", "resume=auto"], tmp_path).returncode == 2
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "runs/dup/events.jsonl").exists()


def test_a_run_directory_left_by_a_finished_run_needs_resume_or_a_new_name(tmp_path):
    run_dir = tmp_path / "runs/dup"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    proc = run(["name=dup", "rollout.engine=fake"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: run directory {run_dir} already holds a run (2 metric rows); continue it "
                                   f"with resume=auto, start another with name=<new name>, or remove {run_dir} to "
                                   "start over")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'  # untouched


def test_own_task_directory_is_found_from_anywhere_and_its_label_is_checked(tmp_path):
    recipe = own_task(tmp_path)
    # from another directory: the data and the reward module are looked up beside the recipe
    proc = run(["--config", str(recipe.relative_to(tmp_path)), "--print-config"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import yaml

    cfg = yaml.safe_load(proc.stdout)
    assert cfg["data"]["path"] == str(recipe.parent / "train.jsonl")
    assert cfg["reward"]["import_path"] == [str(recipe.parent), str(tmp_path)]
    # records that call their label `solution` while the recipe says `target`: the function reads
    # metadata["answer"], so every record needs one, with the near miss named
    rows = [{"q": f"{a}*2=", "solution": str(2 * a)} for a in range(4)]
    (recipe.parent / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run(["--config", str(recipe)], tmp_path / "mytask")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"error: {recipe.parent / 'train.jsonl'}:1: no 'target' field, which the reward function my_reward:score "
        "reads as metadata['answer']; did you mean 'solution'? set data.answer_field=solution")


def test_a_data_path_found_nowhere_names_both_absolute_paths_tried(tmp_path):
    recipe = own_task(tmp_path)
    (recipe.parent / "train.jsonl").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run(["--config", str(recipe), "--print-config"], elsewhere)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {recipe}: data.path 'train.jsonl' does not exist (looked beside the recipe, "
                                   f"{recipe.parent / 'train.jsonl'}, and in the working directory, "
                                   f"{elsewhere / 'train.jsonl'})")


def started_run(tmp_path, name):
    """A fake-engine run in its own process group (as a terminal or a batch job starts it), read
    until its components are ready. Its groups are all kept: the fake engine's random text earns
    no reward, so with the default no group would have a learning signal and no step would run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch/run.py"), "rollout.engine=fake", f"name={name}",
                             "observe.console=lines", "eval.every_steps=0", "total_steps=100000",
                             "algo.drop_zero_variance_groups=false"],
                            cwd=tmp_path, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("components ready"):
            return proc, seen
    raise AssertionError("".join(seen))


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signalling_the_whole_process_group_stops_quietly(tmp_path, sig, code):
    """Ctrl-C (SIGINT to the terminal's group) reaches the reward workers too, and a SIGTERM to the
    group (`timeout`, a batch scheduler) reaches Ray's own daemons: no worker's traceback either way,
    and no 60 s wait for a Ray that is gone."""
    proc, seen = started_run(tmp_path, "sig")
    rows, deadline = tmp_path / "runs/sig/metrics.jsonl", time.monotonic() + 60
    while time.monotonic() < deadline and (not rows.exists() or len(rows.read_text().splitlines()) < 2):
        time.sleep(0.1)  # a few steps in (a stop before the first step has no checkpoint to write)
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    text = "".join(seen) + out
    assert proc.returncode == code, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "EOFError" not in text, text[-3000:]
    last = out.strip().splitlines()[-1]
    if sig == signal.SIGINT:  # Ray's daemons ignore SIGINT: the clean stop, with its checkpoint
        assert last.startswith("stopped at step ") and last.endswith("(SIGINT); continue with resume=auto")
        assert any((tmp_path / "runs/sig/checkpoints").glob("step_*/COMPLETE"))
    else:
        assert last.startswith("SIGTERM reached this run's Ray processes too (") and "resume=auto" in last
        assert took < 30
