"""Rollout-batch update schedule (Skywork-OR1 section 4, eq. 4.1) on top of Phi-token steps.

Kept groups collect until D_R (rollout_batch_prompts) are held; then exactly D_R of them, in
admission order (the ledger's sequence number, so a batch's content and order do not depend on
which verifier answered first), are *sealed* into a rollout batch feeding N_SGD = D_R / D_T * N_reuse optimizer
steps (`algo.schedule.num_sgd_steps`); later groups collect for the next one. A batch is sealed
only when the previous one has nothing left that can fill a step.

Staleness is checked once, at sealing, against the learner version then: a token with
learner_version - version > max_staleness is dropped (a prefix, since versions never decrease
along a response; the rest keeps it as context, loss_start > 0). The N_SGD steps of a sealed batch
are off-policy on purpose (that is what N_SGD > 1 means) and are not checked again. This is why
TokenBuffer is not reused here: it re-checks staleness at every step.

Each of the N_reuse passes visits the groups in an order shuffled by
random.Random(f"{seed}/{batch index}/{pass index}"), so runs are reproducible. Then either:
- prompt mode (minibatch_prompts = D_T, Skywork-OR1): a pass is cut into D_R / D_T mini-batches;
  a step trains on every kept token of D_T groups, so its token count varies (the loss still
  divides by Phi, see algo/schedule.py). Groups keep arrival order inside a step (the gradient does
  not depend on it), so D_R = D_T, N_reuse = 1 is plain on-policy prompt order. Responses with no
  kept token, and mini-batches left with none, are skipped: a batch may take fewer than N_SGD steps.
- token mode (minibatch_prompts = None, Ring-lite C3PO with reuse): the passes are concatenated and
  cut as TokenBuffer cuts, exactly Phi = token_budget loss tokens a step (a response that does not
  fit gives a prefix, its rest opens the next step). The tail that cannot fill Phi is carried in
  front of the next rollout batch, so nothing is lost; a step crossing a pass boundary can hold the
  same token from two passes.

The learner needs to know where rollout batches begin: decoupled PPO's proximal policy is the
policy at the start of the batch, fixed over its N_SGD steps, and adaptive entropy control
moves once per batch (types.Batch.role). `take_opening` says, after each `next_batch`, whether
the step opened a rollout batch (and hands over that batch's responses, each once), continued
the open one, or is its own batch (prompt mode with N_SGD = 1).

Staleness metrics split a trained token's lag at the learner version its batch was sealed at,
which every chunk carries (`entered_at`; orchestrator/step_stats.py). In token mode the step that
opens a batch may also train the previous batch's carried tail (fewer than Phi tokens); those keep
their own batch's seal version, so their lag since then reads as reuse, and the asynchronous part
of every trained token's lag is at most max_staleness.

Accounting, exact at every moment (tokens_out and num_loss_tokens count every pass of a token):
    num_reuse * (tokens_in - tokens_dropped_stale) == tokens_out + num_loss_tokens
with num_loss_tokens = tokens left in sealed passes + num_reuse * tokens still collecting.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.algo.batch_ess import Moments
from asyncrl.algo.schedule import num_sgd_steps
from asyncrl.buffer.admission import rollout_batch_capacity
from asyncrl.buffer.base import (AdmissionView, BufferStats, ResponseCursor, cut_budget, group_from_state,
                                 group_to_state, stale_prefix, stats_from_state)
from asyncrl.types import Group, SequenceChunk, model_tokens


@dataclass
class RolloutBatchStats(BufferStats):
    rollout_batches_sealed: int = 0
    responses_all_stale: int = 0
    """Non-empty responses with every token stale at sealing (skipped)."""
    minibatches_skipped: int = 0
    """Prompt mode: mini-batches left with no loss token (skipped)."""


class RolloutBatchBuffer:
    """A `Buffer` (buffer/base.py) that trains each sealed rollout batch for N_SGD steps."""

    ess_estimate: None = None
    """Not estimated: a rollout batch is judged when it is sealed, and always discards what is stale."""

    def __init__(self, token_budget: int, max_staleness: int, rollout_batch_prompts: int,
                 minibatch_prompts: int | None = None, num_reuse: int = 1, seed: int = 0):
        if token_budget <= 0:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        # validates D_R, D_T | D_R and N_reuse (token mode has no D_T: check D_R alone)
        num_sgd_steps(rollout_batch_prompts, minibatch_prompts or rollout_batch_prompts, num_reuse)
        self.token_budget = token_budget
        self.max_staleness = max_staleness
        self.rollout_batch_prompts = rollout_batch_prompts
        self.minibatch_prompts = minibatch_prompts
        self.num_reuse = num_reuse
        self.seed = seed
        self.stats = RolloutBatchStats()
        self._collecting: list[tuple[int, Group]] = []  # (admission sequence number, group)
        self._collecting_tokens = 0
        self._stream: deque[ResponseCursor] = deque()  # token mode: all sealed passes, concatenated
        self._steps: deque[list[ResponseCursor]] = deque()  # prompt mode: one entry per planned step
        self._planned_tokens = 0
        self._batch_start_version: int | None = None
        self._opened: list[SequenceChunk] | None = None  # sealed since the last take_opening
        d_t = minibatch_prompts or rollout_batch_prompts
        self._one_step_batches = minibatch_prompts is not None and rollout_batch_prompts // d_t * num_reuse == 1

    @property
    def num_loss_tokens(self) -> int:
        """Loss tokens still to emit, every pass counted (collecting ones before any stale drop)."""
        return self._planned_tokens + self.num_reuse * self._collecting_tokens

    @property
    def batch_start_version(self) -> int | None:
        """The learner version the latest sealed batch was sealed at (= its first step's)."""
        return self._batch_start_version

    @property
    def steps_left(self) -> int:
        """Optimizer steps the sealed batches can still fill (admission plans the next seal by it)."""
        if self.minibatch_prompts is None:
            return self._planned_tokens // self.token_budget
        return len(self._steps)

    @property
    def num_collecting_groups(self) -> int:
        return len(self._collecting)

    def set_token_budget(self, token_budget: int) -> None:
        self.token_budget = token_budget

    def add_group(self, group: Group, seq: int | None = None) -> None:
        """`seq`: the group's admission sequence number (the sealing order); None: after every
        group added so far."""
        lengths = [m.sample.num_loss_tokens for m in group.samples]
        self.stats.responses_in += len(lengths)
        self.stats.responses_empty += lengths.count(0)
        self.stats.tokens_in += sum(lengths)
        self._collecting_tokens += sum(lengths)
        if seq is None:
            seq = self._collecting[-1][0] + 1 if self._collecting else 0
        self._collecting.append((seq, group))
        self._collecting.sort(key=lambda e: e[0])

    def next_batch(self, learner_version: int) -> list[SequenceChunk] | None:
        """One optimizer step's chunks (Phi loss tokens in token mode, D_T groups in prompt
        mode), sealing rollout batches as needed; None until a step can be filled."""
        while not self._can_fill_step() and len(self._collecting) >= self.rollout_batch_prompts:
            self._seal(learner_version)
        if not self._can_fill_step():
            return None
        if self.minibatch_prompts is None:
            chunks = cut_budget(self._stream, self.token_budget, self.stats)
        else:
            chunks = [p.emit(len(p.sample.response_ids), self.stats) for p in self._steps.popleft()]
        num_tokens = sum(c.num_loss_tokens for c in chunks)
        self._planned_tokens -= num_tokens
        self.stats.tokens_out += num_tokens
        self.stats.batches_out += 1
        return chunks

    def take_opening(self) -> tuple[str, list[SequenceChunk]]:
        """The last `next_batch` step's role ("own", "open" or "continue", as types.Batch.role)
        and, with "open", the responses of the rollout batch(es) sealed for it, each once over its
        kept tokens (a step that seals two batches, the first too small to fill it, opens both)."""
        opened, self._opened = self._opened, None
        if self._one_step_batches:
            return "own", []
        return ("continue", []) if opened is None else ("open", opened)

    def admission_capacity(self, view: AdmissionView) -> int:
        """Enough prompts for every rollout batch that will be sealed within the staleness bound."""
        d_r = self.rollout_batch_prompts
        per_batch = d_r / self.minibatch_prompts if self.minibatch_prompts else d_r / view.prompts_per_step
        return rollout_batch_capacity(self.max_staleness, self.steps_left + view.step_running,
                                      per_batch * self.num_reuse, d_r, view.waiting + len(self._collecting))

    def _can_fill_step(self) -> bool:
        if self.minibatch_prompts is None:
            return self._planned_tokens >= self.token_budget
        return bool(self._steps)

    def _seal(self, learner_version: int) -> None:
        groups = [g for _, g in self._collecting[:self.rollout_batch_prompts]]
        del self._collecting[:self.rollout_batch_prompts]
        oldest_ok = learner_version - self.max_staleness
        kept: list[list[tuple]] = []  # per group: (sample, advantage, first kept token)
        for g in groups:
            kept.append([])
            for scored, adv in zip(g.samples, g.advantages):
                s = scored.sample
                tokens = s.num_loss_tokens
                self._collecting_tokens -= tokens
                stale = stale_prefix(s.versions, 0, oldest_ok)
                stale_tokens = model_tokens(s.loss_mask, 0, stale)
                self.stats.tokens_dropped_stale += stale_tokens
                if stale_tokens == tokens:
                    self.stats.responses_all_stale += tokens > 0
                    continue
                kept[-1].append((s, adv, stale, learner_version))
        self._opened = (self._opened or []) + [ResponseCursor(*r).chunk(len(r[0].response_ids))
                                               for resp in kept for r in resp]
        batch_index = self.stats.rollout_batches_sealed
        self.stats.rollout_batches_sealed += 1
        self._batch_start_version = learner_version
        pass_tokens = sum(model_tokens(s.loss_mask, start, len(s.response_ids))
                          for resp in kept for s, _, start, _ in resp)
        for pass_index in range(self.num_reuse):
            order = list(range(len(groups)))
            random.Random(f"{self.seed}/{batch_index}/{pass_index}").shuffle(order)
            self._planned_tokens += pass_tokens
            if self.minibatch_prompts is None:
                self._stream.extend(ResponseCursor(*r) for i in order for r in kept[i])
                continue
            for lo in range(0, len(order), self.minibatch_prompts):
                step = [ResponseCursor(*r) for i in sorted(order[lo:lo + self.minibatch_prompts])
                        for r in kept[i]]
                if step:
                    self._steps.append(step)
                else:
                    self.stats.minibatches_skipped += 1

    def observe_ratio_moments(self, moments: Moments) -> None:
        """Not used: buffer.stale_policy is "discard" with rollout batches (config validates it)."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "rollout_batch", "token_budget": self.token_budget, "stats": asdict(self.stats),
                "collecting": [[seq, group_to_state(g)] for seq, g in self._collecting],
                "stream": [p.to_state() for p in self._stream],
                "steps": [[p.to_state() for p in step] for step in self._steps],
                "batch_start_version": self._batch_start_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "rollout_batch":
            raise ValueError(f"a {state.get('kind')!r} buffer's state cannot load into a rollout-batch buffer")
        self.token_budget = state["token_budget"]
        self.stats = stats_from_state(RolloutBatchStats, state["stats"])
        self._collecting = [(seq, group_from_state(g)) for seq, g in state["collecting"]]
        self._collecting_tokens = sum(m.sample.num_loss_tokens for _, g in self._collecting for m in g.samples)
        self._stream = deque(ResponseCursor.from_state(p) for p in state["stream"])
        self._steps = deque([ResponseCursor.from_state(p) for p in step] for step in state["steps"])
        self._batch_start_version = state.get("batch_start_version")  # absent in older checkpoints
        self._planned_tokens = (sum(p.remaining for p in self._stream)
                                + sum(p.remaining for step in self._steps for p in step))
