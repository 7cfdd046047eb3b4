"""tools/gpu_check.py end to end on CPU (`--cpu-smoke`: a tiny Qwen2, pytest only collecting), so
the script a lent GPU machine runs once cannot rot between its runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == summary  # one JSON line, the same
    assert summary["ok"] and summary["pytest"]["ok"] and summary["pytest_deepspeed"]["ok"]
    learner, packing = summary["learner"], summary["packing"]
    assert learner["param_dtypes"] == ["torch.float32"] and learner["compute_dtype"] == "bfloat16"
    assert learner["loss_tokens_per_step"] == 4 * 16 and learner["steps_timed"] == 2
    assert learner["loss_tokens_per_s"] > 0 and learner["mfu"] is None  # no peak on CPU
    # a step more, timed by phase: each phase took time, and together no more than the step
    assert set(learner["phase_s"]) == {"forward", "head", "backward", "optimizer"}
    assert all(t > 0 for t in learner["phase_s"].values())
    assert sum(learner["phase_s"].values()) <= learner["phase_step_s"]
    assert packing["engine_dtype"] == "torch.bfloat16"
    assert packing["num_bytes"] == 2 * learner["params"]  # every parameter once, cast to bf16
    assert (tmp_path / "gpu_check_pytest.txt").is_file()
    assert summary["calibrate"]["tflops"] > 0 and learner["mfu_calibrated"] > 0
    for head in ("fp32_head", "bf16_head"):  # bf16 autocast against float32: a gap, and a finite one
        assert 0 < summary["parity"][head]["max_abs"] < 1
    before, recipe, lora = summary["sweep"]["cases"]
    assert (before["case"], recipe["case"], lora["case"]) == ("rl_tiny_before", "rl_tiny_recipe", "rl_tiny_lora")
    # the LoRA recipe's learner: float32 adapters over a frozen bf16 base, packed as the recipe is
    assert lora["ok"] and lora["param_dtypes"] == ["torch.float32"] and lora["frozen_dtypes"] == ["torch.bfloat16"]
    assert 0 < lora["trainable_params"] < lora["params"] and lora["settings"]["lora"]["rank"] == 16
    assert lora["packed"] is True and lora["loss_tokens_per_s"] > 0
    assert recipe["trainable_params"] == recipe["params"] and recipe["frozen_dtypes"] == []
    assert before["packed"] is False and recipe["packed"] is True and recipe["padding_frac"] == 0.0
    assert recipe["settings"]["activation_checkpointing"] and not recipe["settings"]["recompute_head"]
    assert summary["sweep"]["recipe_vs_before_0.5b"] is None  # named for the GPU cases; the smoke has none
