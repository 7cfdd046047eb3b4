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
