"""On-policy distillation (OPD): the student samples, a teacher scores every sampled token, and each
token's advantage gains the negative reverse KL of that token,

    A_t = A_group + coef * (log pi_teacher(y_t | y_<t) - log pi_behaviour(y_t | y_<t)),

log pi_behaviour being the logprob the student's engine sampled y_t with. Over the sampled tokens
the mean of log pi_behaviour - log pi_teacher is the usual single-sample estimate of the reverse KL
KL(pi_behaviour || pi_teacher) per token; maximising the advantage-weighted logprob with this term
lowers it (Agarwal et al. 2024, "On-policy distillation of language models"; Thinking Machines'
tinker-cookbook, whose `kl_penalty_coef` form this is, with no discount over later tokens). The
term is fixed at sampling time, so it is the same for every step that trains the token, however
stale, and the clip and corrections act on it as on the group's advantage.
"""

from __future__ import annotations

import torch

def distill_advantages(advantages: torch.Tensor, teacher_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                       coef: float) -> torch.Tensor:
    """[T] per-token advantages: the group's `advantages` plus coef * (log pi_teacher - log pi_b)."""
    return advantages + coef * (teacher_logprobs - behaviour_logprobs).to(advantages.dtype)
