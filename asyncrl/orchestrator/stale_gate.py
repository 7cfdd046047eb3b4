"""The stale policies that act in the driver (buffer.stale_policy `wait` and `pace`), and the
tally of admission versions the group ledger keeps for them.

Both ask one question of the oldest group still out (buffer/stale_policy.py `at_risk`): was it
admitted so long ago that its tokens would be more than max_staleness behind after the next step?
- `wait` asks it of the groups in flight (generating or scoring) when the learner wants its next
  step, and holds the step (`Driver.next_batch` returns None) until they land, so no group goes
  stale while it is out (tokens that landed beyond the next Phi still can, when admission ran
  ahead of the learner); it costs learner idle time.
- `pace` asks it of the groups still generating when prompts are handed out, and hands out none
  until they finish, so the engines spend their capacity on the work that would go stale; it costs
  rollout throughput, and the learner does not wait.
"""

from __future__ import annotations

from typing import Any

from asyncrl.buffer.stale_policy import at_risk


class VersionTally:
    """How many groups were admitted at each learner version, among the groups in one state. The
    ledger keeps one for the groups in flight and one for those generating, as records move, so
    the oldest is found without a scan of every record on each turn of the loop."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}

    def add(self, version: int, change: int) -> None:
        n = self._count.get(version, 0) + change
        if n < 0:
            raise ValueError(f"no group admitted at version {version} left to remove")
        if n:
            self._count[version] = n
        else:
            self._count.pop(version, None)

    @property
    def oldest(self) -> int | None:
        """The earliest learner version a group was admitted at; None: no group."""
        return min(self._count, default=None)


class StaleGate:
    """`wait` and `pace`; under any other policy it never holds or pauses."""

    def __init__(self, policy: str, max_staleness: int) -> None:
        self.policy = policy
        self.max_staleness = max_staleness
        self.num_holds = 0
        """next_batch calls held back for stragglers (about one per turn of the loop's bookkeeping)."""
        self.held_since_row = False
        self.paused = False

    def holds_step(self, oldest_in_flight: int | None, learner_version: int) -> bool:
        """`wait`: the learner's step at `learner_version` waits for the groups in flight."""
        held = self.policy == "wait" and at_risk(oldest_in_flight, learner_version, self.max_staleness)
        if held:
            self.num_holds += 1
            self.held_since_row = True
        return held

    def pauses_admission(self, oldest_generating: int | None, learner_version: int) -> bool:
        """`pace`: no prompt is handed out while an at-risk group is generating."""
        self.paused = self.policy == "pace" and at_risk(oldest_generating, learner_version, self.max_staleness)
        return self.paused

    def take_metrics(self) -> dict[str, Any]:
        """For a step's row: whether that step was held for stragglers (the flag starts over),
        the held calls so far, and whether the last admission was paused."""
        out = {"buffer/waiting_for_stragglers": float(self.held_since_row),
               "buffer/straggler_holds_total": self.num_holds, "buffer/admission_paused": float(self.paused)}
        self.held_since_row = False
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"num_holds": self.num_holds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_holds = state["num_holds"]
