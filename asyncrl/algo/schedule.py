"""How many optimizer steps one rollout batch feeds (Skywork-OR1 section 4.4, eq. 4.1).

    N_SGD = D_R / D_T * N_reuse

D_R prompts per rollout batch, D_T prompts per mini-batch (one optimizer step), N_reuse passes
over the rollout batch (Skywork-OR1 Figure 15). N_SGD = 1 is on-policy; Skywork-OR1 found that
N_SGD > 1 speeds up entropy collapse, and trained its 7B/32B models with N_SGD = 1.

With the token budget (Ring-lite C3PO, budget aggregation) each optimizer step's loss is divided
by Phi, the same constant every step. The two combine as follows: a rollout batch of D_R prompts
is consumed in D_R / D_T mini-batches of D_T prompts, each mini-batch being one optimizer step
whose loss is sum_t l_t / Phi, and the whole sequence of mini-batches is passed N_reuse times.
Setting Phi near the expected loss tokens of D_T prompts (D_T * group size * mean response
length) keeps a step's gradient scale close to token_mean's. When asyncrl's learner
instead fills each step greedily up to Phi tokens (C3PO's token-budgeted sampling), the
mini-batch size D_T is implicit, and N_SGD counts the steps one rollout batch's tokens fill.
"""

from __future__ import annotations


def num_sgd_steps(rollout_batch_prompts: int, minibatch_prompts: int, num_reuse: int = 1) -> int:
    """N_SGD = D_R / D_T * N_reuse, with D_R divisible by D_T and every count positive."""
    for name, value in (("rollout_batch_prompts", rollout_batch_prompts),
                        ("minibatch_prompts", minibatch_prompts), ("num_reuse", num_reuse)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if rollout_batch_prompts % minibatch_prompts:
        raise ValueError(f"rollout batch of {rollout_batch_prompts} prompts is not divisible "
                         f"into mini-batches of {minibatch_prompts}")
    return rollout_batch_prompts // minibatch_prompts * num_reuse


def minibatch_order(
    rollout_batch_prompts: int, minibatch_prompts: int, num_reuse: int = 1
) -> list[range]:
    """The prompts of each optimizer step in order: N_reuse passes over D_R / D_T mini-batches."""
    num_sgd_steps(rollout_batch_prompts, minibatch_prompts, num_reuse)
    starts = range(0, rollout_batch_prompts, minibatch_prompts)
    one_pass = [range(s, s + minibatch_prompts) for s in starts]
    return one_pass * num_reuse
