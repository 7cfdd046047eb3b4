"""What a split of GPUs could do at best, in closed form: the generation side's token rate with
every engine full, and the training side's with the learner never waiting for data. Their
minimum is the ideal a schedule is measured against (`fraction_of_ideal`)."""

from __future__ import annotations

import math

from asyncrl.twin.costs import EngineCost, LearnerCost, PushCost


def gen_tokens_per_s(cost: EngineCost, engines: int, max_num_seqs: int, kv_tokens: int, prompt_tokens: int,
                     mean_len: float, mean_sq_len: float) -> float:
    """Response tokens a second from `engines` engines running full batches forever. A request
    holds on average prompt + E[L^2] / (2 E[L]) tokens of context over its steps (a long
    response spends more steps, at more context); each is prefilled once per E[L] tokens."""
    context = prompt_tokens + mean_sq_len / (2 * mean_len)
    batch = max(1, min(max_num_seqs, math.floor(kv_tokens / context)))
    step = cost.c0_s + cost.c_seq_s * batch + cost.c_ctx_s * batch * context + cost.c_prefill_s * batch * prompt_tokens / mean_len
    return engines * batch / step


def train_tokens_per_s(learner: LearnerCost, push: PushCost, token_budget: int, prompt_tokens: int,
                       mean_len: float) -> float:
    """Loss tokens a second of a learner that trains Phi a step and pushes after each."""
    forwarded = token_budget * (1 + prompt_tokens / mean_len)
    return token_budget / (learner.step_s(round(forwarded)) + push.push_s())


def keep_fraction(alpha: float, beta: float, group_size: int) -> float:
    """Share of groups with mixed rewards when each prompt's pass rate is Beta(alpha, beta):
    1 - E[p^n] - E[(1 - p)^n], with E[p^n] = prod_{i<n} (alpha + i) / (alpha + beta + i)."""
    all_right = all_wrong = 1.0
    for i in range(group_size):
        all_right *= (alpha + i) / (alpha + beta + i)
        all_wrong *= (beta + i) / (alpha + beta + i)
    return 1.0 - all_right - all_wrong
