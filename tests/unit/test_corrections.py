import math

import pytest
import torch

from asyncrl.algo.corrections import (
    BEHAVIOUR_WEIGHTS,
    POLICY_LOSSES,
    cispo_loss,
    gspo_loss,
    icepop_weight,
    m2po_loss,
    m2po_threshold,
    seq_tis_weight,
    token_tis_weight,
    unclipped_is_loss,
)

F64 = torch.float64


def _t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def _logp_and_old(log_ratios, old_prob=0.3):
    # a non-zero anchor, so a swapped logp / old shows
    old = _t([math.log(old_prob)] * len(log_ratios))
    logp = (old + _t(log_ratios)).detach().requires_grad_(True)
    return logp, old


def _torch_exp(x):
    # a bound that a ratio torch.exp(x) lands on exactly
    return float(torch.exp(_t([x]))[0])


def test_names():
    assert POLICY_LOSSES == ("ppo", "is", "cispo", "gspo", "m2po")
    assert BEHAVIOUR_WEIGHTS == ("token_tis", "seq_tis", "icepop", "none")


def test_unclipped_is_loss_has_no_clip():
    ratios, adv = [0.5, 2.0, 1.2], [1.0, -0.5, 2.0]
    logp, old = _logp_and_old([math.log(r) for r in ratios])
    loss, diag = unclipped_is_loss(logp, old, _t(adv))
    loss.sum().backward()
    # l = -r * A and d l / d logp = -r * A, even for r = 2 far outside any clip range
    expected = [-0.5, 1.0, -2.4]
    assert loss.tolist() == pytest.approx(expected, abs=1e-12)
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-12)
    assert diag["ratio"].tolist() == pytest.approx(ratios, abs=1e-12)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # pi_old = 0.4; pi_theta = 0.2, 0.36, 0.6, 0.6 -> r = 0.5, 0.9, 1.5, 1.5; eps 0.2 / 0.28
    probs, adv = [0.2, 0.36, 0.6, 0.6], [1.0, -2.0, 1.0, -1.0]
    logp = _t([math.log(p) for p in probs]).requires_grad_(True)
    old = _t([math.log(0.4)] * 4)
    loss, diag = cispo_loss(logp, old, _t(adv), 0.2, 0.28)
    loss.sum().backward()
    weights = [0.8, 0.9, 1.28, 1.28]  # clip(r, 0.8, 1.28)
    assert loss.tolist() == pytest.approx([-w * a * math.log(p) for w, a, p in zip(weights, adv, probs)], abs=1e-12)
    # d l / d logp = -clip(r) * A on every token: the weight carries no gradient, no token is dropped
    assert logp.grad.tolist() == pytest.approx([-0.8, 1.8, -1.28, 1.28], abs=1e-12)
    assert diag["ratio"].tolist() == pytest.approx([0.5, 0.9, 1.5, 1.5], abs=1e-12)
    # flags say the weight was clipped, whatever A's sign (the last token has A < 0)
    assert diag["clipped_low"].tolist() == [True, False, False, False]
    assert diag["clipped_high"].tolist() == [False, False, True, True]


def _gspo_example():
    # sequence 7 = tokens 0, 2, 4; sequence 3 = tokens 1, 3 (interleaved on purpose)
    log_ratios = [0.3, -0.1, -0.6, 0.5, 0.15]
    seq_ids = torch.tensor([7, 3, 7, 3, 7])
    adv = [1.0, 0.5, -1.0, -0.5, 2.0]
    return log_ratios, seq_ids, adv


def test_gspo_token_uses_the_sequence_ratio_with_per_token_gradient():
    log_ratios, seq_ids, adv = _gspo_example()
    logp, old = _logp_and_old(log_ratios)
    loss, diag = gspo_loss(logp, old, _t(adv), seq_ids, 0.04, 0.1)
    loss.sum().backward()
    s7 = math.exp((0.3 - 0.6 + 0.15) / 3)  # 0.951, below 1 - 0.04
    s3 = math.exp((-0.1 + 0.5) / 2)  # 1.221, above 1 + 0.1
    # t0: A>0, s7 < 0.96 -> min(s7, 0.96) = s7 (unclipped) | t1: A>0, s3 > 1.1 -> 1.1 * 0.5 (clipped)
    # t2: A<0 -> min(-s7, -0.96) = -0.96 (clipped) | t3: A<0 -> -s3 * 0.5 (unclipped) | t4: 2 * s7
    assert loss.tolist() == pytest.approx([-s7, -0.55, 0.96, 0.5 * s3, -2 * s7], abs=1e-12)
    # d l_t / d logp_t = -s_i * A_t where unclipped, 0 where clipped; no token's loss reaches another
    assert logp.grad.tolist() == pytest.approx([-s7, 0.0, 0.0, 0.5 * s3, -2 * s7], abs=1e-12)
    assert diag["ratio"].tolist() == pytest.approx([s7, s3, s7, s3, s7], abs=1e-12)
    assert diag["clipped_low"].tolist() == [False, False, True, False, False]
    assert diag["clipped_high"].tolist() == [False, True, False, False, False]


