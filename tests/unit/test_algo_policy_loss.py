import math

import pytest
import torch

from asyncrl.algo.policy_loss import StepCounts, clipped_policy_loss, token_weights, weighted_sum

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _torch_exp(x):
    # the ratio is torch.exp(logp - old); build bounds from the very same float64 value
    return float(torch.exp(_t([x]))[0])


def _loss_and_grad(ratios, advantages, eps_low, eps_high, **kw):
    logp = _t([math.log(r) for r in ratios]).requires_grad_(True)
    loss, diag = clipped_policy_loss(logp, torch.zeros(len(ratios), dtype=F64), _t(advantages), eps_low, eps_high, **kw)
    loss.sum().backward()
    return loss.detach().tolist(), logp.grad.tolist(), diag


def test_both_sides_of_each_bound_with_both_signs():
    # eps 0.2 / 0.28; ratios below the low bound, inside, above the high bound; A = +-1.5
    ratios = [0.7, 0.7, 0.9, 0.9, 1.3, 1.3]
    adv = [1.5, -1.5, 1.5, -1.5, 1.5, -1.5]
    loss, grad, diag = _loss_and_grad(ratios, adv, 0.2, 0.28)
    # r=0.7,A>0: min(1.05, 1.2) = 1.05 | r=0.7,A<0: min(-1.05, -1.2) = -1.2 (clipped low)
    # r=0.9: inside | r=1.3,A>0: min(1.95, 1.92) = 1.92 (clipped high) | r=1.3,A<0: -1.95
    assert loss == pytest.approx([-1.05, 1.2, -1.35, 1.35, -1.92, 1.95], abs=1e-12)
    # gradient d loss / d logp = -r * A where unclipped, 0 where clipped
    assert grad == pytest.approx([-1.05, 0.0, -1.35, 1.35, 0.0, 1.95], abs=1e-12)
    assert diag["clipped_low"].tolist() == [False, True, False, False, False, False]
    assert diag["clipped_high"].tolist() == [False, False, False, False, True, False]


def test_ratio_exactly_at_each_bound_keeps_its_gradient():
    r_lo = _torch_exp(math.log(0.8))
    r_hi = _torch_exp(math.log(1.28))
    eps_low, eps_high = 1.0 - r_lo, r_hi - 1.0  # exact: 1 - eps_low == r_lo, 1 + eps_high == r_hi
    assert 1.0 - eps_low == r_lo and 1.0 + eps_high == r_hi
    ratios, adv = [r_lo, r_lo, r_hi, r_hi], [2.0, -2.0, 2.0, -2.0]
    loss, grad, diag = _loss_and_grad(ratios, adv, eps_low, eps_high)
    expected = [-r * a for r, a in zip(ratios, adv)]
    assert loss == pytest.approx(expected, abs=1e-12)
    assert grad == pytest.approx(expected, abs=1e-12)
    assert not diag["clipped_low"].any() and not diag["clipped_high"].any()


def test_dual_clip_caps_negative_advantage_terms():
    # c = 3, A = -1.5: cap 4.5. r = 4 -> -min(-6, -1.28*1.5) = 6 -> capped at 4.5, no gradient
    c = _torch_exp(math.log(3.0))  # the second token's ratio lands exactly on c
    ratios = [4.0, 3.0, 1.3, 4.0, 0.7]
    adv = [-1.5, -1.5, -1.5, 1.5, -1.5]
    loss, grad, diag = _loss_and_grad(ratios, adv, 0.2, 0.28, dual_clip=c)
    assert loss == pytest.approx([4.5, 4.5, 1.95, -1.92, 1.2], abs=1e-12)
    # r = 3 sits exactly at the cap: not counted, gradient kept (-r * A = 4.5)
    assert grad == pytest.approx([0.0, 4.5, 1.95, 0.0, 0.0], abs=1e-12)
    assert diag["clipped_dual"].tolist() == [True, False, False, False, False]
    with pytest.raises(ValueError):
        _loss_and_grad([1.0], [1.0], 0.2, 0.2, dual_clip=1.0)


