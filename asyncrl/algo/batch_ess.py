"""The estimated effective sample size of a batch before it is trained, from the importance-ratio
moments the learner measured per staleness bucket on recent steps (pure Python: the buffer
imports it, and the buffer does not import torch).

With r_t = pi_theta(a_t) / pi_b(a_t), the normalized ESS of N tokens is (sum r_t)^2 / (N sum r_t^2)
(Kong 1992; `offpolicy/ess` measures it after a step, algo/token_decomposition.py). A batch not yet
trained has no ratios, but if the learner measured m1_k = mean r and m2_k = mean r^2 over the
tokens of staleness bucket k, a batch holding n_k tokens of bucket k has sum r ~ sum_k n_k m1_k and
sum r^2 ~ sum_k n_k m2_k, so

    ESS ~ (sum_k n_k m1_k)^2 / (N sum_k n_k m2_k),   N = sum_k n_k.

The staleness buckets are the decomposition's (`offpolicy/stale_<k>/...`); they are defined here so
that both sides read the same table.
"""

from __future__ import annotations

from collections.abc import Mapping

NAMESPACE = "offpolicy"
STALENESS_BUCKETS = (("stale_0", 0, 0), ("stale_1", 1, 1), ("stale_2", 2, 2), ("stale_3-4", 3, 4),
                     ("stale_5+", 5, None))
"""(name, lowest, highest staleness; None: no upper bound)."""

Moments = Mapping[str, tuple[float, float]]
"""Staleness bucket name -> (m1, m2): the mean ratio and mean squared ratio of its tokens."""


def staleness_bucket(lag: int) -> str:
    """The name of the staleness bucket a token `lag` versions behind the learner falls in."""
    for name, lo, hi in STALENESS_BUCKETS:
        if lag >= lo and (hi is None or lag <= hi):
            return name
    raise ValueError(f"staleness must be >= 0, got {lag}")


def estimated_ess(lag_counts: Mapping[int, int], moments: Moments) -> float | None:
    """(sum_k n_k m1_k)^2 / (N sum_k n_k m2_k) for `lag_counts` (lag -> tokens); None when no
    tokens, or when a bucket holding tokens has no moments (it was never measured)."""
    num_tokens = first = second = 0.0
    for lag, n in lag_counts.items():
        if not n:
            continue
        m = moments.get(staleness_bucket(lag))
        if m is None:
            return None
        num_tokens += n
        first += n * m[0]
        second += n * m[1]
    if not num_tokens or second <= 0.0:
        return None
    return first * first / (num_tokens * second)


def ratio_moments(metrics: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """(ratio_mean, ratio_sq_mean) of each staleness bucket a learner step's metrics report (an
    empty bucket reports neither, and is left out)."""
    out = {}
    for name, _, _ in STALENESS_BUCKETS:
        m1, m2 = metrics.get(f"{NAMESPACE}/{name}/ratio_mean"), metrics.get(f"{NAMESPACE}/{name}/ratio_sq_mean")
        if m1 is not None and m2 is not None:
            out[name] = (float(m1), float(m2))
    return out
