"""Calibration of the twin (asyncrl/twin/calibrate.py, plan.keep_fraction) on hand values."""

import math

import pytest

from asyncrl.twin.calibrate import fit_engine, fit_pass_rates, learner_contention, logit_drift, schedule_sums
from asyncrl.twin.capacity import keep_fraction


def test_keep_fraction_of_beta_pass_rates():
    # Beta(1, 1), groups of 2: P(both right) = E[p^2] = 1/3, P(both wrong) = 1/3
    assert keep_fraction(1, 1, 2) == pytest.approx(1 / 3)
    # Beta(2, 1), groups of 3: E[p^3] = 2*3*4 / (3*4*5) = 0.4; E[(1-p)^3] = 1*2*3 / (3*4*5) = 0.1
    assert keep_fraction(2, 1, 3) == pytest.approx(0.5)


def test_schedule_sums_of_a_batch():
    # 3 requests of 2, 4 and 4 tokens on an engine of 2 sequences: steps 1-2 run 2 (the 2-token
    # one ends), then 4 and the third run 2 more (the first 4-token one ends at step 4), then the
    # third runs alone 2 steps: 6 steps, 2+2+2+2+1+1 = 10 batch-steps, 3 requests
    assert schedule_sums([5, 5, 5], [2, 4, 4], max_num_seqs=2, kv_tokens=1000) == (6.0, 10.0, 3.0)


def test_fit_engine_recovers_the_constants():
    truth = lambda s, b, n: 0.002 * s + 0.0001 * b + 0.0005 * n  # noqa: E731
    shapes = [(16.0, 300.0, 32.0), (17.0, 3000.0, 256.0), (1.0, 256.0, 256.0), (18.0, 1500.0, 128.0)]
    c = fit_engine([(truth(*x), *x) for x in shapes])
    assert (c.c0_s, c.c_seq_s, c.c_request_s) == (pytest.approx(0.002), pytest.approx(0.0001), pytest.approx(0.0005))
    # noise that would make a constant negative: that term is dropped and the rest refitted
    # (here c0 alone: sum(s t) / sum(s^2) over the two probes)
    c = fit_engine([(1.0, 10.0, 100.0, 10.0), (0.9, 10.0, 1000.0, 10.0)])
    assert c.c_seq_s == 0 and c.c_request_s == 0 and c.c0_s == pytest.approx((10 * 1.0 + 10 * 0.9) / 200)


def test_fit_pass_rates_matches_mean_and_zero_variance_share():
    a, b = fit_pass_rates(0.4, 0.3, 8)
    assert a / (a + b) == pytest.approx(0.4)
    assert 1 - keep_fraction(a, b, 8) == pytest.approx(0.3, abs=1e-6)
    # fewer all-equal groups than even a fixed p = 0.4 gives: the most concentrated Beta
    a, b = fit_pass_rates(0.4, 0.0, 8)
    assert a + b == pytest.approx(1e4)


def test_logit_drift():
    rates = [1 / (1 + math.exp(-(-1 + 0.05 * i))) for i in range(20)]
    assert logit_drift(rates) == pytest.approx(0.05)
    assert logit_drift([0.5]) == 0.0


def row(overlap_tokens: int, train_s: float) -> dict:
    return {"throughput/gen_tokens_while_training": overlap_tokens, "timing/train_s": train_s}


def test_learner_contention_compares_steps_alone_with_the_most_overlapped_half():
    alone = [row(0, t) for t in (0.08, 0.07, 0.09, 0.10, 0.06)]  # median 0.08
    # overlapped, by tokens: the lower half (10-40 tokens) is left out, the upper half's median is 0.12
    overlapped = [row(10, 0.2), row(20, 0.2), row(30, 0.01), row(40, 0.01),
                  row(50, 0.11), row(60, 0.12), row(70, 0.13), row(80, 0.10), row(90, 0.14)]
    s, k = learner_contention(alone + overlapped)
    assert s == pytest.approx(0.08) and k == pytest.approx(0.12 / 0.08)
    # too few steps alone: no contention measured, the median of every step
    s, k = learner_contention(alone[:4] + overlapped)
    assert (s, k) == (pytest.approx(0.10), 1.0)
    # a learner no slower beside the engine is not made faster by noise
    assert learner_contention(alone + [row(50, 0.05)] * 6)[1] == 1.0
