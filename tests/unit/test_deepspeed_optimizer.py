"""DeepSpeed's AdamW choice: its FusedAdam JIT-builds a CUDA op with nvcc, so on a GPU without
the CUDA toolkit the backend asks for torch's fused AdamW instead (no compiler needed)."""

import pytest

pytest.importorskip("deepspeed")

from asyncrl.config import LearnerConfig  # noqa: E402
from asyncrl.learner.deepspeed_backend import adamw_params, has_nvcc  # noqa: E402


def test_fused_adam_only_where_nvcc_can_build_it():
    cfg = LearnerConfig(lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1)
    common = {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert adamw_params(cfg, on_gpu=True, nvcc=True) == {**common, "torch_adam": False}
    assert adamw_params(cfg, on_gpu=True, nvcc=False) == {**common, "torch_adam": True, "fused": True}
    assert adamw_params(cfg, on_gpu=False, nvcc=True) == {**common, "torch_adam": True}  # CPU: torch's


def test_nvcc_is_looked_for_on_path_and_in_cuda_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert not has_nvcc()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert has_nvcc()
