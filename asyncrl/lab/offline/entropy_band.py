"""Choosing the SFT checkpoint to start RL from by its token entropy on the RL prompts
(checkpoint_entropy.py measures; this decides).

What the papers did. Ring-lite (section 4.3.1-4.3.2) saw that the longer a model is distilled
(more SFT epochs), the lower its entropy when RL starts and the sooner RL's reward collapses,
while too little SFT leaves it weak; it picked the SFT checkpoint by its entropy instead of by
validation accuracy, and for its Qwen-7B distillation reports that checkpoints whose entropy loss
(the mean token entropy RL logs) was in 0.3-0.5 gave the best RL results: below, exploration is
too narrow; above, RL converges slowly. Skywork-OR1 does not pick among SFT checkpoints; it
moves the starting entropy with the rollout temperature (section 3.2.4: at 0.6 entropy starts
near zero or collapses within ~100 steps, at 1.0 it starts in a useful range) and holds it above
a target of 0.2 during RL (3.2.5). The rule here is Ring-lite's, with the band as a setting (its
0.3-0.5 belongs to its models and data; a character model on arithmetic has other entropies).

Among several checkpoints in the band `prefer` picks one: `center` (default) the entropy closest
to the band's middle, `lowest` the least entropy (usually the most trained, the strongest start
that still explores), `highest` the most. None in the band is an error that says which side each
checkpoint fell on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Prefer = Literal["center", "lowest", "highest"]


class NoneInBand(ValueError):
    """No checkpoint's entropy is inside the band."""


@dataclass(frozen=True)
class CheckpointEntropy:
    path: str
    entropy: float
    """Mean token entropy (nats) over the sampled responses' tokens: the number the band applies to."""
    sampled_entropy: float
    """Mean -log pi of the sampled tokens (an estimate of the same entropy from the samples alone)."""
    accuracy: float
    """Mean reward of the samples."""
    num_tokens: int
    logprob_gap: float = 0.0
    """Largest |engine - transformers| logprob of a sampled token (near 0: the engine held this policy)."""


def choose(measured: list[CheckpointEntropy], low: float, high: float, prefer: Prefer = "center") -> CheckpointEntropy:
    """The checkpoint whose entropy lies in [low, high], by `prefer`; NoneInBand otherwise."""
    if not low < high:
        raise ValueError(f"the entropy band needs low < high, got [{low}, {high}]")
    inside = [m for m in measured if low <= m.entropy <= high]
    if not inside:
        sides = ", ".join(f"{m.path}: {m.entropy:.3f} ({'below' if m.entropy < low else 'above'})" for m in measured)
        raise NoneInBand(f"no checkpoint has its entropy in [{low:g}, {high:g}]: {sides}")
    if prefer == "lowest":
        return min(inside, key=lambda m: m.entropy)
    if prefer == "highest":
        return max(inside, key=lambda m: m.entropy)
    middle = (low + high) / 2
    return min(inside, key=lambda m: abs(m.entropy - middle))
