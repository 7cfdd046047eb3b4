"""Off-policy corrections: alternative policy losses and behaviour weights (pure torch).

Two ratios meet here. A policy loss takes r_t = exp(logp_t - old_t) between `logprobs` (pi_theta,
with gradient) and `old_logprobs` (whatever anchor the caller picks). A behaviour weight corrects
for the gap between pi_anchor (the trainer's logprobs at the start of the step / rollout batch)
and the behaviour policy pi_b (the inference engine's logprobs): it takes log_ratio_t =
log pi_anchor - log pi_b of the sampled token, detached.

Policy losses (per-token terms l_t [T], aggregated by aggregation.py like clipped_policy_loss):

    is     l_t = -r_t A_t                                   (Tinker's "importance_sampling" loss)
    cispo  l_t = -sg(min(r_t, 1 + eps_high)) A_t logp_t     (MiniMax-M1 eq. 4-5: no lower bound;
           an optional one, max(., 1 - eps_low), is a choice)
    gspo   l_t = -min(s_it A_t, clip(s_it, 1 - eps_low, 1 + eps_high) A_t),
           s_it = sg(s_i) exp(logp_t - sg(logp_t)),  s_i = exp(mean_{t in i} (logp_t - old_t))
                                                            (GSPO-token, Zheng et al. eq. 13-14)
    m2po   l_t = -M_t r_t A_t, M_t = 0 on the tokens of largest (log q_t)^2, masked until the
           mean (log q_t)^2 of the rest is <= tau            (M2PO, Zheng et al., arXiv 2510.01161)
           q_t = pi_theta / pi_b, the behaviour policy's ratio, whatever anchor r_t takes (with
           decoupled PPO r_t is to pi_prox, 1 on a streaming step, and M2 over it would mask
           nothing); the candidates for the mask are every token, or only those where PPO's clip
           would act (the authors' code)

Behaviour weights w_t [T], detached, that multiply the per-token loss:

    token_tis  w_t = min(exp(log_ratio_t), C)                (Yao et al. 2025, truncated IS)
    seq_tis    w_t = min(exp(sum_{u in i(t)} log_ratio_u), C)
    icepop     w_t = k_t if low <= k_t <= high else 0, k_t = exp(log_ratio_t)   (Ring-1T, IcePop)

Every exp of a log-ratio is clamped as verl clamps it: a token's log r_t at +-20
(LOG_RATIO_CLAMP), a sequence's mean log-ratio (GSPO) at 10 (SEQ_LOG_RATIO_CLAMP), and an
untruncated behaviour weight's log at 20: a ratio of e^20 (5e8) already carries no information,
and an inf one makes the step's gradient NaN.

Deviations: GSPO's and seq_tis's "sequence" is the part of a response trained in this step (a
response split across two steps gets two sequence ratios), identified by `seq_ids`. GSPO averages
each sequence's tokens (1/|y_i|); here that is the seq_mean_token_mean aggregation, and another
aggregation weights the same per-token terms differently. M2PO's masking rule was checked against
AReaL's M2PO docs and implementation, not the paper's text; see m2po_threshold.
"""

from __future__ import annotations

import math

import torch

from asyncrl.algo.policy_loss import LOG_RATIO_CLAMP, clamp_log_ratio, clipped_policy_loss

SEQ_LOG_RATIO_CLAMP = 10.0
"""GSPO's sequence mean log-ratio is clamped at this before exp (verl's GSPO value)."""

POLICY_LOSSES = ("ppo", "is", "cispo", "gspo", "m2po")
"""ppo is clipped_policy_loss in policy_loss.py; the others are below."""
BEHAVIOUR_WEIGHTS = ("token_tis", "seq_tis", "icepop", "none")
"""none is the weight 1."""

Diag = dict[str, torch.Tensor]


