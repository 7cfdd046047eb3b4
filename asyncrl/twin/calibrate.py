"""Fitting a twin scenario to a machine that can be measured (tools/validate_twin.py): pure
functions from measurements to cost-model constants and workload parameters."""

from __future__ import annotations

import math

from asyncrl.twin.costs import EngineCost
from asyncrl.twin.engine import Request, SimEngine
from asyncrl.twin.events import EventQueue
from asyncrl.twin.capacity import keep_fraction


def schedule_sums(prompt_lens: list[int], lengths: list[int], max_num_seqs: int, kv_tokens: int) -> tuple[float, float]:
    """(steps, sum over steps of the running batch) of an engine that is given these requests at
    once: the time of that batch is c0 * steps + c_seq * batch-steps (contexts this short cost
    nothing more), whatever c0 and c_seq are, so two measured batches give both."""
    out = []
    for cost in (EngineCost(1.0, 0.0, 0.0, 0.0), EngineCost(0.0, 1.0, 0.0, 0.0)):
        events = EventQueue()
        engine = SimEngine(cost, max_num_seqs, kv_tokens, events, on_finished=lambda *_: None)
        engine.submit([Request(p, n) for p, n in zip(prompt_lens, lengths)], 0.0)
        while events.run_next():
            pass
        out.append(engine.stats.busy_s)
    return out[0], out[1]


def fit_engine(probes: list[tuple[float, float, float]]) -> EngineCost:
    """c0 and c_seq from measured batches (seconds, steps, batch-steps) by least squares through
    the origin; a negative constant (noise) is fitted again with it held at 0."""
    sxx = sum(s * s for _, s, _ in probes)
    syy = sum(b * b for _, _, b in probes)
    sxy = sum(s * b for _, s, b in probes)
    sxt = sum(s * t for t, s, _ in probes)
    syt = sum(b * t for t, _, b in probes)
    det = sxx * syy - sxy * sxy
    c0, cseq = ((sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det) if det else (-1.0, -1.0)
    if c0 < 0 or cseq < 0:
        c0, cseq = (sxt / sxx, 0.0) if c0 >= 0 or cseq < 0 else (0.0, syt / syy)
    return EngineCost(c0, cseq, 0.0, 0.0)


def fit_pass_rates(reward_mean: float, zero_variance_frac: float, group_size: int) -> tuple[float, float]:
    """Beta(alpha, beta) with the observed mean reward whose share of all-equal groups of
    `group_size` is the observed one (the concentration alpha + beta sets it: small, prompts are
    all or nothing; large, every prompt has the mean's pass rate)."""
    m = min(max(reward_mean, 1e-3), 1 - 1e-3)

    def zero_var(kappa: float) -> float:
        return 1 - keep_fraction(m * kappa, (1 - m) * kappa, group_size)

    lo, hi = math.log(1e-3), math.log(1e4)  # zero_var falls as the concentration grows
    if zero_variance_frac >= zero_var(math.exp(lo)):
        kappa = math.exp(lo)
    elif zero_variance_frac <= zero_var(math.exp(hi)):
        kappa = math.exp(hi)
    else:
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if zero_var(math.exp(mid)) > zero_variance_frac else (lo, mid)
        kappa = math.exp((lo + hi) / 2)
    return m * kappa, (1 - m) * kappa


def logit_drift(reward_means: list[float]) -> float:
    """Least-squares slope of logit(reward mean) against the step: the pass rates' drift per version."""
    pts = [(i, math.log(r / (1 - r))) for i, r in enumerate(reward_means) if 0 < r < 1]
    if len(pts) < 2:
        return 0.0
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
