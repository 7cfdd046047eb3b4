import math

import pytest
import torch

from asyncrl.algo.kl import should_reset_reference, token_kl

F64 = torch.float64


def test_estimators_by_hand():
    # pi_theta 0.5, pi_ref 0.25: d = log(ref / theta) = -log 2
    # pi_theta 0.25, pi_ref 0.5: d = +log 2
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=F64)
    ref = torch.tensor([math.log(0.25), math.log(0.5)], dtype=F64)
    ln2 = math.log(2.0)
    assert token_kl(logp, ref, "k1").tolist() == pytest.approx([ln2, -ln2], abs=1e-15)
    assert token_kl(logp, ref, "k2").tolist() == pytest.approx([ln2**2 / 2, ln2**2 / 2], abs=1e-15)
    # k3 = ref/theta - log(ref/theta) - 1: 0.5 + ln2 - 1, 2 - ln2 - 1
    assert token_kl(logp, ref, "k3").tolist() == pytest.approx([ln2 - 0.5, 1 - ln2], abs=1e-15)
    assert token_kl(logp, logp, "k3").tolist() == [0.0, 0.0]


def test_k3_is_nonnegative_including_tiny_log_ratios():
    d = torch.cat([torch.linspace(-20, 20, 2001, dtype=F64),
                   torch.tensor([1e-300, -1e-300, 1e-20, -1e-20, 1e-9, -1e-9, 0.0], dtype=F64)])
    logp = torch.zeros_like(d)
    assert (token_kl(logp, d, "k3") >= 0).all()
    assert (token_kl(logp.float(), d.float(), "k3") >= 0).all()
    assert (token_kl(logp, d, "k2") >= 0).all()


@pytest.mark.parametrize("p,q", [
    ([0.5, 0.3, 0.2], [0.2, 0.3, 0.5]),
    ([0.9, 0.05, 0.05], [1 / 3, 1 / 3, 1 / 3]),
    ([0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]),
])
def test_expected_k1_and_k3_equal_the_analytic_kl(p, q):
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    logp = torch.tensor([math.log(x) for x in p], dtype=F64)
    logq = torch.tensor([math.log(x) for x in q], dtype=F64)
    probs = torch.tensor(p, dtype=F64)
    # exact expectation over a ~ pi_theta of each token's estimate
    assert float((probs * token_kl(logp, logq, "k3")).sum()) == pytest.approx(kl, abs=1e-12)
    assert float((probs * token_kl(logp, logq, "k1")).sum()) == pytest.approx(kl, abs=1e-12)
    # and a sampled batch: mean k3 within 4 standard errors of the KL
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(probs, 20000, replacement=True, generator=g)
    k3 = token_kl(logp[idx], logq[idx], "k3")
    assert abs(float(k3.mean()) - kl) < 4 * float(k3.std()) / math.sqrt(20000)


def test_k2_is_second_order_close_for_nearby_policies():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.501, 0.299, 0.2], dtype=F64)
    kl = float((p * (p / q).log()).sum())
    k2 = float((p * token_kl(p.log(), q.log(), "k2")).sum())
    assert abs(k2 - kl) < 1e-8


def test_errors():
    with pytest.raises(ValueError):
        token_kl(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError):
        token_kl(torch.zeros(2), torch.zeros(2), "k4")


@pytest.mark.parametrize("kwargs,expected", [
    (dict(step=10, kl=0.0, every_k=5), (True, "every_k")),
    (dict(step=11, kl=0.0, every_k=5), (False, "")),
    (dict(step=0, kl=0.0, every_k=5), (False, "")),
    (dict(step=3, kl=0.2, kl_threshold=0.1), (True, "kl_threshold")),
    (dict(step=3, kl=0.1, kl_threshold=0.1), (False, "")),  # at the threshold: no reset
    (dict(step=3, kl=0.0, requested=True), (True, "requested")),
    (dict(step=10, kl=0.5, every_k=5, kl_threshold=0.1, requested=True), (True, "requested")),
    (dict(step=10, kl=0.5, every_k=5, kl_threshold=0.1), (True, "kl_threshold")),
    (dict(step=10, kl=0.5), (False, "")),
])
def test_should_reset_reference(kwargs, expected):
    assert should_reset_reference(**kwargs) == expected


