"""The learner on a GPU (CUDA, NCCL): deselected where there is none (tests/conftest.py).

One rank, since NCCL refuses two ranks on one GPU: the torch backend in fp32 gives the CPU
gradient, DeepSpeed ZeRO-2 and ZeRO-3 (an NCCL group of one; FusedAdam when nvcc can build it,
else torch's fused AdamW) give the torch backend's gradient and update, and bf16 compute over
float32 master weights gives nearly the fp32 gradient and moves the masters.
"""

import pytest
import torch

from test_learner_ranks import BF16, F32, LR, MODES, STEPS, assert_close, relative_error, run_rank

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from test_learner_ranks import build_model

    return build_model(tmp_path_factory.mktemp("model"), tie=False)


@pytest.fixture(scope="module")
def torch_cuda(model):
    return run_rank(0, 1, None, model, "torch", 2, precision=F32)


def test_cuda_gradient_equals_the_cpu_gradient(model, torch_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the learner picks its device by this
    cpu = run_rank(0, 1, None, model, "torch", 2, precision=F32)
    for mode in MODES:
        assert_close(torch_cuda["grads"][mode], cpu["grads"][mode], f"cuda vs cpu, {mode}", tol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_bf16_compute_keeps_fp32_masters_on_cuda(model, torch_cuda, backend):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    bf16 = run_rank(0, 1, None, model, backend, 2, precision=BF16)
    for mode in MODES:  # bf16 keeps ~3 significant digits: close to, not equal to, the fp32 gradient
        assert relative_error(bf16["grads"][mode], torch_cuda["grads"][mode]) < 5e-2, mode
    assert all(t.dtype == torch.float32 for t in bf16["params"].values())  # the masters, not bf16 copies
    moved = max(float((bf16["params"][n] - bf16["start"][n]).abs().max()) for n in bf16["start"])
    assert moved > 1e-3  # lr 1e-3, 3 steps


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_cuda_matches_the_torch_backend(model, torch_cuda, stage):
    pytest.importorskip("deepspeed")
    ds = run_rank(0, 1, None, model, "deepspeed", stage, precision=F32)  # joins a one-rank NCCL group
    for mode in MODES:
        assert_close(ds["grads"][mode], torch_cuda["grads"][mode], f"zero-{stage} on cuda, {mode}", tol=1e-5)
    assert_close(ds["params"], torch_cuda["params"], f"zero-{stage} on cuda after {STEPS} steps",
                 F32.param_tol(STEPS, LR))