def test_default_keywords_reproduce_plain_loss():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(20, dtype=F64), torch.randn(20, dtype=F64), torch.randn(20, dtype=F64)
    plain, plain_diag = clipped_policy_loss(logp, old, adv, 0.2, 0.28)
    same, diag = clipped_policy_loss(logp, old, adv, 0.2, 0.28, proximal_logprobs=None, dual_clip=None)
    assert torch.equal(plain, same) and set(diag) == set(plain_diag) == {"ratio", "clipped_low", "clipped_high"}
    # decoupled with pi_prox == pi_b and no cap is the plain loss too (w = 1)
    decoupled, _ = clipped_policy_loss(logp, old, adv, 0.2, 0.28, proximal_logprobs=old.clone())
    assert torch.allclose(decoupled, plain, atol=1e-15)


def test_decoupled_ratio_against_proximal_with_truncated_weight():
    # token 1: pi_b 0.5, pi_prox 0.6 (w = 1.2 -> capped at C = 1.1), pi_theta 0.72: rho = 1.2 vs prox
    #   (against pi_b it would be 1.44 and clipped); l = -1.2 * 1 * 1.1 = -1.32, grad -1.32
    # token 2: pi_b 0.5, pi_prox 0.45 (w = 0.9), pi_theta 0.675: rho = 1.5 > 1.28 -> -1.28 * 0.9
    # token 3: pi_b 0.5, pi_prox 0.5, pi_theta 0.35: rho = 0.7, A = -2 -> min(-1.4, -1.6) -> 1.6, w 1
    logp = _t([math.log(0.72), math.log(0.675), math.log(0.35)]).requires_grad_(True)
    old = _t([math.log(0.5)] * 3)
    prox = _t([math.log(0.6), math.log(0.45), math.log(0.5)])
    loss, diag = clipped_policy_loss(logp, old, _t([1.0, 1.0, -2.0]), 0.2, 0.28, proximal_logprobs=prox, is_weight_cap=1.1)
    loss.sum().backward()
    assert loss.tolist() == pytest.approx([-1.32, -1.152, 1.6], abs=1e-12)
    assert logp.grad.tolist() == pytest.approx([-1.32, 0.0, 0.0], abs=1e-12)
    assert diag["ratio"].tolist() == pytest.approx([1.2, 1.5, 0.7], abs=1e-12)
    assert diag["is_weight"].tolist() == pytest.approx([1.1, 0.9, 1.0], abs=1e-12)
    assert diag["is_weight_capped"].tolist() == [True, False, False]
    assert diag["clipped_high"].tolist() == [False, True, False]
    assert diag["clipped_low"].tolist() == [False, False, True]


def test_decoupled_argument_errors():
    x = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError):
        clipped_policy_loss(x, x, x, 0.2, 0.2, is_weight_cap=2.0)  # cap without pi_prox
    with pytest.raises(ValueError):
        clipped_policy_loss(x, x, x, 0.2, 0.2, proximal_logprobs=x, is_weight_cap=0.0)


def _grpo_reference(logp, old, adv, seq_ids, eps):
    """Skywork-OR1 eq. 2.4 (beta = 0) in a different form: A >= 0 -> A * min(r, 1 + eps),
    A < 0 -> A * max(r, 1 - eps); mean over tokens of each response, then over responses."""
    ratio = torch.exp(logp - old)
    surrogate = torch.where(adv >= 0, adv * torch.clamp(ratio, max=1 + eps), adv * torch.clamp(ratio, min=1 - eps))
    per_seq = [surrogate[seq_ids == s].mean() for s in seq_ids.unique()]
    return -torch.stack(per_seq).mean()


def test_grpo_equals_clip_higher_loss_with_equal_bounds():
    torch.manual_seed(1)
    lengths = [3, 5, 1, 4]
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    old = torch.randn(seq_ids.numel(), dtype=F64) * 0.3
    adv = torch.randn(len(lengths), dtype=F64)[seq_ids]
    logp = (old + torch.randn(seq_ids.numel(), dtype=F64) * 0.4).requires_grad_(True)
    for eps in (0.1, 0.2, 0.3):
        ref = _grpo_reference(logp, old, adv, seq_ids, eps)
        (ref_grad,) = torch.autograd.grad(ref, logp)
        per_token, _ = clipped_policy_loss(logp, old, adv, eps, eps)
        seq_len = torch.tensor(lengths)[seq_ids]
        weights = token_weights("seq_mean_token_mean", seq_len, StepCounts.from_sequence_lengths(lengths), F64)
        ours = weighted_sum(per_token, weights)
        (our_grad,) = torch.autograd.grad(ours, logp)
        assert float(ours.detach()) == pytest.approx(float(ref.detach()), abs=1e-12)
        assert torch.allclose(our_grad, ref_grad, atol=1e-12)
