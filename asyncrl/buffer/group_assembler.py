"""Collects each prompt's n scored samples; when the group is complete, computes advantages.

Truncated responses (finish reason `length`) can be masked out of the advantages (Skywork-OR1
section 3.2.3: "before" / "after"). Groups left with no non-zero advantage after that mask carry
no signal and are dropped here, counted as `groups_zero_variance` (Skywork-OR1 section 3.1
rejection sampling; without a mask this is DAPO's dynamic sampling, rewards all equal). A group
whose rewards differ only in masked responses is dropped too. A repeated (group_id,
sample_index) is ignored and counted, so a resent frame can never be trained twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.algo.advantages import has_signal, masked_group_advantages
from asyncrl.types import Group, ScoredSample


@dataclass
class AssemblerStats:
    samples_in: int = 0
    duplicates: int = 0
    groups_complete: int = 0
    groups_zero_variance: int = 0
    """Groups dropped with every advantage 0 after the truncation mask (rewards all equal, without one)."""
    samples_zero_variance: int = 0


class GroupAssembler:
    def __init__(self, group_size: int, advantage: str = "grpo", eps: float = 1e-6,
                 drop_zero_variance: bool = True, truncation_mask: str = "none", std: str = "population"):
        self.group_size = group_size
        self.advantage = advantage
        self.truncation_mask = truncation_mask
        self.eps = eps
        self.std = std
        self.drop_zero_variance = drop_zero_variance
        self.stats = AssemblerStats()
        self._open: dict[str, dict[int, ScoredSample]] = {}

    @property
    def num_open_groups(self) -> int:
        return len(self._open)

    def discard(self, group_id: str) -> int:
        """Forget a group's samples so far (its prompt is being regenerated); returns how many."""
        return len(self._open.pop(group_id, {}))

    def state_dict(self) -> dict[str, Any]:
        """Only the counters: open groups are not saved, their prompts are regenerated."""
        return {"stats": asdict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = AssemblerStats(**state["stats"])
        self._open.clear()

    def add(self, scored: ScoredSample, group_size: int | None = None) -> Group | None:
        """Add one sample; return its group once all n samples are in and it is kept.

        `group_size` is n for this sample's group when it differs from the default (a training
        stage may change n while groups of the previous stage are still arriving)."""
        s = scored.sample
        n = group_size or self.group_size
        members = self._open.setdefault(s.group_id, {})
        if s.sample_index in members or s.sample_index >= n:
            self.stats.duplicates += 1
            return None
        self.stats.samples_in += 1
        members[s.sample_index] = scored
        if len(members) < n:
            return None
        del self._open[s.group_id]
        self.stats.groups_complete += 1
        samples = [members[i] for i in range(n)]
        truncated = [m.sample.finish_reason == "length" for m in samples]
        advantages = masked_group_advantages([m.reward for m in samples], truncated, self.truncation_mask,
                                             self.advantage, self.eps, self.std)
        if self.drop_zero_variance and not has_signal(advantages):
            self.stats.groups_zero_variance += 1
            self.stats.samples_zero_variance += len(samples)
            return None
        return Group(s.group_id, samples, advantages)
