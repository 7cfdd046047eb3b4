"""Turns a complete group's n scored samples into advantages, or rejects it.

The samples wait on their group's ledger record (orchestrator/ledger.py) until all n are scored;
then `assemble` returns `Kept` (the group with its advantages, for the buffer) or `Rejected`.
Truncated responses (finish reason `length`) can be masked out of the advantages (Skywork-OR1
section 3.2.3: "before" / "after"). Groups left with no non-zero advantage after that mask carry
no signal and are rejected, counted as `groups_zero_variance` (Skywork-OR1 section 3.1 rejection
sampling; without a mask this is DAPO's dynamic sampling, rewards all equal). A group whose
rewards differ only in masked responses is rejected too.

With on-policy distillation (`distill`, algo.distill.reward) the learner adds the teacher's term
to every token's advantage. "add" keeps the rejection as configured (the term rides on the groups
RL trains on, and each step's Phi tokens all carry a reward signal); "replace" zeroes the group
advantages and rejects nothing (the teacher's term is the whole signal, in every group).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from asyncrl.algo.advantages import has_signal, masked_group_advantages
from asyncrl.types import Group, ScoredSample


@dataclass
class AssemblerStats:
    groups_complete: int = 0
    groups_zero_variance: int = 0
    """Groups rejected with every advantage 0 after the truncation mask (rewards all equal, without one)."""
    samples_zero_variance: int = 0


@dataclass(frozen=True)
class Kept:
    """A group with a learning signal: it goes to the buffer."""

    group: Group


@dataclass(frozen=True)
class Rejected:
    """A group with no non-zero advantage after the truncation mask: dropped, counted."""

    group_id: str
    num_samples: int


class GroupAssembler:
    def __init__(self, advantage: str = "grpo", eps: float = 1e-6, drop_zero_variance: bool = True,
                 truncation_mask: str = "none", std: str = "population", distill: str | None = None):
        if distill not in (None, "add", "replace"):
            raise ValueError(f"distill must be None, 'add' or 'replace', got {distill!r}")
        self.advantage, self.distill = advantage, distill
        self.truncation_mask = truncation_mask
        self.eps = eps
        self.std = std
        self.drop_zero_variance = drop_zero_variance and distill != "replace"
        self.stats = AssemblerStats()

    def state_dict(self) -> dict[str, Any]:
        return {"stats": asdict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {f.name for f in fields(AssemblerStats)}
        self.stats = AssemblerStats(**{k: v for k, v in state["stats"].items() if k in known})

    def assemble(self, group_id: str, samples: list[ScoredSample]) -> Kept | Rejected:
        """The group's samples in sample-index order, all n of them."""
        self.stats.groups_complete += 1
        truncated = [m.sample.finish_reason == "length" for m in samples]
        advantages = masked_group_advantages([m.reward for m in samples], truncated, self.truncation_mask,
                                             self.advantage, self.eps, self.std)
        if self.distill == "replace":
            advantages = [0.0] * len(samples)
        if self.drop_zero_variance and not has_signal(advantages):
            self.stats.groups_zero_variance += 1
            self.stats.samples_zero_variance += len(samples)
            return Rejected(group_id, len(samples))
        return Kept(Group(group_id, samples, advantages))
