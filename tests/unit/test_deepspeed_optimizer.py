"""DeepSpeed's AdamW choice: torch's AdamW always (fused kernels on GPU), never DeepSpeed's
FusedAdam, whose JIT build needs nvcc and, on the H100 machine we ran on, failed on torch's "9.0a"
architecture string before compiling."""

import pytest

pytest.importorskip("deepspeed")

from asyncrl.config import LearnerConfig  # noqa: E402
from asyncrl.learner.deepspeed_backend import adamw_params  # noqa: E402


def test_torch_adamw_fused_on_gpu_and_plain_on_cpu():
    cfg = LearnerConfig(lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1)
    common = {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert adamw_params(cfg, on_gpu=True) == {**common, "torch_adam": True, "fused": True}
    assert adamw_params(cfg, on_gpu=False) == {**common, "torch_adam": True}
