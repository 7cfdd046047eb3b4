"""Event marks: the events of a run (events.jsonl) that a figure draws as vertical lines, because a
curve that jumps there is explained by them, not by the algorithm.

Marked, each with its own line style: `resume` (the run restarted from a checkpoint; the buffer
and the actors started empty), `reference_reset` (the KL reference became the current policy),
`scale` (`asyncrl scale` changed the number of actors), `stage` (the next curriculum stage began)
and `actor_lost` (an actor died and its groups were generated again). Not marked: start, end and
checkpoint (every run has them), eval (its own curve), reward errors and lost evaluations (no
step-level effect on the curves). Pure: run records in, marks out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncrl.lab.analysis.arms import Arm

# event -> (legend text, matplotlib line style)
MARKED_EVENTS: dict[str, tuple[str, str | tuple]] = {
    "resume": ("resume", "--"),
    "reference_reset": ("reference reset", ":"),
    "scale": ("actors rescaled", "-."),
    "stage": ("next stage", (0, (6, 2, 1, 2, 1, 2))),
    "actor_lost": ("actor lost", (0, (1, 3))),
}


@dataclass(frozen=True)
class Mark:
    arm: str
    event: str
    step: float
    """The step the run logged the event at."""
    x: float
    """Where it stands on the figure's x axis (the step, or e.g. rollout/samples_total there)."""
    runs: tuple[str, ...]
    """The arm's runs (seeds) that logged it at that step."""


def arm_marks(arm: Arm, x_axis: str = "step") -> list[Mark]:
    """The arm's marked events, one per (event, step) whichever seeds logged it, in step order. On
    another x axis a mark stands at the run's value of that column at the step; an event at a step
    without one (a resume at step 0, before any sample) is left out."""
    found: dict[tuple[str, float], tuple[float, list[str]]] = {}
    for run in arm.runs:
        at = None if x_axis == "step" else dict(zip(run.series(x_axis).steps, run.series(x_axis).values))
        for e in run.events:
            step = e.get("step")
            if e.get("event") not in MARKED_EVENTS or not isinstance(step, (int, float)) or not math.isfinite(step):
                continue
            x = float(step) if at is None else at.get(float(step))
            if x is None:
                continue
            found.setdefault((e["event"], float(step)), (x, []))[1].append(run.name)
    marks = [Mark(arm.name, event, step, x, tuple(runs)) for (event, step), (x, runs) in found.items()]
    return sorted(marks, key=lambda m: (m.step, list(MARKED_EVENTS).index(m.event)))
