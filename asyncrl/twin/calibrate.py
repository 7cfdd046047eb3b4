"""Fitting a twin scenario to a machine that can be measured (tools/validate_twin.py): pure
functions from measurements to cost-model constants and workload parameters."""

from __future__ import annotations

import math
import statistics

from asyncrl.twin.costs import EngineCost
from asyncrl.twin.engine import Request, SimEngine
from asyncrl.twin.events import EventQueue
from asyncrl.twin.capacity import keep_fraction


def schedule_sums(prompt_lens: list[int], lengths: list[int], max_num_seqs: int, kv_tokens: int) -> tuple[float, float, float]:
    """(steps, sum over steps of the running batch, requests) of an engine given these requests at
    once: the batch takes c0 * steps + c_seq * batch-steps + c_request * requests (contexts this
    short cost nothing more), whatever the constants are, so measured batches give them."""
    out = []
    for cost in (EngineCost(1.0, 0.0, 0.0, 0.0), EngineCost(0.0, 1.0, 0.0, 0.0)):
        events = EventQueue()
        engine = SimEngine(cost, max_num_seqs, kv_tokens, events, on_finished=lambda *_: None)
        engine.submit([Request(p, n) for p, n in zip(prompt_lens, lengths)], 0.0)
        while events.run_next():
            pass
        out.append(engine.stats.busy_s)
    return out[0], out[1], float(len(lengths))


def fit_engine(probes: list[tuple[float, ...]]) -> EngineCost:
    """c0, c_seq and c_request from measured batches (seconds, steps, batch-steps, requests): the
    least-squares fit with every constant >= 0 (of the fits on each subset of the terms, the best
    whose constants are all >= 0; noise can make the full fit's smallest one negative)."""
    import itertools

    import numpy as np

    t = np.array([p[0] for p in probes], dtype=np.float64)
    x = np.array([[p[1], p[2], p[3] if len(p) > 3 else 0.0] for p in probes], dtype=np.float64)
    best, best_err = np.zeros(3), float("inf")
    for k in range(1, 4):
        for cols in itertools.combinations(range(3), k):
            sub = x[:, cols]
            if np.linalg.matrix_rank(sub) < k:
                continue
            coef = np.linalg.lstsq(sub, t, rcond=None)[0]
            if (coef < 0).any():
                continue
            err = float(((sub @ coef - t) ** 2).sum())
            if err < best_err - 1e-18:
                best, best_err = np.zeros(3), err
                best[list(cols)] = coef
    return EngineCost(float(best[0]), float(best[1]), 0.0, 0.0, c_request_s=float(best[2]))


def learner_contention(rows: list[dict], min_steps: int = 5) -> tuple[float, float]:
    """(step seconds alone, slowdown while generating) of a learner that shares cores with the
    engine, from a run's rows (`timing/train_s`, `throughput/gen_tokens_while_training`): the
    median step during which no response arrived (the engine idle, for responses shorter than a
    step), and the median of the half of the other steps with the most arriving over it (the
    engine busy for most of the step). Fewer than `min_steps` of either: (median step, 1)."""
    steps = [(r["throughput/gen_tokens_while_training"], r["timing/train_s"]) for r in rows
             if "throughput/gen_tokens_while_training" in r]
    alone = [s for n, s in steps if n == 0]
    overlapped = sorted((n, s) for n, s in steps if n > 0)
    busy = [s for _, s in overlapped[len(overlapped) // 2:]]
    if len(alone) < min_steps or len(busy) < min_steps:
        return statistics.median(s for _, s in steps), 1.0
    return statistics.median(alone), max(statistics.median(busy) / statistics.median(alone), 1.0)


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
