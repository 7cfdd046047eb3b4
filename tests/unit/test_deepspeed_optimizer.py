"""DeepSpeed's AdamW choice: torch's AdamW on CPU and GPU, never DeepSpeed's FusedAdam (its JIT
build needs nvcc and, on the H100 machine we ran on, failed on torch's "9.0a" architecture string
before compiling) nor torch's fused kernel (under ZeRO it refused the CPU step counters there)."""

import pytest

pytest.importorskip("deepspeed")

from asyncrl.config import LearnerConfig  # noqa: E402
from asyncrl.learner.deepspeed_backend import adamw_params  # noqa: E402


def test_torch_adamw_with_the_configured_hyperparameters():
    cfg = LearnerConfig(lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1)
    assert adamw_params(cfg) == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                 "torch_adam": True}
