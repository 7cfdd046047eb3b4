"""Durable runs through the real entry point: SIGTERM at step k, or SIGKILL of the driver, then
resume=auto, gives the same steps, losses, rewards and final parameters as a run never
interrupted (fake engine, synchronous rollout batches, CPU: bit for bit); an incompatible resume
exits 2 naming the field."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
# Synchronous rollout batches (D_R 4 groups, D_T 2 per step, staleness 0): what a step trains on
# does not depend on timing, so two runs can be compared bit for bit.
ARGS = ["rollout.engine=fake", f"total_steps={STEPS}", "buffer.token_budget=32", "buffer.max_staleness=0",
        "buffer.rollout_batch_prompts=4", "buffer.minibatch_prompts=2", "rollout.group_size=4",
        "rollout.max_tokens=8", "algo.drop_zero_variance_groups=false", "observe.console=lines",
        "observe.tensorboard=false", "checkpoint.every_steps=3", "ray.num_cpus=3",
        # a deterministic stand-in verifier with mixed rewards, so the losses are not all zero
        "reward.type=import:asyncrl.reward.fault_injection:by_response_hash"]
LORA = ["learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=3e-3"]  # adapters on every linear layer
COMPARED = ("reward/mean", "reward/num_samples", "loss/total", "loss/policy", "learner/grad_norm",
            "learner/loss_tokens", "entropy/learner", "learner/version")


def uninterrupted(out, name, model, *extra):
    plain = launch(out, name, model, *extra)
    log, _ = plain.communicate(timeout=600)
    assert plain.returncode == 0, log[-3000:]
    return out / name


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, small_model):
    """The uninterrupted run (checkpoints at steps 3 and 6), shared by both tests here."""
    return uninterrupted(tmp_path_factory.mktemp("runs"), "plain", small_model)


def launch(out, name, model, *extra):
    given = {e.split("=", 1)[0] for e in extra}  # a field may be given once: extra replaces ARGS
    base = [a for a in ARGS if a.split("=", 1)[0] not in given]
    cmd = [sys.executable, "launch/run.py", *base, f"model.path={model}", f"name={name}",
           f"observe.output_dir={out}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def events(run_dir):
    """The run's events without their wall-clock `time` (checked to be there)."""
    out = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert all(isinstance(e.pop("time"), float) for e in out)
    return out


def resume_and_compare(out_dir, name, model, plain_run, from_step, *extra, weights="model.safetensors") -> str:
    """resume=auto of run `name`, which must continue at `from_step` and end with the rows and final
    parameters (final/`weights`) of the uninterrupted run; its console output."""
    again = launch(out_dir, name, model, "resume=auto", *extra)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-3000:]
    assert f"at step {from_step}" in out
    want, got = rows(plain_run), rows(out_dir / name)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        assert {k: a.get(k) for k in COMPARED} == {k: b.get(k) for k in COMPARED}, a["step"]
    a = load_file(plain_run / "final" / weights)
    b = load_file(out_dir / name / "final" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return out


def interrupt(tmp_path, name, model, *extra) -> int:
    """Run `name` stopped by SIGTERM once 4 steps are done; the step it stopped at."""
    run_dir = tmp_path / name
    cut = launch(tmp_path, name, model, *extra)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not ((run_dir / "metrics.jsonl").exists() and len(rows(run_dir)) >= 4):
        time.sleep(0.05)
    t_signal = time.monotonic()
    cut.send_signal(signal.SIGTERM)
    out, _ = cut.communicate(timeout=120)
    assert time.monotonic() - t_signal < 60
    assert cut.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped_at = len(rows(run_dir))
    assert 4 <= stopped_at < STEPS, "the signal came too late to test a resume"
    assert events(run_dir)[-1] == {"step": stopped_at, "event": "end", "status": "interrupted", "reason": "SIGTERM"}
    assert (run_dir / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").exists()
    return stopped_at


def test_sigterm_then_resume_equals_the_uninterrupted_run(tmp_path, small_model, plain_run):
    run_dir = tmp_path / "cut"
    stopped_at = interrupt(tmp_path, "cut", small_model)
    out = resume_and_compare(tmp_path, "cut", small_model, plain_run, stopped_at)
    want = rows(plain_run)
    assert any(r["loss/total"] != 0 for r in want) and all(r.get("reward/num_samples") is not None for r in want)
    assert [e["event"] for e in events(run_dir)].count("resume") == 1
    # the summary's time is the whole run's, the part before the signal included
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_at_step"] == stopped_at and summary["wall_s"] > summary["wall_s_since_resume"] > 0
    assert f"s since the resume at step {stopped_at})" in out


def test_a_driver_killed_with_sigkill_resumes_from_its_newest_checkpoint_as_if_never_killed(
        tmp_path, small_model, plain_run):
    """No handler runs: what survives is the newest checkpoint (every 3 steps). The resume loses
    at most those steps, rewrites their rows, and trains nothing twice: the same rows and final
    parameters as the uninterrupted run."""
    run_dir = tmp_path / "killed"
    killed = launch(tmp_path, "killed", small_model)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not ((run_dir / "metrics.jsonl").exists() and len(rows(run_dir)) >= 5):
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    rows_at_kill = len(rows(run_dir))
    assert 5 <= rows_at_kill < STEPS, "the kill came too late to test a resume"
    newest = max(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
    assert rows_at_kill - newest <= 3  # checkpoint.every_steps

    resume_and_compare(tmp_path, "killed", small_model, plain_run, newest)


def test_resume_with_another_model_exits_2_naming_the_field(tmp_path, plain_run):
    # a copy of the shared run: its checkpoints were written with small_model
    shutil.copytree(plain_run, tmp_path / "r")
    proc = subprocess.run([sys.executable, "launch/run.py", *ARGS, f"observe.output_dir={tmp_path}", "name=r",
                           "model.path=builtin:tiny", "resume=auto"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model.path" in proc.stderr


def test_a_lora_run_resumes_from_its_adapter_as_if_never_stopped(tmp_path, small_model):
    """learner.lora: the checkpoint holds the adapter (peft's files) and its optimizer state; the
    resumed run's rows and final adapter are the uninterrupted run's, bit for bit."""
    plain = uninterrupted(tmp_path / "plain", "plain-lora", small_model, *LORA)
    stopped_at = interrupt(tmp_path, "cut-lora", small_model, *LORA)
    policy = tmp_path / "cut-lora" / "checkpoints" / f"step_{stopped_at}" / "learner" / "policy"
    assert (policy / "adapter_config.json").is_file() and not (policy / "model.safetensors").exists()
    resume_and_compare(tmp_path, "cut-lora", small_model, plain, stopped_at, *LORA,
                       weights="adapter_model.safetensors")
    assert rows(plain)[-1]["learner/trainable_params"] < 0.2 * sum(
        t.numel() for t in load_file(Path(small_model) / "model.safetensors").values())