def unclipped_is_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, Diag]:
    """l_t = -exp(logp_t - old_t) * A_t with no clip (Tinker's "importance_sampling" loss).

    Shapes: inputs [T]. Returns loss [T] and {"ratio": r_t [T]}.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    ratio = torch.exp(clamp_log_ratio(logprobs - old_logprobs))
    return -ratio * advantages, {"ratio": ratio.detach()}



def cispo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, eps_low: float | None,
    eps_high: float
) -> tuple[torch.Tensor, Diag]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): l_t = -sg(min(r_t, 1 + eps_high)) A_t logp_t.

    The paper clips the IS weight above only (its eps_low is set large enough never to act);
    `eps_low` (None: no lower bound) adds max(., 1 - eps_low) for those who want a band. The
    weight is detached and the token never dropped: d l_t / d logp_t is -w_t A_t for every token.
    The loss's value is not a surrogate of the return (it scales with logp), only its gradient is
    meaningful.
    Shapes: inputs [T]. Returns loss [T] and [T] diagnostics: ratio, clipped_low (r < 1 - eps_low;
    never without a lower bound), clipped_high (r > 1 + eps_high). Unlike PPO's flags these only
    say the weight was clipped, whatever the advantage's sign, and the token still has a gradient.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _check_eps(0.0 if eps_low is None else eps_low, eps_high)
    with torch.no_grad():
        ratio = torch.exp(clamp_log_ratio(logprobs - old_logprobs))
        low = None if eps_low is None else 1.0 - eps_low
        weight = torch.clamp(ratio, low, 1.0 + eps_high)
        clipped_low = torch.zeros_like(ratio, dtype=torch.bool) if low is None else ratio < low
        diag = {"ratio": ratio, "clipped_low": clipped_low, "clipped_high": ratio > 1.0 + eps_high}
    return -weight * advantages * logprobs, diag


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    seq_ids: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, Diag]:
    """GSPO-token (Zheng et al., arXiv 2507.18071, eq. 13-14): PPO's clipped term on s_it.

    s_i = exp(mean over sequence i's tokens of (logp - old)), taken in float64 with the mean
    clamped at SEQ_LOG_RATIO_CLAMP (verl's GSPO; exp(mean) of a long sequence overflows); s_it has the value
    s_i and the gradient of token t alone (d s_it / d logp_t = s_i), so an unclipped token's
    gradient is -s_i A_t and a clipped one's is 0. Tokens of a sequence need not be contiguous.
    Shapes: inputs [T], seq_ids [T] integer (any values; equal ids = one sequence). Returns loss
    [T] and [T] diagnostics: ratio (s_i of the token's sequence), clipped_low (s_i < 1 - eps_low
    with A < 0) and clipped_high (s_i > 1 + eps_high with A > 0), as in clipped_policy_loss: a
    ratio exactly at a bound is not clipped.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, seq_ids=seq_ids)
    _check_eps(eps_low, eps_high)
    with torch.no_grad():
        mean_log_ratio = _per_sequence(logprobs - old_logprobs, seq_ids, mean=True)
        seq_ratio = torch.exp(torch.clamp(mean_log_ratio, max=SEQ_LOG_RATIO_CLAMP)).to(logprobs.dtype)
    token_ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())  # value s_i, gradient of logp_t
    unclipped = token_ratio * advantages
    clipped = torch.clamp(token_ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    diag = {
        "ratio": seq_ratio,
        "clipped_low": (seq_ratio < 1.0 - eps_low) & (advantages < 0),
        "clipped_high": (seq_ratio > 1.0 + eps_high) & (advantages > 0),
    }
    return -torch.minimum(unclipped, clipped), diag


M2PO_CANDIDATES = ("all", "clip")
"""Which tokens M2PO may mask: all (AReaL's reading) or clip, only where PPO's clip would act
(A > 0 with q > 1 + eps_high, or A < 0 with q < 1 - eps_low: the authors' code)."""


def m2po_log_ratio(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> torch.Tensor:
    """log q_t = log pi_theta - log pi_b as M2PO squares it: the float64 difference of the two
    (the threshold pass and the loss both take it this way, so a token at the cut falls on the same
    side in both; a float32 difference rounds differently). Detached."""
    return logprobs.detach().to(torch.float64) - behaviour_logprobs.detach().to(torch.float64)


def m2po_candidates(log_ratio: torch.Tensor, advantages: torch.Tensor, which: str, eps_low: float,
                    eps_high: float) -> torch.Tensor:
    """The tokens M2PO may mask [T] bool (M2PO_CANDIDATES), from m2po_log_ratio's log q_t."""
    if which == "all":
        return torch.ones_like(log_ratio, dtype=torch.bool)
    if which != "clip":
        raise ValueError(f"unknown M2PO candidates {which!r} (allowed: {', '.join(M2PO_CANDIDATES)})")
    q = torch.exp(clamp_log_ratio(log_ratio.to(torch.float64)))
    adv = advantages.detach().to(q.device)
    return ((adv > 0) & (q > 1.0 + eps_high)) | ((adv < 0) & (q < 1.0 - eps_low))


def m2po_threshold(log_ratio: torch.Tensor, tau: float, candidates: torch.Tensor | None = None) -> float:
    """The smallest squared log-ratio M2PO masks over the whole step, or math.inf if none.

    M2PO (Zheng et al., "Prosperity before Collapse", arXiv 2510.01161): with M2 = mean_t
    (log q_t)^2 over all N tokens, the candidates (default all) of largest (log q_t)^2 are masked,
    largest first, until the M2 of the N - k tokens left is <= tau (paper: tau = 0.04), or no
    candidate is left. Masking the largest first also masks the fewest tokens. If even the
    smallest (log q_t)^2 alone exceeds tau every candidate is masked (AReaL's implementation keeps
    one token instead; it also stops at M2 < tau rather than <= tau).
    Pass the step's m2po_log_ratio from all micro-batches and ranks (and their candidates), the
    same values m2po_loss will see, so every micro-batch applies one cut.
    Shapes: log_ratio [T] (float64, detached here), candidates [T] bool. One host sync.
    """
    _check_shapes(log_ratio=log_ratio)
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    squared = log_ratio.detach().to(torch.float64) ** 2
    count = squared.numel()
    if count == 0:
        return math.inf
    if candidates is None:
        candidates = torch.ones_like(squared, dtype=torch.bool)
    candidates = candidates.to(squared.device)
    masked_first = torch.sort(squared[candidates], descending=True).values
    # kept_mean[k]: M2 of the tokens left after masking the k largest candidates, k = 0 .. C; the
    # candidates' part summed from the smallest up (suffix sums), which keeps it exact at a tie
    suffix = torch.flip(torch.cumsum(torch.flip(masked_first, (0,)), 0), (0,))
    kept_sum = squared[~candidates].sum() + torch.cat([suffix, suffix.new_zeros(1)])
    left = torch.arange(count, count - masked_first.numel() - 1, -1, dtype=torch.float64, device=squared.device)
    kept_mean = kept_sum / left.clamp(min=1)
    fits = torch.nonzero(kept_mean <= tau)
    num_masked = int(fits[0, 0]) if fits.numel() else masked_first.numel()
    return math.inf if num_masked == 0 else float(masked_first[num_masked - 1])


def m2po_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, threshold: float,
    behaviour_logprobs: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Diag]:
    """M2PO's loss (arXiv 2510.01161): l_t = -M_t r_t A_t, unclipped, M_t = 0 where a candidate's
    (log q_t)^2 >= threshold.

    r_t = exp(logp_t - old_t) against whatever anchor the caller passes (pi_b, or decoupled PPO's
    pi_prox); q_t is to `behaviour_logprobs` (default: the anchor), taken by m2po_log_ratio as the
    threshold pass took it; `threshold` comes from m2po_threshold, `candidates` [T] bool from
    m2po_candidates (default all). Tokens tied with the cut are all masked, so a tie can mask a
    few more tokens than the greedy count. A masked token's loss and gradient are exactly 0 (its
    ratio is never exponentiated, so it cannot overflow).
    Shapes: inputs [T]. Returns loss [T] and [T] diagnostics: ratio, masked (bool).
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0 (math.inf masks nothing), got {threshold}")
    log_ratio = clamp_log_ratio(logprobs - old_logprobs)
    with torch.no_grad():
        q = m2po_log_ratio(logprobs, old_logprobs if behaviour_logprobs is None else behaviour_logprobs)
        masked = q ** 2 >= threshold
        if candidates is not None:
            masked &= candidates.to(masked.device)
        diag = {"ratio": torch.exp(log_ratio.detach()), "masked": masked}
    ratio = torch.exp(torch.where(masked, torch.zeros_like(log_ratio), log_ratio))
    return -torch.where(masked, torch.zeros_like(ratio), ratio * advantages), diag


def token_tis_weight(log_ratio: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level truncated IS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): w_t = min(pi_anchor / pi_b, C).

    Shapes: log_ratio [T]. Returns weight [T] (detached) and capped [T] bool (ratio > C).
    """
    _check_shapes(log_ratio=log_ratio)
    _check_cap(cap)
    ratio = torch.exp(log_ratio.detach())  # inf past float's range: clamped to the cap below
    return torch.clamp(ratio, max=cap), ratio > cap


def seq_tis_weight(log_ratio: torch.Tensor, seq_ids: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level truncated IS (Yao et al. 2025): w_i = min(prod_{t in i} pi_anchor / pi_b, C),
    the same weight on every token of sequence i.

    The sum of log-ratios is taken in float64 and the exponent clamped just above log C, so a long
    sequence's product never becomes inf on the way to the cap.
    Shapes: log_ratio [T], seq_ids [T] integer (any values, tokens of a sequence need not be
    contiguous). Returns weight [T] (detached, log_ratio's dtype) and capped [T] bool (product > C).
    """
    _check_shapes(log_ratio=log_ratio, seq_ids=seq_ids)
    _check_cap(cap)
    sum_log_ratio = _per_sequence(log_ratio.detach(), seq_ids, mean=False)
    product = torch.exp(torch.clamp(sum_log_ratio, max=math.log(cap) + 1.0))
    return torch.clamp(product, max=cap).to(log_ratio.dtype), product > cap


def icepop_weight(log_ratio: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop's masked IS (Ring-1T, arXiv 2510.18855, M(k; alpha, beta), paper alpha=0.5, beta=5):
    w_t = k_t if low <= k_t <= high else 0, k_t = pi_anchor / pi_b.

    Shapes: log_ratio [T]. Returns weight [T] (detached) and masked [T] bool (k_t outside the band).
    """
    _check_shapes(log_ratio=log_ratio)
    if not 0 < low < 1 < high:
        raise ValueError(f"icepop needs 0 < low < 1 < high, got low={low}, high={high}")
    ratio = torch.exp(log_ratio.detach())
    masked = (ratio < low) | (ratio > high)
    return torch.where(masked, torch.zeros_like(ratio), ratio), masked


def _per_sequence(values: torch.Tensor, seq_ids: torch.Tensor, *, mean: bool) -> torch.Tensor:
    """Sum (or mean) of `values` over each token's sequence, in float64, broadcast back to [T]."""
    _, index = torch.unique(seq_ids, return_inverse=True)
    num_seqs = int(index.max()) + 1 if index.numel() else 0
    totals = torch.zeros(num_seqs, dtype=torch.float64, device=values.device)
    totals.index_add_(0, index, values.to(torch.float64))
    if mean:
        totals = totals / torch.bincount(index, minlength=num_seqs).to(torch.float64)
    return totals[index]


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 1 or any(s != first for s in shapes.values()):
        raise ValueError(f"expected 1-D tensors of one length [T], got {shapes}")
    seq_ids = tensors.get("seq_ids")
    if seq_ids is not None and (seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool):
        raise ValueError(f"seq_ids must be an integer tensor, got {seq_ids.dtype}")


def _check_eps(eps_low: float, eps_high: float) -> None:
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low}, {eps_high}")


def _check_cap(cap: float) -> None:
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")


def policy_terms(
    name: str,
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    seq_ids: torch.Tensor | None = None,
    m2po_cut: float = math.inf,
    behaviour_logprobs: torch.Tensor | None = None,
    m2po_candidates: torch.Tensor | None = None,
    cispo_eps_low: float | None = None,
) -> tuple[torch.Tensor, Diag]:
    """The per-token policy loss `name` (POLICY_LOSSES) against `anchor_logprobs`, and its diag.
    `seq_ids` is needed by gspo; m2po takes `m2po_cut` (m2po_threshold over the whole step), its
    `m2po_candidates` and the `behaviour_logprobs` its mask is taken against (default: the
    anchor); dual_clip applies to ppo only, cispo_eps_low (None: no lower bound) to cispo only."""
    if name == "ppo":
        return clipped_policy_loss(logprobs, anchor_logprobs, advantages, eps_low, eps_high, dual_clip=dual_clip)
    if name == "is":
        return unclipped_is_loss(logprobs, anchor_logprobs, advantages)
    if name == "cispo":
        return cispo_loss(logprobs, anchor_logprobs, advantages, cispo_eps_low, eps_high)
    if name == "gspo":
        if seq_ids is None:
            raise ValueError("gspo needs seq_ids")
        return gspo_loss(logprobs, anchor_logprobs, advantages, seq_ids, eps_low, eps_high)
    if name == "m2po":
        return m2po_loss(logprobs, anchor_logprobs, advantages, m2po_cut, behaviour_logprobs, m2po_candidates)
    raise ValueError(f"unknown policy loss {name!r} (allowed: {', '.join(POLICY_LOSSES)})")


def behaviour_weight(
    name: str,
    log_ratio: torch.Tensor,
    *,
    cap: float | None = None,
    seq_ids: torch.Tensor | None = None,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
) -> tuple[torch.Tensor, Diag]:
    """The behaviour weight `name` (BEHAVIOUR_WEIGHTS) of log_ratio = log pi_anchor - log pi_b, and
    its diag: is_weight, is_weight_capped (token_tis / seq_tis: the cap acted)
    and, for icepop, is_weight_masked. Untruncated (cap None), a weight is still bounded by
    e^LOG_RATIO_CLAMP, a sequence's product too: never inf, so never a NaN gradient."""
    if name == "none":
        weight = torch.ones_like(log_ratio)
        return weight, {"is_weight": weight, "is_weight_capped": torch.zeros_like(log_ratio, dtype=torch.bool)}
    if name == "icepop":
        weight, masked = icepop_weight(log_ratio, icepop_low, icepop_high)
        return weight, {"is_weight": weight, "is_weight_masked": masked}
    bound = math.exp(LOG_RATIO_CLAMP) if cap is None else cap  # untruncated: never inf all the same
    if name == "token_tis":
        weight, capped = token_tis_weight(log_ratio, bound)
    elif name == "seq_tis":
        if seq_ids is None:
            raise ValueError("seq_tis needs seq_ids")
        weight, capped = seq_tis_weight(log_ratio, seq_ids, bound)
    else:
        raise ValueError(f"unknown behaviour weight {name!r} (allowed: {', '.join(BEHAVIOUR_WEIGHTS)})")
    return weight, {"is_weight": weight, "is_weight_capped": capped}
