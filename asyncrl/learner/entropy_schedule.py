"""The entropy coefficient alpha of each optimizer step: fixed, or adaptive (Skywork-OR1 section
3.2.5, eq. 3.2; the controller is algo/entropy_control.py) and then moved once per rollout batch.

Skywork-OR1 updates c once per training step, and its training step is a rollout batch (which
feeds N_SGD optimizer steps, section 4), "with e_k estimated from the rollout buffer" of that
step. So with a rollout-batch schedule (types.Batch.role) the controller takes one e_k when a
batch opens, and every step of the batch uses the alpha it returned; a step that is its own batch
(streaming) moves it once per step.

e_k is measured on the learner's current policy (see entropy_control.py for why):
- exact: when the batch opens, over all its tokens, each once (the learner's no-grad pass over
  the opened batch); a step that is its own batch: over its own loss tokens, before its update;
- lagged: the learner entropy of the previous batch's steps, weighted by their loss tokens (for
  a streaming step, the previous step's). No extra forward, one batch late.
- sampled_nll: the mean -log pi_behaviour(a_t) of the batch's (or step's) sampled tokens, a
  one-sample estimate of the actors' entropy: what Skywork-OR1's released scripts feed the
  controller. Free, and it lags the learner's policy by the batch's staleness.
Every sum is over all learner ranks before it gets here.
"""

from __future__ import annotations

import math
from typing import Any

from asyncrl.algo.entropy_control import AdaptiveEntropyController
from asyncrl.config import AlgoConfig


class EntropySchedule:
    def __init__(self, algo: AlgoConfig) -> None:
        ec = algo.entropy_control
        self.fixed = algo.entropy_coef
        self.controller = (AdaptiveEntropyController(ec.target, ec.delta, math.inf if ec.coef_max is None
                                                     else ec.coef_max) if ec.enabled else None)
        self.exact = ec.enabled and ec.measure == "exact"
        self.sampled = ec.enabled and ec.measure == "sampled_nll"
        self.alpha = 0.0              # alpha of the open rollout batch
        self.measured: float | None = None  # its e_k
        self._entropy_sum = 0.0       # learner entropy x loss tokens of the open batch's steps so far
        self._tokens = 0

    def coef(self, role: str, measured: float | None = None) -> tuple[float, dict[str, float]]:
        """alpha for a step of `role` ("own", "open", "continue"); `measured`: the exact e_k of
        the step ("own") or of the batch it opens, when the schedule is exact."""
        ctl = self.controller
        if ctl is None:
            return self.fixed, {}
        if role != "continue":
            if not (self.exact or self.sampled):  # lagged: the batch (or step) before this one
                measured = self._lagged()
            elif measured is None:
                raise ValueError("exact and sampled_nll entropy control need e_k of the step or of the "
                                 "rollout batch it opens")
            self._entropy_sum, self._tokens = 0.0, 0
            self.measured = measured
            # lagged mode's first step has no e_0 yet, and c_0 = 0 anyway
            self.alpha = ctl.update(measured) if measured is not None else 0.0
        metrics = {**ctl.metrics(), "entropy_control/target": ctl.target}
        if self.measured is not None:
            metrics["entropy_control/measured"] = self.measured
        return self.alpha, metrics

    def needs_measure(self, role: str) -> bool:
        """Whether a step of `role` must bring e_k: exact or sampled, when its batch opens."""
        return (self.exact or self.sampled) and role != "continue"

    def observe(self, entropy_mean: float, num_tokens: int) -> None:
        """A step's learner entropy over its loss tokens (all ranks), for the lagged e_k."""
        self._entropy_sum += entropy_mean * num_tokens
        self._tokens += num_tokens

    def _lagged(self) -> float | None:
        return self._entropy_sum / self._tokens if self._tokens else None

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_control": self.controller.state_dict() if self.controller else None,
                "batch_alpha": self.alpha, "batch_measured": self.measured,
                "batch_entropy_sum": self._entropy_sum, "batch_tokens": self._tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.controller is not None and state.get("entropy_control"):
            self.controller.load_state_dict(state["entropy_control"])
        self.alpha = float(state.get("batch_alpha", 0.0))
        self.measured = state.get("batch_measured")
        if "batch_tokens" in state:
            self._entropy_sum, self._tokens = float(state["batch_entropy_sum"]), int(state["batch_tokens"])
        elif state.get("last_entropy") is not None:  # a checkpoint from before rollout-batch entropy control
            self._entropy_sum, self._tokens = float(state["last_entropy"]), 1


def sampled_nll_sum(chunks) -> float:
    """Sum over the chunks' loss tokens of -log pi_behaviour (sampled_nll's numerator)."""
    return -sum(sum(c.old_logprobs) for c in chunks)
