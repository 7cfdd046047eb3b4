"""Which arms of a figure get a panel of their own, so that one exploding arm (an entropy climbing to
3 nats while the others sit at 0.2-0.5) does not flatten every other curve into a line.

The rule, on each arm's extent (min, max of the curve drawn): the reference is the arm of median
height (max - min; the lower median with an even count, ties in figure order), so one or a
minority of exploding arms cannot set it. An arm is an outlier when its curve leaves the
reference's [min, max] by more than OUTLIER_FACTOR x the reference's height, above or below: drawn
together, the reference would get less than 1 / (1 + OUTLIER_FACTOR) of the axis. A flat
reference (height 0) makes no outliers: nothing it shows would be lost. Outliers are drawn in a
second panel with their own y axis, the same x axis, colours and marks. Pure.
"""

from __future__ import annotations

OUTLIER_FACTOR = 3.0


def outlier_arms(extents: dict[str, tuple[float, float]], factor: float = OUTLIER_FACTOR) -> list[str]:
    """extents: arm -> (min, max) of its curve, in figure order; the outliers, in that order."""
    if len(extents) < 2:
        return []
    by_height = sorted(extents, key=lambda a: extents[a][1] - extents[a][0])
    lo, hi = extents[by_height[(len(by_height) - 1) // 2]]
    height = hi - lo
    if height <= 0:
        return []
    return [a for a, (a_lo, a_hi) in extents.items() if a_hi > hi + factor * height or a_lo < lo - factor * height]