def test_gspo_each_token_gradient_is_its_own():
    log_ratios, seq_ids, adv = _gspo_example()
    logp, old = _logp_and_old(log_ratios)
    loss, _ = gspo_loss(logp, old, _t(adv), seq_ids, 0.5, 0.5)  # wide bounds: nothing clipped
    s7 = math.exp((0.3 - 0.6 + 0.15) / 3)
    (grad,) = torch.autograd.grad(loss[0], logp)
    # l_0 depends on logp_0 only (s_i is a stopped gradient): GSPO-token, not GSPO-sequence
    assert grad.tolist() == pytest.approx([-s7, 0.0, 0.0, 0.0, 0.0], abs=1e-12)


def test_gspo_does_not_depend_on_token_order_or_id_values():
    torch.manual_seed(0)
    seq_ids = torch.tensor([0, 1, 1, 2, 0, 2, 2, 1, 0, 0])
    old = torch.randn(10, dtype=F64) * 0.2 - 1.0
    logp = old + torch.randn(10, dtype=F64) * 0.3
    adv = torch.randn(10, dtype=F64)
    loss, diag = gspo_loss(logp, old, adv, seq_ids, 0.1, 0.15)
    perm = torch.randperm(10)
    loss_p, diag_p = gspo_loss(logp[perm], old[perm], adv[perm], seq_ids[perm] * 13 - 5, 0.1, 0.15)
    assert torch.allclose(loss_p, loss[perm], atol=1e-14, rtol=0)
    assert torch.allclose(diag_p["ratio"], diag["ratio"][perm], atol=1e-14, rtol=0)


def test_m2po_threshold_masks_exactly_the_two_largest():
    # squares 0.01, 0.25, 0.0025, 0.16, 0.04, 0: M2 = 0.4625 / 6 = 0.077 > 0.04
    # mask 0.25: 0.2125 / 5 = 0.0425 > 0.04; mask 0.16 too: 0.0525 / 4 = 0.0131 <= 0.04 -> stop
    logp, old = _logp_and_old([0.1, -0.5, 0.05, 0.4, -0.2, 0.0])
    log_ratio = (logp - old).detach()
    threshold = m2po_threshold(log_ratio, 0.04)
    assert threshold == pytest.approx(0.16, abs=1e-12)
    adv = [1.0, 1.0, -2.0, 1.0, 0.5, -1.0]
    loss, diag = m2po_loss(logp, old, _t(adv), threshold)
    loss.sum().backward()
    # the token exactly at the cut (0.4^2 == threshold) is masked: >= threshold
    assert diag["masked"].tolist() == [False, True, False, True, False, False]
    ratios = [math.exp(x) for x in [0.1, -0.5, 0.05, 0.4, -0.2, 0.0]]
    masked = [False, True, False, True, False, False]
    kept = [0.0 if m else -r * a for r, a, m in zip(ratios, adv, masked)]
    assert loss.tolist() == pytest.approx(kept, abs=1e-12)
    # kept tokens: unclipped d l / d logp = -r * A; masked tokens: exactly 0
    assert logp.grad.tolist() == pytest.approx(kept, abs=1e-12)
    assert logp.grad[1] == 0.0 and logp.grad[3] == 0.0
    assert diag["ratio"].tolist() == pytest.approx(ratios, abs=1e-12)


def test_m2po_threshold_masks_nothing_when_m2_fits():
    assert m2po_threshold(_t([0.1, -0.1, 0.05]), 0.04) == math.inf  # M2 = 0.0075
    # M2 exactly tau (0.25 and 0.125 are exact in binary): fits, since the stop is M2 <= tau
    assert m2po_threshold(_t([0.5, -0.5]), 0.25) == math.inf
    assert m2po_threshold(_t([0.5, -0.5, 0.0, 0.0]), 0.125) == math.inf
    assert m2po_threshold(_t([]), 0.04) == math.inf
    logp, old = _logp_and_old([0.5, -0.5])
    loss, diag = m2po_loss(logp, old, _t([1.0, 1.0]), math.inf)
    assert not diag["masked"].any()
    assert loss.tolist() == pytest.approx([-math.exp(0.5), -math.exp(-0.5)], abs=1e-12)


def test_m2po_masks_every_token_when_even_the_smallest_is_too_far():
    # squares 4, 2.25, 1: even 1 alone exceeds tau, so the cut is the smallest square (AReaL would keep one)
    assert m2po_threshold(_t([1.0, -1.5, 2.0]), 0.04) == pytest.approx(1.0, abs=1e-15)
    # a masked token's ratio is never exponentiated: exp(1000) would be inf and its gradient NaN
    logp, old = _logp_and_old([1000.0, 0.1])
    loss, diag = m2po_loss(logp, old, _t([1.0, 1.0]), 1.0)
    loss.sum().backward()
    assert diag["masked"].tolist() == [True, False]
    assert loss.tolist() == pytest.approx([0.0, -math.exp(0.1)], abs=1e-12)
    assert logp.grad.tolist() == pytest.approx([0.0, -math.exp(0.1)], abs=1e-12)


