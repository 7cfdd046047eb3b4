"""One optimizer step's work on a learner rank, from its part of the batch to the accumulated
gradient: what the step needs (`StepPlan`, from the batch's role and the algorithm config), its
micro-batches and the padding that keeps the ranks' collectives in step, the no-grad passes
(a rollout batch's pi_prox and entropy, the step's own e_k and MoE routing), and the loss
(policy_step.py). `LearnerRank` (rank.py) is the process around it: sockets, weights, checkpoints.

The step owns the algorithm's state across steps: the entropy schedule (adaptive control fed e_k
all-reduced over ranks), the reference policy and its resets, and decoupled PPO's pi_prox of the
open rollout batch (proximal.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.algo.aggregation import StepCounts
from asyncrl.algo.corrections import m2po_threshold
from asyncrl.config import AlgoConfig, LearnerConfig
from asyncrl.learner import collectives
from asyncrl.learner.collate import MicroBatch, collate, empty_chunk
from asyncrl.learner.entropy_schedule import EntropySchedule, sampled_nll_sum
from asyncrl.learner.micro_batches import micro_batches
from asyncrl.learner.model_forward import is_moe, policy_forward
from asyncrl.learner.phases import phase
from asyncrl.learner.policy_step import (MoeStep, forward_backward, fractions, m2po_log_ratios, measure_pass, padding_loss,
                                         routed_positions)
from asyncrl.learner.proximal import ProximalLogprobs
from asyncrl.learner.reference import ReferencePolicy
from asyncrl.types import Batch


@dataclass(frozen=True)
class StepPlan:
    """What one step runs besides its loss, decided from the batch's role (own: the step is its
    own rollout batch; open: the first step of a reused batch; continue: a later one) and the
    algorithm config."""

    open_pass: bool  # a no-grad pass over the opened rollout batch: pi_prox and its entropy (e_k)
    exact_entropy: bool  # e_k from a no-grad pass over the step itself
    routing: bool  # the MoE load-balance loss needs the step's expert fractions first
    sampled_entropy: bool  # e_k from the sampled tokens' NLL, no pass
    proximal: bool  # the ratio is taken against pi_prox, not the sampling policy
    m2po: bool  # M2PO's mask threshold over all ranks' log-ratios


def plan_step(batch: Batch, algo: AlgoConfig, entropy: EntropySchedule, moe: bool) -> StepPlan:
    # the opened batch's pass feeds only decoupled PPO's pi_prox and exact control's e_k: without
    # them it would be a forward over the whole rollout batch (N_SGD steps' tokens) for nothing
    return StepPlan(open_pass=(batch.role == "open" and bool(batch.opened_layout)
                               and (algo.decoupled or entropy.exact)),
                    exact_entropy=entropy.exact and batch.role == "own",
                    routing=moe and algo.moe_aux_loss_coef > 0,
                    sampled_entropy=entropy.sampled and entropy.needs_measure(batch.role),
                    proximal=batch.role != "own",
                    m2po=algo.policy_loss == "m2po")


def moe_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(experts per token, experts) of a mixture-of-experts model, (0, 0) for a dense one; read
    from the model before a backend wraps it (a DeepSpeed engine is not the model class)."""
    if not is_moe(model):
        return 0, 0
    config = model.config
    return (int(getattr(config, "num_experts_per_tok", 0)),
            int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)))


