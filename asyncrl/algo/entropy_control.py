"""Adaptive entropy control (Skywork-OR1 section 3.2.5, eq. 3.2), a tiny stateful controller.

    alpha_k = c_k * 1{e_k <= tgt},   c_{k+1} = c_k + Delta if e_k < tgt,
                                     c_{k+1} = c_k - Delta if e_k > tgt,   c_0 = 0

`update(e_k)` returns alpha_k, the entropy coefficient of step k (loss -= alpha_k * H), and then
moves c one step of Delta toward raising the entropy to the target (c is unchanged when
e_k == tgt). The paper used tgt = 0.2, Delta = 0.005.

Deviations: c is kept in [0, c_max] (the paper states alpha_k >= 0 but gives no upper bound;
c_max = inf reproduces it). The paper measures e_k on the actor's rollouts ("estimated from the
rollout buffer"); asyncrl feeds the learner-side entropy of the current policy over the batch's
loss tokens, which stays meaningful when rollouts are off-policy (the actors' policy lags). When
that entropy is only known after the step's backward, the caller passes e_{k-1}, a one-step lag.
k counts rollout batches, the paper's training steps (learner/entropy_schedule.py calls update
once per batch; every optimizer step of the batch uses the alpha it returned).
"""

from __future__ import annotations

import math


class AdaptiveEntropyController:
    def __init__(self, target: float, delta: float, c_max: float = math.inf) -> None:
        if delta <= 0:
            raise ValueError(f"delta must be > 0, got {delta}")
        if c_max < 0:
            raise ValueError(f"c_max must be >= 0, got {c_max}")
        self.target = target
        self.delta = delta
        self.c_max = c_max
        self.coef = 0.0  # c_k
        self.num_updates = 0  # k
        self.last_alpha = 0.0

    def update(self, entropy: float) -> float:
        """Take e_k, return alpha_k = c_k * 1{e_k <= tgt} and advance to c_{k+1}."""
        if math.isnan(entropy):
            raise ValueError("entropy is NaN")
        alpha = self.coef if entropy <= self.target else 0.0
        if entropy < self.target:
            self.coef = min(self.coef + self.delta, self.c_max)
        elif entropy > self.target:
            self.coef = max(self.coef - self.delta, 0.0)
        self.num_updates += 1
        self.last_alpha = alpha
        return alpha

    @property
    def saturated(self) -> bool:
        """c is at its cap: the controller cannot raise it any further."""
        return self.coef >= self.c_max

    def metrics(self) -> dict[str, float]:
        """alpha_k, c and `saturated` (1.0 while c sits at c_max; averaged over steps, the share
        of them a cap too low for the model's entropy gradient held the controller at)."""
        return {"entropy_control/alpha": self.last_alpha, "entropy_control/c": self.coef,
                "entropy_control/saturated": float(self.saturated)}

    def state_dict(self) -> dict[str, float | int]:
        return {"coef": self.coef, "num_updates": self.num_updates, "last_alpha": self.last_alpha,
                "target": self.target, "delta": self.delta, "c_max": self.c_max}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore c_k and the step count; target, delta and c_max stay as configured."""
        coef = float(state["coef"])
        if not 0.0 <= coef <= self.c_max:
            raise ValueError(f"saved coefficient {coef} is outside [0, {self.c_max}]")
        self.coef = coef
        self.num_updates = int(state["num_updates"])
        self.last_alpha = float(state.get("last_alpha", 0.0))