def test_token_tis_truncates_the_ratio():
    log_ratio = _t([math.log(0.5), math.log(2.0), math.log(3.0), 800.0]).requires_grad_(True)
    weight, capped = token_tis_weight(log_ratio, 2.5)
    # min(r, 2.5): 0.5, 2, 2.5, 2.5 (exp(800) overflows to inf and is still capped)
    assert weight.tolist() == pytest.approx([0.5, 2.0, 2.5, 2.5], abs=1e-12)
    assert capped.tolist() == [False, False, True, True]
    assert not weight.requires_grad


def test_seq_tis_multiplies_ratios_over_non_contiguous_sequences():
    seq_ids = torch.tensor([2, 5, 2, 5, 9])
    log_ratio = _t([math.log(1.5), math.log(0.5), math.log(0.8), math.log(3.0), 0.2])
    weight, capped = seq_tis_weight(log_ratio, seq_ids, 1.3)
    # seq 2: 1.5 * 0.8 = 1.2 | seq 5: 0.5 * 3 = 1.5 -> capped at 1.3 | seq 9: exp(0.2) = 1.2214
    assert weight.tolist() == pytest.approx([1.2, 1.3, 1.2, 1.3, math.exp(0.2)], abs=1e-12)
    assert capped.tolist() == [False, True, False, True, False]


def test_seq_tis_long_sequence_neither_overflows_nor_escapes_the_cap():
    # float32, 2000 tokens of log-ratio 0.5: the product exp(1000) overflows even float64
    seq_ids = torch.tensor([0] * 2000 + [1] * 2000)
    log_ratio = torch.cat([torch.full((2000,), 0.5), torch.full((2000,), -0.5)]).to(torch.float32)
    weight, capped = seq_tis_weight(log_ratio, seq_ids, 2.0)
    assert weight.dtype == torch.float32 and torch.isfinite(weight).all()
    assert weight[:2000].eq(2.0).all() and weight[2000:].eq(0.0).all()  # exp(-1000) underflows to 0
    assert capped[:2000].all() and not capped[2000:].any()


def test_seq_tis_sums_in_float64():
    # float32 inputs; a float32 running sum would lose the 1 against 2^24 and give exp(0) = 1
    log_ratio = _t([16777216.0, 1.0, -16777216.0], dtype=torch.float32)
    weight, _ = seq_tis_weight(log_ratio, torch.tensor([4, 4, 4]), 10.0)
    assert weight.tolist() == pytest.approx([math.e] * 3, rel=1e-6)


def test_icepop_keeps_the_ratio_inside_the_band_and_zeroes_it_outside():
    low, high = _torch_exp(math.log(0.5)), _torch_exp(math.log(5.0))
    log_ratio = _t([math.log(0.4), math.log(0.5), math.log(1.3), math.log(5.0), math.log(6.0)])
    weight, masked = icepop_weight(log_ratio, low, high)
    # r = 0.4 < 0.5 and 6 > 5 are masked; r exactly at either bound is kept
    assert weight.tolist() == pytest.approx([0.0, 0.5, 1.3, 5.0, 0.0], abs=1e-12)
    assert masked.tolist() == [True, False, False, False, True]


def test_argument_errors():
    x, ids = torch.zeros(3, dtype=F64), torch.tensor([0, 0, 1])
    short = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="1-D"):
        unclipped_is_loss(x, short, x)
    with pytest.raises(ValueError, match="1-D"):
        cispo_loss(x.view(1, 3), x.view(1, 3), x.view(1, 3), 0.2, 0.2)
    with pytest.raises(ValueError, match="eps"):
        cispo_loss(x, x, x, -0.1, 0.2)
    with pytest.raises(ValueError, match="eps"):
        gspo_loss(x, x, x, ids, 0.2, -0.1)
    with pytest.raises(ValueError, match="1-D"):
        gspo_loss(x, x, x, ids[:2], 0.2, 0.2)
    with pytest.raises(ValueError, match="integer"):
        gspo_loss(x, x, x, ids.to(F64), 0.2, 0.2)
    cispo_loss(x, x, x, 0.0, 0.0)  # eps = 0 is allowed: the weight is 1, plain REINFORCE
    with pytest.raises(ValueError, match="tau"):
        m2po_threshold(x, 0.0)
    with pytest.raises(ValueError, match="threshold"):
        m2po_loss(x, x, x, 0.0)
    for cap in (0.0, -1.0):
        with pytest.raises(ValueError, match="cap"):
            token_tis_weight(x, cap)
        with pytest.raises(ValueError, match="cap"):
            seq_tis_weight(x, ids, cap)
    for low, high in ((0.0, 2.0), (1.0, 2.0), (0.5, 1.0), (0.5, 0.8)):
        with pytest.raises(ValueError, match="low"):
            icepop_weight(x, low, high)
