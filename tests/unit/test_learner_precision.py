"""Mixed precision in the torch backend: float32 master weights under bf16 autocast keep updates
that pure bf16 loses, and compute nearly the float32 step's loss and gradient.

Hand check: Adam's first step moves every weight by lr * g / (|g| + eps) = lr (1e-6 here) against
the gradient's sign. A bf16 weight w with |w| > 2^-11 has neighbours at least 2^-18 away on both
sides, so half that (2^-19 = 1.9e-6) exceeds the update and rounding to nearest gives w back: pure
bf16 cannot move it. (At |w| = 2^-11 exactly the neighbour towards zero is only 2^-19 away.)
"""

import random

import pytest
import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.config import AlgoConfig, ConfigError, LearnerConfig, load_config
from asyncrl.learner.collate import collate
from asyncrl.learner.model_forward import policy_forward
from asyncrl.learner.policy_step import forward_backward
from asyncrl.learner.torch_backend import TorchBackend
from asyncrl.types import SequenceChunk

LR = 1e-6
BF16_SAFE = 2.0**-11  # |w| above it: half the gap to either bf16 neighbour > LR


def tiny_model(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def chunks():
    rng = random.Random(0)
    out = []
    for i in range(4):
        prompt = [rng.randrange(4, 64) for _ in range(5)]
        resp = [rng.randrange(4, 64) for _ in range(6 + i)]
        out.append(SequenceChunk(f"g{i}", 0, prompt, resp, 0, [rng.uniform(-5, -3) for _ in resp], [0] * len(resp),
                                 advantage=1.0 if i % 2 else -1.0))
    return out


def accumulate(backend: TorchBackend):
    """One step's forward/backward through the learner's policy step; returns its metrics."""
    cs = chunks()
    counts = StepCounts(sum(c.num_loss_tokens for c in cs), len(cs))

    def forward(mb):
        with backend.autocast():
            return policy_forward(backend.module, mb, 1024, torch.device("cpu"))

    return forward_backward(forward, [collate(cs)], AlgoConfig(aggregation="token_mean"), counts,
                            backward=backend.backward)


def one_step(model, compute_dtype):
    backend = TorchBackend(model, LearnerConfig(lr=LR, grad_clip=1e6), 1, compute_dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    accumulate(backend)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    backend.step(1e6)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return before, grads, after


def test_fp32_masters_keep_an_update_below_a_bf16_ulp():
    before, grads, after = one_step(tiny_model(torch.float32), torch.bfloat16)
    moved = total = 0
    for name, w0 in before.items():
        g, w1 = grads[name], after[name]
        assert w1.dtype == g.dtype == torch.float32  # masters and their gradients stay float32
        big = g.abs() > 1e-4  # eps = 1e-8 is negligible: the update is lr * sign(g)
        expected = w0 - LR * torch.sign(g)
        # float32 rounding of w0 - lr (half a float32 ulp: 6e-8 |w|), and the eps term (< 1e-10)
        tol = 1e-9 + 1.2e-7 * w0.abs()
        assert bool(((w1 - expected).abs() <= tol)[big].all()), name
        moved += int((w1 != w0).sum())
        total += w0.numel()
    assert moved / total > 0.95


def test_pure_bf16_loses_the_same_update():
    model = tiny_model(torch.bfloat16)
    before, grads, after = one_step(model, None)  # parameters and compute both bf16
    safe = frozen = 0
    for name, w0 in before.items():
        mask = (w0.float().abs() > BF16_SAFE) & (grads[name] != 0)
        safe += int(mask.sum())
        frozen += int((after[name][mask] == w0[mask]).sum())
    assert safe > 0.9 * sum(w.numel() for w in before.values())  # the check covers most weights
    assert frozen == safe  # none of them moved: every step rounded back to the old weight


def test_bf16_autocast_step_is_close_to_the_fp32_step():
    fp32 = TorchBackend(tiny_model(torch.float32), LearnerConfig(lr=LR), 1)
    mixed = TorchBackend(tiny_model(torch.float32), LearnerConfig(lr=LR), 1, torch.bfloat16)
    assert mixed.compute_dtype == torch.bfloat16 and fp32.compute_dtype is None
    m32, mbf = accumulate(fp32), accumulate(mixed)
    assert mbf["loss/total"] == pytest.approx(m32["loss/total"], rel=2e-2, abs=1e-3)
    g32 = torch.cat([p.grad.flatten() for p in fp32.module.parameters()])
    gbf = torch.cat([p.grad.flatten() for p in mixed.module.parameters()])
    assert gbf.dtype == torch.float32
    assert float((gbf - g32).norm() / g32.norm()) < 5e-2  # bf16 has ~3 significant digits
    assert float(torch.nn.functional.cosine_similarity(gbf, g32, dim=0)) > 0.998


@pytest.mark.parametrize("overrides, field", [
    (["model.dtype=float32", "learner.param_dtype=bfloat16"], "learner.param_dtype"),
    (["model.dtype=float16"], "model.dtype"),
    (["model.dtype=bfloat16", "learner.param_dtype=bfloat16", "learner.backend=deepspeed"], "learner.param_dtype"),
])
def test_bad_dtype_combinations_fail_at_load(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_mixed_precision_is_the_bf16_default():
    cfg = load_config(None, ["model.dtype=bfloat16"])
    assert cfg.learner.param_dtype == "float32"  # masters unless asked otherwise
    assert load_config(None, ["model.dtype=bfloat16", "learner.param_dtype=bfloat16"]).learner.param_dtype == "bfloat16"
