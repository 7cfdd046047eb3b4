"""The learner on a GPU (CUDA, NCCL): deselected where there is none (tests/conftest.py).

One rank, since NCCL refuses two ranks on one GPU: the torch backend in fp32 gives the CPU
gradient, DeepSpeed ZeRO-2 and ZeRO-3 (their own fused Adam, an NCCL group of one) give the torch
backend's gradient and update, and a bf16 step runs and moves the loss.
"""

import pytest
import torch

from test_learner_ranks import MODES, STEPS, assert_close, run_rank

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from test_learner_ranks import build_model

    return build_model(tmp_path_factory.mktemp("model"), tie=False)


@pytest.fixture(scope="module")
def torch_cuda(model):
    return run_rank(0, 1, None, model, "torch", 2)


def test_cuda_gradient_equals_the_cpu_gradient(model, torch_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the learner picks its device by this
    cpu = run_rank(0, 1, None, model, "torch", 2)
    for mode in MODES:
        assert_close(torch_cuda["grads"][mode], cpu["grads"][mode], f"cuda vs cpu, {mode}", tol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_cuda_matches_the_torch_backend(model, torch_cuda, stage):
    ds = run_rank(0, 1, None, model, "deepspeed", stage)  # joins a one-rank NCCL group
    for mode in MODES:
        assert_close(ds["grads"][mode], torch_cuda["grads"][mode], f"zero-{stage} on cuda, {mode}", tol=1e-5)
    assert_close(ds["params"], torch_cuda["params"], f"zero-{stage} on cuda after {STEPS} steps", tol=1e-5)
