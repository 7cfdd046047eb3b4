"""Group-relative advantages and truncation masks (pure, plain floats in and out).

GRPO (DeepSeekMath; Skywork-OR1 eq. 2.5): A_i = (r_i - mean(r)) / (std(r) + eps). The papers write
"std" without saying which: `std="population"` divides the squared deviations by n,
`std="sample"` by n - 1 (torch.std's default, which verl's and TRL's GRPO use, and so the
verl-based Skywork-OR1, DAPO and ProRL code). For n = 8 the two differ by sqrt(8/7), 7%.
Dr. GRPO drops the std. RLOO uses the mean of the *other* samples
as the baseline: A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r)). Every token of a
response shares its response's advantage.

A group whose advantages are all zero has no learning signal; DAPO's dynamic sampling and
Skywork-OR1 section 3.1 (rejection sampling) drop such groups rather than train on zeros.
Skywork-OR1 keeps a group when "exists j: A_ij != 0", i.e. after the truncation mask
(`has_signal` on the masked advantages): a group whose rewards differ only in masked responses
has none. Without a mask this is the same as DAPO's "rewards not all equal" (`is_zero_variance`).

Deviations: `eps` is added to the std so an all-equal group gives zeros instead of 0/0; a
single-sample group gets advantage 0 under RLOO (no other sample to form a baseline). The
truncation masks of Skywork-OR1 section 3.2.3 are written for GRPO; `masked_group_advantages`
applies the same masking to whichever estimator `kind` names.
"""

from __future__ import annotations

import math

ADVANTAGE_KINDS = ("grpo", "drgrpo", "rloo")
STD_CONVENTIONS = ("population", "sample")
TRUNCATION_MASKS = ("none", "before", "after")


def group_advantages(rewards: list[float], kind: str = "grpo", eps: float = 1e-6,
                     std: str = "population") -> list[float]:
    """One advantage per reward of a group of responses to the same prompt; `std` (grpo only):
    "population" (/ n) or "sample" (/ (n - 1)). A single reward gets 0 under every estimator."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if std not in STD_CONVENTIONS:
        raise ValueError(f"unknown std convention {std!r} (allowed: {', '.join(STD_CONVENTIONS)})")
    n = len(rewards)
    mean = sum(rewards) / n
    if max(rewards) == min(rewards):
        # the float mean of equal values can miss them by an ulp, and grpo would divide that
        # residue by a std of the same size (e.g. [0.1] * 3 with eps = 1e-15 gave -0.014 each)
        mean = rewards[0]
    centered = [r - mean for r in rewards]
    if kind == "drgrpo":
        return centered
    if kind == "grpo":
        if n == 1:
            return [0.0]  # no spread to divide by (and the sample std's n - 1 is 0)
        sigma = math.sqrt(sum(c * c for c in centered) / (n if std == "population" else n - 1))
        return [c / (sigma + eps) for c in centered]
    if kind == "rloo":
        if n == 1:
            return [0.0]
        return [c * n / (n - 1) for c in centered]
    allowed = ", ".join(ADVANTAGE_KINDS)
    raise ValueError(f"unknown advantage estimator {kind!r} (allowed: {allowed})")


def masked_group_advantages(
    rewards: list[float],
    truncated: list[bool],
    mask: str = "none",
    kind: str = "grpo",
    eps: float = 1e-6,
    std: str = "population",
) -> list[float]:
    """Advantages of a group with the truncated-response mask of Skywork-OR1 section 3.2.3.

    `truncated[i]` is True when response i hit the context length T (|y| > T) without finishing.

    - "none" (No-Adv-Mask): "We do not employ any advantage mask strategy."
    - "before" (Adv-Mask-Before): "The truncated responses are not involved in the group
      advantage calculation for non-truncated responses, and the advantage of these truncated
      responses are set to 0 (thus not contributing to the policy loss)":
      A_ij = (r_ij - mean(R^_i)) / std(R^_i) if |y| <= T, else 0, where R^_i "is the accuracy
      rewards group of non-truncated responses of prompt x_i".
    - "after" (Adv-Mask-After): "The truncated responses are still involved in the group
      advantage calculation for non-truncated responses, and the advantage of these truncated
      responses are set to 0 (thus not contributing to the policy loss)":
      A_ij = (r_ij - mean(R_i)) / std(R_i) if |y| <= T, else 0, where R_i "is the accuracy
      rewards group of all responses of prompt x_i".

    A fully truncated group gets all zeros under "before" and "after".
    """
    if len(rewards) != len(truncated):
        raise ValueError(f"{len(rewards)} rewards but {len(truncated)} truncation flags")
    if mask == "none":
        return group_advantages(rewards, kind, eps, std)
    if mask == "after":
        adv = group_advantages(rewards, kind, eps, std)
        return [0.0 if cut else a for a, cut in zip(adv, truncated)]
    if mask == "before":
        kept = [r for r, cut in zip(rewards, truncated) if not cut]
        if not kept:
            return [0.0] * len(rewards)
        kept_adv = iter(group_advantages(kept, kind, eps, std))
        return [0.0 if cut else next(kept_adv) for cut in truncated]
    raise ValueError(f"unknown truncation mask {mask!r} (allowed: {', '.join(TRUNCATION_MASKS)})")


def is_zero_variance(rewards: list[float], tol: float = 1e-12) -> bool:
    """True when every reward in the group is the same (single-sample groups included)."""
    return max(rewards) - min(rewards) <= tol


def has_signal(advantages: list[float], tol: float = 1e-12) -> bool:
    """Skywork-OR1 section 3.1's rejection criterion: some advantage is non-zero (|A| > tol).
    Pass the advantages after the truncation mask."""
    return any(abs(a) > tol for a in advantages)


def groups_with_signal(groups: list[list[float]], tol: float = 1e-12) -> list[int]:
    """Indices of the groups to keep: those whose values are not all equal.

    Pass rewards for DAPO's filter, or advantages after a truncation mask for Skywork-OR1's
    criterion "exists j: A_ij != 0" (the same thing here: centred advantages that are all equal
    are all zero).
    """
    return [i for i, rewards in enumerate(groups) if not is_zero_variance(rewards, tol)]
