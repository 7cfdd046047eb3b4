"""DeepSpeed's start on CPU compiles nothing: its communication backend would JIT-build a
shared-memory all-reduce op with g++ and ninja (25 s on 2 cores, then cached), which only its
inference all-reduce uses (learner/deepspeed_backend.py, `skip_inference_shm_op`). A one-rank
DeepSpeed learner backend starts in a fresh process whose torch-extensions directory stays empty."""

import os
import subprocess
import sys

START = """
import torch
from asyncrl.config import LearnerConfig
from asyncrl.learner.backend import init_process_group
from asyncrl.learner.deepspeed_backend import DeepSpeedBackend
from asyncrl.sync.wire import free_port

init_process_group(0, 1, f"127.0.0.1:{free_port('127.0.0.1')}", 60, local_host="127.0.0.1")  # as a rank joins
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
model.get_output_embeddings = lambda: model[0]
DeepSpeedBackend(model, LearnerConfig(backend="deepspeed"), world_size=1)
print("started")
"""


def test_a_deepspeed_backend_starts_on_cpu_without_building_an_op(tmp_path):
    extensions = tmp_path / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("started"), proc.stderr[-3000:]
    assert not extensions.exists() or not any(extensions.rglob("*")), sorted(extensions.rglob("*"))
