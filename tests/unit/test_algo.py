import math

import pytest
import torch

from asyncrl.algo.advantages import group_advantages, is_zero_variance
from asyncrl.algo.aggregation import StepCounts, token_weights, weighted_sum
from asyncrl.algo.policy_loss import clipped_policy_loss
from asyncrl.algo.token_stats import token_logprobs_and_entropy


def test_clipped_loss_matches_hand_computed_values():
    # token: (logp, old, adv) -> ratio; eps_low 0.2, eps_high 0.28
    logp = [math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7), math.log(1.28)]
    old = [0.0] * 5
    adv = [2.0, -1.0, -3.0, 0.5, 1.0]
    # 1: r=1.5, A>0 -> min(3.0, 1.28*2=2.56) = 2.56 -> loss -2.56 (clipped high)
    # 2: r=0.5, A<0 -> min(-0.5, 0.8*-1=-0.8) = -0.8 -> loss 0.8 (clipped low)
    # 3: r=1.1, A<0 -> min(-3.3, -3.3) -> loss 3.3
    # 4: r=0.7, A>0 -> min(0.35, 0.8*0.5=0.4) = 0.35 -> loss -0.35 (not clipped: pessimistic side)
    # 5: r=1.28 exactly at the upper bound -> loss -1.28, not counted as clipped
    expected = [-2.56, 0.8, 3.3, -0.35, -1.28]
    loss, diag = clipped_policy_loss(torch.tensor(logp, dtype=torch.float64), torch.tensor(old, dtype=torch.float64),
                                     torch.tensor(adv, dtype=torch.float64), 0.2, 0.28)
    assert loss.tolist() == pytest.approx(expected, abs=1e-12)
    assert diag["clipped_high"].tolist() == [True, False, False, False, False]
    assert diag["clipped_low"].tolist() == [False, True, False, False, False]


def test_clipped_term_has_zero_gradient_and_unclipped_has_ratio_times_adv():
    logp = torch.tensor([math.log(1.5), math.log(1.1)], dtype=torch.float64, requires_grad=True)
    loss, _ = clipped_policy_loss(logp, torch.zeros(2, dtype=torch.float64),
                                  torch.tensor([2.0, 2.0], dtype=torch.float64), 0.2, 0.28)
    loss.sum().backward()
    # d/dlogp of -r*A = -r*A for the unclipped token (r = 1.1), 0 for the clipped one
    assert logp.grad.tolist() == pytest.approx([0.0, -2.2], abs=1e-12)


def test_budget_aggregation_divides_by_phi_whatever_the_split():
    per_token = torch.arange(10, dtype=torch.float64)
    counts = StepCounts(num_tokens=10, num_sequences=2, token_budget=16)
    w = token_weights("budget", torch.full((10,), 5), counts, dtype=torch.float64)
    whole = weighted_sum(per_token, w)
    parts = weighted_sum(per_token[:3], w[:3]) + weighted_sum(per_token[3:], w[3:])
    assert float(whole) == pytest.approx(45 / 16) and float(parts) == pytest.approx(45 / 16)
    tm = token_weights("token_mean", torch.full((10,), 5), counts, dtype=torch.float64)
    assert float(weighted_sum(per_token, tm)) == pytest.approx(45 / 10)
    with pytest.raises(ValueError):
        token_weights("nope", torch.full((10,), 5), counts)


def test_logprobs_and_entropy_match_direct_float64_computation():
    torch.manual_seed(0)
    logits = torch.randn(7, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (7,))
    logp, ent = token_logprobs_and_entropy(logits, targets, temperature=0.7, chunk=3)
    for t in range(7):
        z = [float(x) / 0.7 for x in logits[t]]
        m = max(z)
        lse = m + math.log(sum(math.exp(v - m) for v in z))
        probs = [math.exp(v - lse) for v in z]
        assert float(logp[t]) == pytest.approx(z[int(targets[t])] - lse, abs=1e-6)
        assert float(ent[t]) == pytest.approx(-sum(p * (v - lse) for p, v in zip(probs, z)), abs=1e-6)


def test_grpo_advantages_hand_computed():
    adv = group_advantages([1.0, 0.0, 1.0, 0.0], "grpo", eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0])
    assert group_advantages([3.0, 1.0], "drgrpo") == pytest.approx([1.0, -1.0])
    assert is_zero_variance([0.5, 0.5, 0.5]) and is_zero_variance([1.0])
    assert not is_zero_variance([0.0, 1.0])
    with pytest.raises(ValueError):
        group_advantages([], "grpo")
