"""What to do about work that would go stale (`buffer.stale_policy`), as pure decisions.

Discarding what is more than eta = buffer.max_staleness versions behind when it enters training
biases the batch: long responses take longer to generate, so they are the first to go stale and
the trained batch leans towards short answers (`buffer/length_bias` < 0). The alternatives, what
each costs, and where each acts (docs/design/versions.md):

- `wait` (the driver holds the learner's next step) and `pace` (the driver pauses admission) both
  ask `at_risk` of the oldest group in flight or still generating (orchestrator/stale_gate.py);
- `ess` (the token buffer) keeps a stale response if `keep_stale` says the batch's estimated
  effective sample size allows it, from the learner's ratio moments per staleness bucket
  (`RatioMoments`, algo/batch_ess.py);
- `train` (the token buffer) keeps every stale token: eta bounds admission only, as in AReaL.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping
from typing import Any

from asyncrl.algo.batch_ess import Moments, estimated_ess

STALE_POLICIES = ("discard", "wait", "pace", "ess", "train")
MOMENTS_WEIGHT = 0.5
"""Weight of the newest step's moments in their exponential average."""


def at_risk(admitted_at: int | None, learner_version: int, max_staleness: int) -> bool:
    """A group admitted at learner version `admitted_at` and not yet in the buffer, at learner
    version `learner_version`: its first tokens are generated at `admitted_at` or later and enter
    training after this step at the earliest, at version `learner_version` + 1, so they would be
    more than `max_staleness` behind then when admitted_at + max_staleness < learner_version + 1.
    None (no such group): False."""
    return admitted_at is not None and admitted_at + max_staleness < learner_version + 1


def keep_stale(batch: Mapping[int, int], candidate: Mapping[int, int], moments: Moments, ess_min: float,
               max_lag: int) -> bool:
    """`ess`: whether a response with tokens more than eta versions behind is trained. `batch`:
    lag -> tokens of the batch being cut so far; `candidate`: lag -> the response's tokens this
    batch would take. Kept when no token is more than `max_lag` behind and the estimated ESS of
    batch + candidate (algo/batch_ess.py) is at least `ess_min`; dropped, as discard would, when a
    bucket of batch + candidate was never measured."""
    if any(lag > max_lag for lag, n in candidate.items() if n):
        return False
    ess = estimated_ess(Counter(batch) + Counter(candidate), moments)
    return ess is not None and ess >= ess_min


def lag_counts(versions: list[int], start: int, end: int, learner_version: int,
               into: Counter[int] | None = None) -> Counter[int]:
    """lag -> tokens among versions[start:end] at `learner_version`, added to `into` (a new
    Counter if None) and returned. Versions never decrease along a response, so each distinct
    version is one run, found by bisection; a response of one version is counted in one step."""
    out: Counter[int] = Counter() if into is None else into
    if start < end and versions[start] == versions[end - 1]:  # no update mid-response: most of them
        out[learner_version - versions[start]] += end - start
        return out
    i = start
    while i < end:
        j = bisect_right(versions, versions[i], i, end)
        out[learner_version - versions[i]] += j - i
        i = j
    return out


class RatioMoments:
    """The learner's (mean r, mean r^2) per staleness bucket, exponentially averaged over steps
    (`MOMENTS_WEIGHT` on the newest); a bucket a step did not measure keeps its last value."""

    def __init__(self, weight: float = MOMENTS_WEIGHT) -> None:
        self.weight = weight
        self.by_bucket: dict[str, tuple[float, float]] = {}

    def observe(self, moments: Moments) -> None:
        w = self.weight
        for bucket, (m1, m2) in moments.items():
            old = self.by_bucket.get(bucket)
            self.by_bucket[bucket] = (m1, m2) if old is None else (w * m1 + (1 - w) * old[0], w * m2 + (1 - w) * old[1])

    def state_dict(self) -> dict[str, Any]:
        return {b: list(m) for b, m in self.by_bucket.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.by_bucket = {b: (float(m[0]), float(m[1])) for b, m in state.items()}
