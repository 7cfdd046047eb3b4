"""What every token buffer shares: the `Buffer` protocol, the response cursor, the exact-Phi cut
and the stale-prefix scan, written once for `TokenBuffer` and `RolloutBatchBuffer`.

A buffer supplies its own admission capacity (`admission_capacity(AdmissionView)`): the streaming
buffer bounds prompts by AReaL's staleness formula, the rollout-batch buffer by when its next
batch is sealed. The group ledger (orchestrator/ledger.py) fills the view; the buffer decides.

State: `state_dict()` is plain data (lists, dicts, numbers) that a checkpoint stores as msgpack;
`load_state_dict` restores it exactly, split responses and collecting groups included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

from asyncrl.algo.batch_ess import Moments
from asyncrl.types import Group, Sample, ScoredSample, SequenceChunk, end_after, model_tokens, with_lists


@dataclass
class BufferStats:
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_dropped_stale: int = 0
    responses_in: int = 0
    responses_empty: int = 0
    responses_split: int = 0
    batches_out: int = 0
    responses_trained: float = 0.0
    """Sum over emitted chunks of the share of their response's tokens they train (a response
    trained whole counts 1): with tokens_out it gives the mean length of what was trained."""
    tokens_beyond_bound: int = 0
    """Tokens trained that entered training more than max_staleness versions behind: 0 but under
    buffer.stale_policy "ess", which relaxes the bound while the batch's estimated ESS allows,
    and "train", which trains them all."""

    @property
    def length_bias(self) -> float:
        """Mean length of the responses trained (each weighted by the share of its tokens that
        was trained) over the mean length of the responses that came in, minus 1: below 0 when
        dropping stale work trains the short responses more than the long ones. 0 before any."""
        came_in = self.responses_in - self.responses_empty
        if not self.responses_trained or not came_in or not self.tokens_in:
            return 0.0
        return (self.tokens_out / self.responses_trained) / (self.tokens_in / came_in) - 1.0


@dataclass
class AdmissionView:
    """What a buffer needs to know to say how many more prompts may be admitted now."""

    learner_version: int
    prompts_per_step: float
    """Estimated prompts one optimizer step consumes (admission.prompts_per_step)."""
    accepted_or_running: int
    """Groups admitted and not rejected: kept (buffered) or still generating / scoring."""
    generating: int
    """Groups whose samples are not all generated yet."""
    waiting: int
    """Admitted groups not yet handed to the buffer (generating or scoring)."""
    held_by_verifiers: int
    """Generated groups waiting for rewards, up to the reward workers (0 when samples queue)."""
    verifiers_behind: bool
    """Samples are queued for a reward worker: more generation would only pile up."""
    step_running: bool
    """An optimizer step is in progress (it will consume one more step's worth)."""


@dataclass
class ResponseCursor:
    """One response in a buffer: tokens [offset, len) still to emit (or to drop as stale). Counts
    (`remaining`, the cut's budget) are of loss tokens: an episode's observation tokens
    (Sample.loss_mask 0) ride along as context and count toward nothing."""

    sample: Sample
    advantage: float
    offset: int = 0
    entered_at: int | None = None
    """The learner version at which the response entered training, and its staleness was checked:
    when its rollout batch was sealed, or when a streaming step first cut a chunk of it. None: not
    yet. A response split at the Phi boundary keeps it, so its rest is not judged again."""

    @property
    def remaining(self) -> int:
        """Loss tokens from the offset on."""
        s = self.sample  # single-turn responses (no mask) take the first branch, at a subtraction's cost
        return len(s.response_ids) - self.offset if not s.loss_mask else sum(s.loss_mask[self.offset:])

    def chunk(self, end: int) -> SequenceChunk:
        """Loss on tokens [offset, end); everything before is context."""
        s, start = self.sample, self.offset
        return SequenceChunk(
            group_id=s.group_id, sample_index=s.sample_index, prompt_ids=s.prompt_ids,
            response_ids=s.response_ids[:end], loss_start=start, old_logprobs=s.logprobs[start:end],
            versions=s.versions[start:end], advantage=self.advantage, temperature=s.temperature,
            response_length=len(s.response_ids), loss_mask=s.loss_mask[start:end] if s.loss_mask else [],
            entered_at=self.entered_at, teacher_logprobs=s.teacher_logprobs[start:end] if s.teacher_logprobs else [],
            routed_experts=s.routed_experts[:len(s.routed_experts) // (len(s.prompt_ids) + len(s.response_ids))
                                            * (len(s.prompt_ids) + end)])

    def emit(self, end: int, stats: BufferStats) -> SequenceChunk:
        """`chunk(end)`, counted as trained, with the cursor moved past it."""
        chunk, s = self.chunk(end), self.sample
        stats.responses_trained += ((end - self.offset) / len(s.response_ids) if not s.loss_mask
                                    else chunk.num_loss_tokens / max(s.num_loss_tokens, 1))
        self.offset = end
        return chunk

    def skip(self, positions: int) -> int:
        """Move the offset `positions` tokens on (a stale prefix); returns the loss tokens skipped."""
        skipped = model_tokens(self.sample.loss_mask, self.offset, self.offset + positions)
        self.offset += positions
        return skipped

    def to_state(self) -> dict[str, Any]:
        return {"sample": asdict(with_lists(self.sample)), "advantage": self.advantage, "offset": self.offset,
                "entered_at": self.entered_at}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> ResponseCursor:
        return cls(sample_from_state(d["sample"]), d["advantage"], d["offset"], d.get("entered_at"))


def sample_from_state(d: dict[str, Any]) -> Sample:
    return Sample(**d)


def group_to_state(g: Group) -> dict[str, Any]:
    return {"group_id": g.group_id, "advantages": list(g.advantages),
            "samples": [{"sample": asdict(with_lists(m.sample)), "reward": m.reward, "info": m.reward_info} for m in g.samples]}


def group_from_state(d: dict[str, Any]) -> Group:
    return Group(d["group_id"], [ScoredSample(sample_from_state(m["sample"]), m["reward"], m["info"])
                                 for m in d["samples"]], list(d["advantages"]))


def stale_prefix(versions: list[int], start: int, oldest_ok: int) -> int:
    """How many tokens from `start` on are older than `oldest_ok`. Versions never decrease along
    a response, so the stale tokens are a prefix and the first young enough token ends it."""
    n = start
    while n < len(versions) and versions[n] < oldest_ok:
        n += 1
    return n - start


def cut_budget(queue: deque[ResponseCursor], budget: int, stats: BufferStats,
               learner_version: int | None = None) -> list[SequenceChunk]:
    """Exactly `budget` loss tokens from the head of `queue` (which must hold that many). Whole
    responses while they fit; the one that does not gives the prefix that fills the budget and
    stays at the head, so its rest opens the next batch. A response that has not entered training
    yet enters it at `learner_version` (None: its entry was set when its batch was sealed)."""
    need = budget
    chunks: list[SequenceChunk] = []
    while need:
        p = queue[0]
        if p.entered_at is None:
            p.entered_at = learner_version
        take = min(need, p.remaining)
        mask = p.sample.loss_mask
        chunks.append(p.emit(p.offset + take if not mask else end_after(mask, p.offset, take), stats))
        need -= take
        if p.remaining == 0:
            queue.popleft()
        else:
            stats.responses_split += 1
    return chunks


def cut_whole(queue: deque[ResponseCursor], budget: int, stats: BufferStats,
              learner_version: int) -> list[SequenceChunk]:
    """Whole responses from the head of `queue` until they hold at least `budget` loss tokens
    (Ring-lite's greedy C3PO selection: "cumulative token count closely exceeds or equals the
    budget"); the queue must hold that many. Nothing is split, so a step holds between Phi and
    Phi + the longest response - 1 tokens; budget aggregation still divides by Phi."""
    chunks: list[SequenceChunk] = []
    total = 0
    while total < budget:
        p = queue.popleft()
        p.entered_at = learner_version if p.entered_at is None else p.entered_at
        total += p.remaining
        chunks.append(p.emit(len(p.sample.response_ids), stats))
    return chunks


def stats_from_state(cls, d: dict[str, Any]):
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step's data as the buffer cut it."""

    chunks: list[SequenceChunk]
    role: str
    """Where the step stands in the rollout-batch schedule: "own", "open" or "continue" (types.Batch.role)."""
    opened: list[SequenceChunk]
    """With role "open": the new rollout batch's responses, each once (for the learner's pass over it)."""
    start_version: int | None
    """The learner version this step's rollout batch was first trained at; None: this step's."""
    token_budget: int
    """Phi of the buffer that cut it."""


class Buffer(Protocol):
    """A token buffer as the group ledger and the train loop see it."""

    token_budget: int
    """Phi of the current stage (`set_token_budget` at a stage boundary)."""
    stats: BufferStats
    ess_estimate: float | None
    """The estimated ESS of the last step cut (algo/batch_ess.py); None: not estimated."""

    @property
    def num_loss_tokens(self) -> int:
        """Loss tokens still to emit."""

    @property
    def batch_start_version(self) -> int | None:
        """The learner version the last `next_batch`'s rollout batch was first trained at (its
        lag since then is reuse, not asynchrony); None: every batch is trained once."""

    def set_token_budget(self, token_budget: int) -> None:
        """Phi from the next batch on (a new training stage's)."""

    def add_group(self, group: Group, seq: int | None = None) -> None:
        """A kept group; `seq` is its admission sequence number (the ledger's)."""

    def next_batch(self, learner_version: int) -> list[SequenceChunk] | None:
        """One optimizer step's chunks for `learner_version`, or None until a step can be filled."""

    def take_opening(self) -> tuple[str, list[SequenceChunk]]:
        """Where the last `next_batch` step stands in the rollout-batch schedule (types.Batch.role):
        "own" (a batch of its own), "open" (with the new batch's responses, each once) or
        "continue"."""

    def admission_capacity(self, view: AdmissionView) -> int:
        """How many more prompts may be admitted now."""

    def observe_ratio_moments(self, moments: Moments) -> None:
        """A learner step's (mean r, mean r^2) per staleness bucket (algo/batch_ess.py), from which
        the streaming buffer estimates each cut's ESS (`ess_estimate`; buffer.stale_policy ess)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
