"""The twin's workload: lengths correlated within a prompt's group, and the share a real run's
samples imply (asyncrl/twin/workload.py)."""

import json
import math
import statistics

import pytest

from asyncrl.twin.workload import Lengths, group_share_of_run


def log_lengths(lengths: Lengths, prompts: int, n: int) -> list[list[float]]:
    return [[math.log(lengths.draw(f"p{i}", j)) for j in range(n)] for i in range(prompts)]


def between_share(groups: list[list[float]]) -> float:
    """Variance of the group means over the total variance (n large: the within-group part of
    the means' variance is small)."""
    flat = [x for g in groups for x in g]
    return statistics.pvariance([statistics.fmean(g) for g in groups]) / statistics.pvariance(flat)


def test_group_share_correlates_a_groups_lengths_and_keeps_their_distribution():
    independent = Lengths("lognormal", 10**9, seed=1, mean=1000, sigma=0.8)
    shared = Lengths("lognormal", 10**9, seed=1, mean=1000, sigma=0.8, group_share=0.6)
    a, b = log_lengths(independent, 400, 32), log_lengths(shared, 400, 32)
    # share of variance in common: ~1/32 (the means' own noise) without, 0.6 + 0.4/32 with
    assert between_share(a) == pytest.approx(1 / 32, abs=0.02)
    assert between_share(b) == pytest.approx(0.6 + 0.4 / 32, abs=0.06)
    # the marginal is the same lognormal: log-mean mu = ln 1000 - sigma^2 / 2, log-sd sigma
    for groups in (a, b):
        flat = [x for g in groups for x in g]
        assert statistics.fmean(flat) == pytest.approx(math.log(1000) - 0.32, abs=0.06)
        assert statistics.pstdev(flat) == pytest.approx(0.8, abs=0.04)
    # 0 leaves the draws as they were (independent, scenario results unchanged)
    assert [independent.draw("q", i) for i in range(5)] == [
        Lengths("lognormal", 10**9, seed=1, mean=1000, sigma=0.8, group_share=0.0).draw("q", i) for i in range(5)]


def test_empirical_lengths_with_a_group_share_draw_from_the_runs_lengths():
    hist = [10, 20, 40, 80, 160, 320]
    lengths = Lengths("empirical", 1000, seed=2, histogram=hist, group_share=0.9)
    draws = [[lengths.draw(f"p{i}", j) for j in range(16)] for i in range(200)]
    assert {x for g in draws for x in g} <= set(hist)
    assert between_share([[math.log(x) for x in g] for g in draws]) > 0.7
    with pytest.raises(ValueError, match="group_share"):
        Lengths("fixed", 100, seed=0, mean=10, group_share=1.5)


def test_group_share_of_run_is_the_intraclass_correlation_of_log_lengths(tmp_path):
    # two prompts of two samples each: log lengths (0, 0) and (2, 2) share everything; (0, 2)
    # and (2, 0) nothing (negative, floored at 0); one-way ANOVA by hand:
    # (a) groups {0, 0}, {2, 2}: MSB = 2 * (0 - 1)^2 + 2 * (2 - 1)^2 = 4, MSW = 0 -> 1
    # (b) groups {0, 2}, {0, 2}: MSB 0, MSW = 4 / 2 = 2 -> (0 - 2) / (0 + 2) < 0 -> 0
    # (c) groups {0, 1}, {2, 3}: MSB = 2 * 1 + 2 * 1 = 4, MSW = 4 * 0.25 / 2 = 0.5 -> 3.5 / 4.5
    def write(name, groups):
        path = tmp_path / name
        rows = [{"step": 1, "prompt_id": f"p{g}", "response_tokens": round(math.exp(x))}
                for g, xs in enumerate(groups) for x in xs]
        path.write_text("\n".join(json.dumps(r) for r in rows))
        return path

    e = math.e
    assert group_share_of_run(write("a", [[0, 0], [2, 2]])) == pytest.approx(1.0, abs=1e-3)
    assert group_share_of_run(write("b", [[0, 2], [0, 2]])) == 0.0
    # lengths are whole tokens: exp(1) -> 3 tokens, so the hand figure uses the logs of the
    # rounded lengths
    got = group_share_of_run(write("c", [[0, 1], [2, 3]]))
    x = [[0.0, math.log(round(e))], [math.log(round(e ** 2)), math.log(round(e ** 3))]]
    means, grand = [sum(g) / 2 for g in x], sum(map(sum, x)) / 4
    msb = sum(2 * (m - grand) ** 2 for m in means)
    msw = sum((v - m) ** 2 for g, m in zip(x, means) for v in g) / 2
    assert got == pytest.approx((msb - msw) / (msb + msw), rel=1e-9)
    with pytest.raises(ValueError, match="too few"):
        group_share_of_run(write("d", [[0, 1]]))