def test_should_reset_reference_rejects_bad_period():
    with pytest.raises(ValueError):
        should_reset_reference(5, 0.0, every_k=0)


def test_k3_log_ratio_is_clamped_at_20_like_verl_value_and_gradient():
    """float32, d = ref - logp = 100: exp(d) is inf in float32, so unclamped k3 is inf and its
    gradient NaN. Clamped at 20 (verl's low_var_kl): k3 = e^20 - 20 - 1, gradient 0 (the clamp
    stops it). Inside the bound, value and gradient are the plain formula's: d = 3 gives
    e^3 - 4 and dk3/dlogp = -(e^3 - 1); d = -25 (below -20) gives e^-20 + 19, gradient 0."""
    logp = torch.tensor([0.0, -2.0, -1.0], dtype=torch.float32, requires_grad=True)
    ref = torch.tensor([100.0, 1.0, -26.0], dtype=torch.float32)
    k3 = token_kl(logp, ref, "k3")
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(logp.grad).all()
    want = [math.exp(20) - 21, math.exp(3) - 4, math.exp(-20) + 19]
    assert k3.tolist() == pytest.approx(want, rel=1e-6)
    assert logp.grad.tolist() == pytest.approx([0.0, -(math.exp(3) - 1), 0.0], rel=1e-6, abs=0)
    # float64, by hand at the bound's edges: the clamp does not touch |d| <= 20
    lp = torch.zeros(2, dtype=F64, requires_grad=True)
    k = token_kl(lp, torch.tensor([20.0, -20.0], dtype=F64), "k3")
    k.sum().backward()
    assert k.tolist() == pytest.approx([math.exp(20) - 21, math.exp(-20) + 19], rel=1e-15)
    assert lp.grad.tolist() == pytest.approx([-(math.exp(20) - 1), -(math.exp(-20) - 1)], rel=1e-15)
    from asyncrl.algo.kl import KL_LOG_RATIO_CLAMP

    assert KL_LOG_RATIO_CLAMP == 20.0


def test_grad_cap_clips_each_tokens_gradient_and_keeps_the_value():
    # d = ref - logp = [8, 0.5, -1]; k3 = e^d - d - 1, gradient wrt logp = 1 - e^d
    logp = torch.tensor([-9.0, -1.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -0.5, -1.5], dtype=torch.float64)
    kl = token_kl(logp, ref, "k3", grad_cap=10.0)
    want = [math.exp(d) - d - 1 for d in (8.0, 0.5, -1.0)]
    assert kl.detach().tolist() == pytest.approx(want, rel=1e-12)
    kl.sum().backward()
    # uncapped: 1 - e^8 = -2979.96; 1 - e^0.5 = -0.6487; 1 - e^-1 = 0.6321
    assert logp.grad.tolist() == pytest.approx([-10.0, 1 - math.exp(0.5), 1 - math.exp(-1.0)], rel=1e-12)
    # k2: value d^2 / 2, gradient -d, capped at 1
    logp2 = logp.detach().clone().requires_grad_(True)
    k2 = token_kl(logp2, ref, "k2", grad_cap=1.0)
    assert k2.detach().tolist() == pytest.approx([32.0, 0.125, 0.5], rel=1e-12)
    k2.sum().backward()
    assert logp2.grad.tolist() == pytest.approx([-1.0, -0.5, 1.0], rel=1e-12)
    with pytest.raises(ValueError, match="grad_cap"):
        token_kl(logp, ref, "k3", grad_cap=0.0)
