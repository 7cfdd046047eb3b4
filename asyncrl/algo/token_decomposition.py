"""Off-policy decomposition of one optimizer step's tokens into plotting-ready metrics (pure torch).

A trained token's log-ratio against the policy that sampled it,

    d_t = log pi_theta(a_t) - log pi_b(a_t),

mixes two errors: staleness, s_t = v_learner - v_token > 0 (pi_b is an older policy), and
trainer/engine mismatch (the engine's logprob under the same weights differs from the trainer's:
precision, kernels). A staleness-0 token was sampled with the trainer's own weights, so its d_t
is mismatch alone; the staleness buckets then show what the lag adds on top.

Every bucket B (a set of the step's N tokens) reports

    tokens = |B|,  frac = |B| / N
    entropy = mean_B H_t,  log_ratio = mean_B d_t,  abs_log_ratio = mean_B |d_t|
    clip_low, clip_high, clip_dual = mean_B of the flag
    cov_logp_adv = mean_B (log pi_theta(a_t) - mean_B log pi_theta) * (A_t - mean_B A)
    ratio_mean = mean_B r_t,  ratio_sq_mean = mean_B r_t^2,  r_t = exp(min(d_t, 20))

cov_logp_adv is the population covariance (divided by |B|) of Cui et al. 2025 (arXiv 2505.22617,
§3: under natural policy gradient, entropy changes by about -eta * Cov(log pi, A); §4's Clip-Cov
and KL-Cov rank tokens by the same centered product). Like their §4 it pools the bucket's tokens,
not a covariance within each state. ratio_mean and ratio_sq_mean are the moments from which the
buffer estimates a batch's ESS before training it (algo/batch_ess.py, `buffer.stale_policy: ess`);
d_t is clamped to 20 before exp, since r_t^2 overflows float64 from d_t ~ 355 on and one inf would
make the bucket's moments useless (a token that far off counts as r_t = e^20, still dominating
ratio_sq_mean). An empty bucket reports only tokens and frac (0), no NaN.

Buckets: by staleness, 0, 1, 2, 3-4, 5+; by entropy, the `top` = ceil(f * N) tokens of highest
H_t (f = top_entropy_frac; ties go to the earlier token of the table) and the rest, the
high-entropy "forking tokens" of Wang et al. 2025 (arXiv 2506.01939, f = 0.2); by full response
length L against max_tokens M: len_q1 L <= M/4 < len_q2 <= M/2 < len_q3 <= 3M/4 < len_q4.

Step-wide, with r_t = exp(d_t) over the N tokens:

    mismatch_abs = mean_{s_t = 0} |d_t|
    mismatch_k3  = mean_{s_t = 0} exp(min(d_t, 20)) - d_t - 1   (Schulman, "Approximating KL
                   divergence", 2020: a_t ~ pi_b, so it is unbiased for KL(pi_b || pi_theta),
                   engine || trainer, wherever d_t <= 20)
    sampler_k3   = mean over all N tokens of exp(min(d_t, 20)) - d_t - 1: KL(pi_b || pi_theta) of
                   the sampler to the trainer, staleness and mismatch together (Tinker's
                   "sampler-trainer KL")
    Both clamp d_t in the exponential only (RATIO_LOG_CLAMP, as the ratios), so a token with d_t
    beyond 20 adds e^20 - d_t - 1, not inf.
    ess          = (sum r_t)^2 / (N * sum r_t^2), in (0, 1]; ess_is_weight the same of the
                   importance weights the loss applied, when given

Everything runs in float64 on the table's device with one host sync at the end. Every metric is
a function of the concatenated table, so splitting the step over micro-batches and ranks and
`TokenTable.concat`-ing the parts (in token order) changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from asyncrl.algo.batch_ess import NAMESPACE, STALENESS_BUCKETS

BUCKET_STATS = ("entropy", "log_ratio", "abs_log_ratio", "clip_low", "clip_high", "clip_dual", "cov_logp_adv",
                "ratio_mean", "ratio_sq_mean")
"""What a non-empty bucket reports besides `tokens` and `frac`."""
RATIO_LOG_CLAMP = 20.0
"""d_t is clamped to this before ratio_mean and ratio_sq_mean take exp(d_t)."""


@dataclass
class TokenTable:
    """One row per loss token of the step; every field [N] on one device."""

    staleness: Tensor
    """int64: learner version at the step minus the version that generated the token (>= 0)."""
    entropy: Tensor
    """H_t of the current policy at the token's position."""
    logprob: Tensor
    """log pi_theta(a_t), the current trainer policy (detached)."""
    behaviour_logprob: Tensor
    """log pi_b(a_t), from the engine that sampled the token."""
    advantage: Tensor
    clipped_low: Tensor
    """bool, as clipped_policy_loss flags it; likewise clipped_high and clipped_dual."""
    clipped_high: Tensor
    clipped_dual: Tensor
    response_length: Tensor
    """int64: full length of the token's response (SequenceChunk keeps only up to loss_end)."""
    is_weight: Tensor | None = None
    """The importance weight the loss applied to the token, if any."""

    def __post_init__(self) -> None:
        shapes = {f.name: tuple(t.shape) for f in fields(self) if (t := getattr(self, f.name)) is not None}
        if len(set(shapes.values())) != 1 or len(shapes["staleness"]) != 1:
            raise ValueError(f"every field must be one [N] vector, got {shapes}")

    @property
    def num_tokens(self) -> int:
        return self.staleness.shape[0]

    @classmethod
    def from_policy_loss(cls, learner_version: int, versions: Tensor, logprob: Tensor, entropy: Tensor,
                         behaviour_logprob: Tensor, advantage: Tensor, diag: dict[str, Tensor],
                         response_length: Tensor) -> TokenTable:
        """A micro-batch's table from what the learner's step holds: `versions` (MicroBatch.versions),
        `diag` from `clipped_policy_loss` (a flag it did not compute is all False; its is_weight,
        if any, is taken), the rest [T] over the loss tokens. Everything is detached."""
        no = torch.zeros_like(advantage, dtype=torch.bool)
        weight = diag.get("is_weight")
        return cls(
            staleness=(learner_version - versions).detach(), entropy=entropy.detach(), logprob=logprob.detach(),
            behaviour_logprob=behaviour_logprob.detach(), advantage=advantage.detach(),
            clipped_low=diag.get("clipped_low", no).detach(), clipped_high=diag.get("clipped_high", no).detach(),
            clipped_dual=diag.get("clipped_dual", no).detach(), response_length=response_length.detach(),
            is_weight=None if weight is None else weight.detach())

    def to_matrix(self) -> Tensor:
        """Every field as a row of one float64 [F, N] tensor (is_weight last, when given): what
        travels between learner ranks as one tensor instead of pickled objects. int64 and bool
        fields are exact in float64 (staleness and lengths are far below 2^53)."""
        return torch.stack([getattr(self, f.name).to(torch.float64) for f in fields(self)
                            if getattr(self, f.name) is not None])

    @classmethod
    def from_matrix(cls, m: Tensor) -> TokenTable:
        """`to_matrix`'s inverse (a 10th row is is_weight)."""
        names = [f.name for f in fields(cls)]
        if m.shape[0] not in (len(names) - 1, len(names)):
            raise ValueError(f"a token table matrix has {len(names) - 1} or {len(names)} rows, got {m.shape[0]}")
        kinds = {"staleness": torch.int64, "response_length": torch.int64, "clipped_low": torch.bool,
                 "clipped_high": torch.bool, "clipped_dual": torch.bool}
        return cls(**{name: (m[i].to(kinds[name]) if name in kinds else m[i])
                      for i, name in enumerate(names[:m.shape[0]])})

    @classmethod
    def concat(cls, tables: Sequence[TokenTable]) -> TokenTable:
        """One table of the step from its micro-batches' or ranks' tables, in token order."""
        if not tables:
            raise ValueError("no tables to concatenate")
        with_weight = [t.is_weight is not None for t in tables]
        if any(with_weight) and not all(with_weight):
            raise ValueError("is_weight is given for some tables and not others")
        return cls(**{f.name: None if getattr(tables[0], f.name) is None
                      else torch.cat([getattr(t, f.name) for t in tables]) for f in fields(cls)})


