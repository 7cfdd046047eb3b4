"""The LM head's two options (algo/token_stats.py, learner/model_forward.py TokenHead): the one-pass
head (`recompute=False`, its backward in closed form) gives the checkpointed head's gradients in
float64; the float32 head computes outside bf16 autocast."""

import pytest
import torch

from asyncrl.algo.token_stats import token_logprobs_and_entropy_from_hidden
from asyncrl.learner.model_forward import TokenHead


def inputs(dtype=torch.float64, bias=True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 6, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(17, 6, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(17, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, 17, (10,), generator=g)
    temps = torch.linspace(0.6, 1.4, 10, dtype=dtype)
    up = (torch.randn(10, generator=g, dtype=dtype), torch.randn(10, generator=g, dtype=dtype))
    return hidden, weight, b, targets, temps, up


@pytest.mark.parametrize("temperature", ["per_token", 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_the_one_pass_head_gives_the_checkpointed_heads_values_and_gradients_in_float64(temperature, bias):
    results = []
    for recompute in (True, False):
        hidden, weight, b, targets, temps, (g_logp, g_ent) = inputs(bias=bias)
        t = temps if temperature == "per_token" else temperature
        logp, ent = token_logprobs_and_entropy_from_hidden(hidden, weight, targets, t, 3, b, recompute=recompute)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        results.append([logp.detach(), ent.detach(), hidden.grad, weight.grad] + ([b.grad] if bias else []))
    for a, c in zip(*results):
        torch.testing.assert_close(c, a, atol=1e-13, rtol=1e-11)
    assert results[0][2].abs().max() > 1e-3  # the gradients compared are not all zero


def test_the_one_pass_head_matches_a_hand_computed_entropy_gradient():
    """dH/du_j = -p_j (log p_j + H) and d log p_a / du_j = [j = a] - p_j, at temperature 1, from
    the definitions: one token, three logits, the head an identity."""
    u = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64)
    eye = torch.eye(3, dtype=torch.float64, requires_grad=True)
    logp, ent = token_logprobs_and_entropy_from_hidden(u, eye, torch.tensor([1]), 1.0, 4, recompute=False)
    (logp.sum() + 2.0 * ent.sum()).backward()
    p = torch.softmax(u[0], -1)
    h = -(p * p.log()).sum()
    expected = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64) - p - 2.0 * p * (p.log() + h)
    # the identity head's weight gradient is g_u^T u: its rows are g_u scaled by each u
    torch.testing.assert_close(eye.grad, expected[:, None] * u, atol=1e-15, rtol=1e-12)


def test_the_float32_head_runs_outside_bf16_autocast():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=False)
    hidden = torch.randn(32, 64)
    targets = torch.randint(0, 500, (32,))
    temps = torch.ones(32)
    exact = torch.log_softmax(hidden.double() @ head.weight.double().T, -1).gather(-1, targets[:, None]).squeeze(-1)
    token_head = TokenHead(head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32, _ = token_head(hidden, targets, temps, 8, fp32=True)
        bf16, _ = token_head(hidden, targets, temps, 8, fp32=False)
    assert (fp32.double() - exact).abs().max() < 1e-5
    assert (bf16.double() - exact).abs().max() > 1e-3  # what autocast's bf16 logits cost
