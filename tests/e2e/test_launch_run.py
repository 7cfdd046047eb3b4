"""The real entry point, as a user runs it: `python launch/run.py` with a very short config."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.tiny.task import TinyTaskSpec, all_problems

ROOT = Path(__file__).resolve().parents[2]


def test_launch_run_trains_saves_and_the_policy_generates_in_vllm(tmp_path, tiny_model_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "launch/run.py", "total_steps=3", "buffer.token_budget=64", "name=e2e",
           f"observe.output_dir={tmp_path}", "observe.console=lines", "sync.probe_every=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert "reward, first fifth" in proc.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any((run_dir / "tensorboard").iterdir())
    final = run_dir / "final"
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()

    gen = subprocess.run([sys.executable, "tools/sample_policy.py", "--model", str(final), "--num", "16",
                          "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stdout[-3000:] + gen.stderr[-3000:]
    result = json.loads(gen.stdout.strip().splitlines()[-1])
    assert result["num_samples"] == 16 and result["mean_response_tokens"] > 0
    assert 0.0 <= result["accuracy"] <= 1.0

    # The same held-out evaluation as in training, on the saved policy: the run's config.yaml is
    # found from final/, so the data is the built-in task's held-out split, every problem once.
    ev = subprocess.run([sys.executable, "tools/evaluate.py", "--model", str(final), "--n", "2", "--json"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    metrics = json.loads(ev.stdout.strip().splitlines()[-1])
    assert metrics["config"] == str(run_dir / "config.yaml")
    assert 0.0 <= metrics["avg@2"] <= metrics["pass@2"] <= 1.0  # 0/1 rewards: avg@2 is pass@1
    assert metrics["num_prompts"] == len(all_problems(TinyTaskSpec(), "eval"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "3*4=", "answer": "12"}\n{"prompt": "3*5=", "solution": "15"}\n')
    ev = subprocess.run([sys.executable, "tools/evaluate.py", "--model", str(final), "--data", str(bad), "--json"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ev.returncode == 2, ev.stderr[-2000:]
    assert f"{bad}:2: no 'answer' field" in ev.stderr


@pytest.mark.parametrize("override, named", [
    ("buffer.token_budget=-5", "buffer.token_budget"),
    ("reward.type=import:asyncrl.no_such_module:score", "reward.type: reward function"),
    ("reward.by_source={gsm8k: answer_tagg}", "unknown verifier 'answer_tagg'"),
])
def test_bad_config_fails_fast_naming_the_field(override, named):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "launch/run.py", override], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr
    assert time.monotonic() - start < 60  # before Ray or any engine starts
