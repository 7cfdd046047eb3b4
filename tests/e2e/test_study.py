"""`asyncrl study` as a user runs it, on a 2-arm x 1-seed study with the fake engine: stopped by a
signal in its first run and invoked again, it resumes that run from its checkpoint and starts the
other; a third invocation reruns nothing; the report has the verdict and both arms, and every
figure holds both arms with the seed means of their metrics files. The same study with
--parallel 2 runs both arms at once on one Ray cluster. `asyncrl plot` draws the same runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from figure_checks import check_metric_figure

ROOT = Path(__file__).resolve().parents[2]
ASYNCRL = str(Path(sys.executable).with_name("asyncrl"))  # the command the install put beside this Python
STEPS = 16
STUDY = f"""
name: e2e
base: tiny_cpu
overrides:
  rollout.engine: fake
  rollout.group_size: 4
  rollout.max_tokens: 8
  buffer.token_budget: 32
  algo.drop_zero_variance_groups: false
  algo.kl.track: true
  reward.type: "import:asyncrl.reward.fault_injection:by_response_hash"
  observe.tensorboard: false
  eval.every_steps: 0
  checkpoint.every_steps: 4
  ray.num_cpus: 3
total_steps: {STEPS}
seeds: [0]
arms:
  - {{name: tight, overrides: {{algo.eps_high: 0.2}}}}
  - {{name: loose, overrides: {{algo.eps_high: 0.28}}}}
analysis: {{window: 3}}
findings:
  - name: both arms log a positive entropy
    source: a test
    checks:
      - {{kind: ordered, arms: [tight, loose], stat: initial, direction: increasing}}
      - {{kind: compare, left: {{arm: loose, stat: final}}, op: gt, right: 0.0}}
"""
METRICS = ["entropy/learner", "entropy/behaviour_sampled", "reward/mean", "clip/low_frac", "clip/high_frac",
           "staleness/mean", "entropy/coef", "kl/mean"]


def study(tmp_path, model, *extra):
    path = tmp_path / "e2e.yaml"
    path.write_text(STUDY)
    cmd = [ASYNCRL, "study", str(path), f"model.path={model}", f"observe.output_dir={tmp_path}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def events(run_dir):
    return [json.loads(x)["event"] for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_study_resumes_skips_and_reports(tmp_path, tiny_model_path):
    out_dir = tmp_path / "e2e"
    tight, loose = out_dir / "tight-s0", out_dir / "loose-s0"

    first = study(tmp_path, tiny_model_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(rows(tight)) < 3:
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)  # like a Ctrl-C: the study forwards one SIGTERM to the run
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGINT, out[-3000:]
    assert 3 <= len(rows(tight)) < STEPS, "the signal came too late to test a resume"
    assert events(tight)[-1] == "end" and not loose.exists(), out[-3000:]

    second = study(tmp_path, tiny_model_path)
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out[-3000:]
    assert "tight-s0: resume" in out and "loose-s0: start" in out
    assert events(tight).count("resume") == 1
    for run in (tight, loose):
        assert [json.loads(r)["step"] for r in rows(run)] == list(range(1, STEPS + 1))
        assert events(run)[-1] == "end" and json.loads((run / "events.jsonl").read_text().splitlines()[-1])["status"] == "finished"

    before = {run: (run / "metrics.jsonl").read_text() for run in (tight, loose)}
    third = study(tmp_path, tiny_model_path)
    out, _ = third.communicate(timeout=300)
    assert third.returncode == 0, out[-3000:]
    assert out.count("finished before, skipped") == 2 and "0 run(s) made" in (out_dir / "report.md").read_text()
    assert all((run / "metrics.jsonl").read_text() == text for run, text in before.items())

    report = (out_dir / "report.md").read_text()
    assert "| both arms log a positive entropy (a test) | **" in report
    assert "| tight | algo.eps_high=0.2 | 1/1 finished | 16 |" in report
    assert "| loose | algo.eps_high=0.28 | 1/1 finished | 16 |" in report
    verdict = json.loads((out_dir / "report.json").read_text())["verdicts"][0]
    # one seed: no interval, so no verdict (analysis/paired.py)
    assert verdict["outcome"] == "inconclusive"
    assert all(c["holds"] is None and "fewer than 2 paired seeds" in c["text"] for c in verdict["checks"])
    for metric in METRICS:
        check_metric_figure(out_dir / "figures", metric, {"tight": [tight], "loose": [loose]})
    manifest = json.loads((out_dir / "study.json").read_text())
    assert [r["arm"] for r in manifest["runs"]] == ["tight", "loose"]
    assert " -m asyncrl run --config " in manifest["runs"][0]["command"]

    plots = subprocess.run([ASYNCRL, "plot", str(tight), str(loose), "--out", str(tmp_path / "p")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plots.returncode == 0, plots.stdout + plots.stderr
    check_metric_figure(tmp_path / "p" / "figures", "entropy/learner", {"tight-s0": [tight], "loose-s0": [loose]})


def test_parallel_study_runs_arms_at_once_on_one_cluster(tmp_path, tiny_model_path):
    proc = study(tmp_path, tiny_model_path, "--parallel", "2", "total_steps=4")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    runs = [tmp_path / "e2e" / name for name in ("tight-s0", "loose-s0")]
    spans = []
    for run in runs:
        assert [json.loads(r)["step"] for r in rows(run)] == [1, 2, 3, 4]
        evs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        # a run's life from its config's writing (the first thing `start` does) to its last event:
        # 4 fake-engine steps take ~0.5 s, less than two processes' start-ups differ by, so the
        # steps alone may not overlap (CI saw 0.18 s apart) while the runs did
        spans.append(((run / "config.yaml").stat().st_mtime, evs[-1]["time"]))
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], f"the runs did not overlap: {spans}"