class PolicyStep:
    def __init__(self, backend, learner: LearnerConfig, algo: AlgoConfig, device: torch.device, world_size: int,
                 distributed: bool, pad_id: int, reference: ReferencePolicy | None, moe: tuple[int, int] = (0, 0),
                 max_response_tokens: int = 0, packed: bool = False):
        """`backend` holds the (wrapped) model and the optimizer; `reference` was copied from the
        model before any sharding; `moe`: the model's (experts per token, experts), `moe_shape`;
        `max_response_tokens`: the off-policy metrics' length quarters; `packed`: micro-batches
        in the packed layout (collate.py), which the model was checked to keep apart."""
        self.backend, self.cfg, self.algo, self.device = backend, learner, algo, device
        self.packed = packed
        self.world_size, self.distributed, self.pad_id = world_size, distributed, pad_id
        self.reference, self.max_response_tokens = reference, max_response_tokens
        self.moe_top_k, self.num_experts = moe
        self.entropy = EntropySchedule(algo)
        self.proximal = ProximalLogprobs()  # decoupled PPO's pi_prox of the open rollout batch

    @property
    def entropy_ctl(self):
        """The adaptive entropy controller; None without adaptive control."""
        return self.entropy.controller

    def run(self, batch: Batch, version: int) -> dict[str, float]:
        """This rank's part of one step forward and backward (and its padding); the step's
        metrics, all-reduced. The optimizer step is the caller's."""
        plan = plan_step(batch, self.algo, self.entropy, bool(self.moe_top_k))
        measured = self._open_rollout_batch(batch) if plan.open_pass else None
        mbs, pad = self._micro_batches(batch.chunks)
        counts = StepCounts(batch.num_loss_tokens_global, batch.num_sequences_global, batch.token_budget)
        step_measured, moe = self._measure(mbs, pad, counts.num_tokens, plan)
        if plan.sampled_entropy:
            measured = step_measured = self._sampled_nll(batch, counts.num_tokens)
        alpha, ctl_metrics = self.entropy.coef(batch.role, measured if batch.role == "open" else step_measured)
        # the padding first: forward_backward ends in an all-reduce of the step's metrics, which a
        # rank with fewer micro-batches would otherwise enter while the others still run forwards
        # and backwards, whose collectives (FSDP2, ZeRO-3 gathers) it would never join: a hang
        proximal = self.proximal.lookup if plan.proximal else None
        cut = math.inf
        if plan.m2po:
            log_ratio, candidates = m2po_log_ratios(self._forward, mbs, self.algo)
            self._padding(pad, grad=False)  # before the gather: the others may still run forwards
            if self.distributed:  # one gather of both, as rows of one matrix
                log_ratio, candidates = collectives.cat_over_ranks(torch.stack([log_ratio, candidates.double()]))
                candidates = candidates.bool()
            cut = m2po_threshold(log_ratio, self.algo.m2po_tau, candidates)
        ref_logprobs = self._reference_logprobs if self.reference else None
        if self.reference is not None and self.reference.before_backward:
            ref_logprobs = self._reference_first(mbs, pad)
        self._padding(pad, grad=True, moe=moe)
        metrics = forward_backward(self._forward, mbs, self.algo, counts, entropy_coef=alpha,
                                   ref_logprobs=ref_logprobs,
                                   proximal=proximal, moe=moe, backward=self._backward,
                                   reduce=collectives.all_reduce_tally if self.distributed else None, m2po_cut=cut,
                                   version=version if self.cfg.offpolicy_metrics else None,
                                   max_response_tokens=self.max_response_tokens)
        self.entropy.observe(metrics["entropy/learner"], metrics["learner/loss_tokens"])
        return {**metrics, **ctl_metrics, **self._rank_metrics(batch.chunks, mbs),
                "entropy/coef": alpha, "learner/opens_rollout_batch": float(batch.role != "continue")}

    def _backward(self, loss) -> None:
        with phase("backward"):
            self.backend.backward(loss)

    # -- forwards -------------------------------------------------------------------------------

    def _forward(self, mb):
        with self.backend.autocast():
            return policy_forward(self.backend.module, mb, self.cfg.entropy_chunk_tokens, self.device,
                                  moe=bool(self.moe_top_k), recompute_head=self.cfg.recompute_head,
                                  head_fp32=self.cfg.head_dtype == "float32")

    def _reference_logprobs(self, mb):
        with self.backend.autocast():  # the policy's numerics: KL is 0 right after a reset
            return self.reference.logprobs(mb)

    def _reference_first(self, mbs: list[MicroBatch], pad: int):
        """Every micro-batch's reference logprobs before any policy forward (a reference that
        changes the policy's weights in place to run: lora.py's AdapterReference), the padding's
        too, in step with the other ranks; what forward_backward looks them up in."""
        table = {id(mb): self._reference_logprobs(mb) for mb in mbs}
        for _ in range(pad):
            self._reference_logprobs(self._collate([empty_chunk(self.pad_id)]))
        return lambda mb: table[id(mb)]

    def _collate(self, chunks) -> MicroBatch:
        distill = self.algo.distill
        return collate(chunks, self.pad_id, packed=self.packed, distill_coef=distill.coef if distill.enabled else 0.0)

    def _micro_batches(self, chunks) -> tuple[list, int]:
        """This rank's micro-batches, and how many zero-loss ones it must add to match the
        busiest rank (sharded backends run collectives in every forward and backward)."""
        mbs = [self._collate(c) for c in micro_batches(chunks, self.cfg.micro_batch_tokens, self.packed)]
        mbs = [mb for mb in mbs if mb.num_loss_tokens]  # the loss step skips those: no forward to match
        pad = collectives.max_over_ranks(len(mbs)) - len(mbs) if self.distributed else 0
        self.backend.expect_backwards(len(mbs) + pad)
        return mbs, pad

    def _padding(self, count: int, grad: bool, moe: MoeStep | None = None) -> None:
        """`count` forwards (and backwards) that change nothing, in step with the other ranks; each
        backward's graph is a real micro-batch's (`padding_loss`; `moe` as forward_backward gets it)."""
        for _ in range(count):
            mb = self._collate([empty_chunk(self.pad_id)])
            with torch.set_grad_enabled(grad):
                out = self._forward(mb)
            if grad and self.reference is not None and self.reference.sharded \
                    and not self.reference.before_backward:
                self._reference_logprobs(mb)  # a real micro-batch's gathers come in this order
            if grad:
                self._backward(padding_loss(out, self.algo, moe))

    # -- the no-grad passes -----------------------------------------------------------------------

    @torch.no_grad()
    def _open_rollout_batch(self, batch: Batch) -> float | None:
        """The step opens a rollout batch: a no-grad pass over this rank's share of its responses
        under the current policy gives pi_prox for the batch's steps (decoupled PPO; the ranks sum
        their parts, each filling its own slots of the batch's layout, so all hold all of it) and
        the batch's mean entropy, over all ranks (exact entropy control's e_k)."""
        mbs = [self._collate(c) for c in micro_batches(batch.opened, self.cfg.micro_batch_tokens, self.packed)]
        pad = collectives.max_over_ranks(len(mbs)) - len(mbs) if self.distributed else 0
        mine, entropy = [], 0.0
        for mb in mbs:
            out = self._forward(mb)
            mine.append(out.logprobs.double().cpu())
            entropy += float(out.entropy.double().sum())
        self._padding(pad, grad=False)
        layout = batch.opened_layout
        num_tokens = sum(s.num_tokens for s in layout)
        if self.distributed:
            entropy = collectives.sum_over_ranks(entropy)
        if self.algo.decoupled:
            values = torch.zeros(num_tokens, dtype=torch.float64)
            start = sum(s.num_tokens for s in layout[:batch.opened_offset])
            if mine:
                values[start:start + sum(t.numel() for t in mine)] = torch.cat(mine)
            if self.distributed:
                values = collectives.sum_tensor_over_ranks(values)
            self.proximal.open(layout, values.float())
        return entropy / num_tokens if num_tokens else None

    def _measure(self, mbs, pad: int, num_tokens: int, plan: StepPlan) -> tuple[float | None, MoeStep | None]:
        """The no-grad pass over the step before its update, when the plan needs it, over all
        ranks: e_k, the current policy's mean entropy over the step's loss tokens (exact entropy
        control of a step that is its own rollout batch), and the MoE step's routed positions and
        expert fractions f (when the load-balance loss trains). One forward serves both."""
        entropy, counts = None, None
        if plan.exact_entropy or plan.routing:
            entropy, counts = measure_pass(self._forward, mbs, self.moe_top_k if plan.routing else 0,
                                           self.num_experts)
            self._padding(pad, grad=False)
            if self.distributed:
                entropy = collectives.sum_over_ranks(entropy)
                counts = collectives.sum_tensor_over_ranks(counts) if counts is not None else None
        moe = None
        if self.moe_top_k:
            positions = routed_positions(mbs)
            positions = int(collectives.sum_over_ranks(positions)) if self.distributed else positions
            moe = MoeStep(self.moe_top_k, self.num_experts, positions, None if counts is None else fractions(counts))
        return (entropy / max(num_tokens, 1) if plan.exact_entropy else None), moe

    def _sampled_nll(self, batch: Batch, step_tokens: int) -> float | None:
        """sampled_nll's e_k: over the rollout batch the step opens, or the step's own tokens."""
        opens = batch.role == "open"
        chunks = batch.opened if opens else batch.chunks
        num_tokens = sum(s.num_tokens for s in batch.opened_layout) if opens else step_tokens
        total = sampled_nll_sum(chunks)
        if self.distributed:
            total = collectives.sum_over_ranks(total)
        return total / num_tokens if num_tokens else None

    def _rank_metrics(self, chunks, mbs: list[MicroBatch]) -> dict[str, float]:
        """How the step was split: loss tokens and forward tokens (context included) per rank; and
        the padding its forwards computed, over all ranks (zero-loss micro-batches aside)."""
        mine = [sum(c.num_loss_tokens for c in chunks), sum(c.num_tokens for c in chunks),
                sum(mb.num_input_tokens for mb in mbs)]
        per_rank = collectives.gather_over_ranks(mine) if self.distributed else [mine]
        out: dict[str, float] = {"learner/ranks": self.world_size, "learner/packed": float(self.packed)}
        for r, (loss_tokens, tokens, _) in enumerate(per_rank):
            out[f"learner/loss_tokens_rank{r}"] = loss_tokens
            out[f"learner/tokens_rank{r}"] = tokens
        computed = sum(p[2] for p in per_rank)
        out["learner/padding_frac"] = 1.0 - sum(p[1] for p in per_rank) / computed if computed else 0.0
        return out

    # -- the algorithm's state ----------------------------------------------------------------------

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta and a fresh optimizer state (ProRL section 3.3.1). Collective."""
        if self.reference is None:
            raise ValueError("no reference policy to reset: set algo.kl.coef > 0 or algo.kl.track=true")
        # shard to shard where both are sharded, nothing gathered (reference.py)
        source = self.backend.module.named_parameters() if self.reference.sharded else self.backend.named_full_params()
        self.reference.reset_from(source)
        self.backend.reset_optimizer()

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's state for a checkpoint (the reference weights travel separately)."""
        return {**self.entropy.state_dict(), "num_reference_resets": self.reference.num_resets if self.reference else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entropy.load_state_dict(state)
        if self.reference is not None:
            self.reference.restore_resets(int(state.get("num_reference_resets", 0)))