def bucket_masks(table: TokenTable, max_tokens: int, top_entropy_frac: float = 0.2) -> dict[str, Tensor]:
    """name -> bool mask [N] of each bucket, staleness, entropy and length buckets in that order."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if not 0.0 < top_entropy_frac < 1.0:
        raise ValueError(f"top_entropy_frac must be in (0, 1), got {top_entropy_frac}")
    stale, length = table.staleness, table.response_length
    masks = {name: (stale >= lo) if hi is None else (stale >= lo) & (stale <= hi)
             for name, lo, hi in STALENESS_BUCKETS}
    n = table.num_tokens
    # rounded first so that e.g. 0.07 * 100 = 7.000000000000001 keeps 7 tokens, not 8
    top = math.ceil(round(top_entropy_frac * n, 9))
    order = torch.sort(table.entropy, descending=True, stable=True).indices  # ties: earlier first
    is_top = torch.zeros(n, dtype=torch.bool, device=stale.device)
    is_top[order[:top]] = True
    masks[f"entropy_top{top_entropy_frac * 100:.6g}"] = is_top
    masks["entropy_rest"] = ~is_top
    # integer comparisons: L <= k * M / 4 exactly, whatever M
    q1, q2, q3 = 4 * length <= max_tokens, 2 * length <= max_tokens, 4 * length <= 3 * max_tokens
    masks.update(len_q1=q1, len_q2=q2 & ~q1, len_q3=q3 & ~q2, len_q4=~q3)
    return masks


def decompose(table: TokenTable, max_tokens: int, top_entropy_frac: float = 0.2) -> dict[str, float]:
    """The step's `offpolicy/...` metrics (module docstring) from its whole token table."""
    masks = bucket_masks(table, max_tokens, top_entropy_frac)
    n = table.num_tokens
    f64 = dict(dtype=torch.float64)
    member = torch.stack(list(masks.values())).to(**f64)  # [B, N]
    logp, adv = table.logprob.to(**f64), table.advantage.to(**f64)
    d = logp - table.behaviour_logprob.to(**f64)
    count = member.sum(dim=1)  # [B]
    per = count.clamp(min=1.0)
    ratio = torch.exp(d.clamp(max=RATIO_LOG_CLAMP))  # no inf in r^2 at a huge d_t (docstring)
    columns = torch.stack([table.entropy.to(**f64), d, d.abs(), table.clipped_low.to(**f64),
                           table.clipped_high.to(**f64), table.clipped_dual.to(**f64), logp, adv,
                           ratio, ratio * ratio], dim=1)
    means = (member @ columns) / per[:, None]  # [B, 10]
    # two-pass: centre on the bucket's means before multiplying, no E[xy] - E[x]E[y] cancellation
    cov = (member * (logp - means[:, 6:7]) * (adv - means[:, 7:8])).sum(dim=1) / per
    rows = torch.cat([count[:, None], means[:, :6], cov[:, None], means[:, 8:10]], dim=1)  # [B, 1 + 9]

    fresh = masks["stale_0"].to(**f64)
    k3 = torch.expm1(d.clamp(max=RATIO_LOG_CLAMP)) - d
    mismatch = torch.stack([fresh.sum(), (fresh * d.abs()).sum(), (fresh * k3).sum(), k3.sum()])
    ess = [_ess_parts(d, log=True)]
    if table.is_weight is not None:
        ess.append(_ess_parts(table.is_weight.to(**f64), log=False))
    values = torch.cat([rows.flatten(), mismatch, *ess]).tolist()  # the one host sync

    width = rows.shape[1]
    out: dict[str, float] = {}
    for i, name in enumerate(masks):
        tokens, *stats = values[i * width:(i + 1) * width]
        key = f"{NAMESPACE}/{name}"
        out[f"{key}/tokens"], out[f"{key}/frac"] = int(tokens), tokens / n if n else 0.0
        if tokens:
            out.update({f"{key}/{stat}": v for stat, v in zip(BUCKET_STATS, stats)})
    staled = sum(out[f"{NAMESPACE}/{name}/tokens"] for name, _, _ in STALENESS_BUCKETS)
    if staled != n:
        raise ValueError(f"{n - staled} of {n} tokens fall in no staleness bucket (negative staleness)")
    fresh_tokens, abs_sum, k3_sum, k3_all, *ess_parts = values[len(masks) * width:]
    out[f"{NAMESPACE}/mismatch_tokens"] = int(fresh_tokens)
    if n:
        out[f"{NAMESPACE}/sampler_k3"] = k3_all / n
    if fresh_tokens:
        out[f"{NAMESPACE}/mismatch_abs"] = abs_sum / fresh_tokens
        out[f"{NAMESPACE}/mismatch_k3"] = k3_sum / fresh_tokens
    for key, (num, den) in zip(("ess", "ess_is_weight"), zip(ess_parts[::2], ess_parts[1::2])):
        if den > 0:
            out[f"{NAMESPACE}/{key}"] = num / (n * den)
    return out


def _ess_parts(x: Tensor, log: bool) -> Tensor:
    """[(sum w)^2, sum w^2] of the weights w = x (>= 0), or w = exp(x) when `log`. ESS does not
    change when every weight is scaled, so the weights are divided by the largest first (exp(x -
    max x) for exp(x)): no overflow at a large d_t or weight. No tokens: [0, 0]."""
    if x.numel() == 0:
        return x.new_zeros(2)
    top = x.max()
    w = torch.exp(x - top) if log else x / torch.where(top > 0, top, 1.0)
    return torch.stack([w.sum() ** 2, (w * w).sum()])
