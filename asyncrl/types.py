"""The plain records that travel along asyncrl's data edges.

prompt source ──PromptItem──► rollout actor ──Sample──► reward ──ScoredSample──► group assembler
──Group──► token buffer ──Batch (of SequenceChunk)──► learner

They are dataclasses of python scalars and sequences (no tensors, no Ray handles) so every edge
can encode them as msgpack, and every pure component can be tested with hand-built values.
"""

from __future__ import annotations

import math
import traceback
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any, TypeVar

IntSeq = Sequence[int]
"""Token ids or versions: a list where a record is built, an `array("i")` where it was decoded
from a frame (transport/codec.py). The driver holds every buffered token: 4 bytes a token in an
array against 36 in a list of ints, and a frame decodes without a Python object per token."""
FloatSeq = Sequence[float]
"""Logprobs: a list, or an `array("f")` decoded from a frame (float32, as the engine computes them)."""
R = TypeVar("R")
Locate = Callable[[str], str]
"""Where a model's files are in this process's filesystem, given the driver's path to them: the
path itself where it exists; the built-in model, built on this node where it does not (an engine or
a learner rank on another node has its own cache, not the driver's). The orchestrator makes one
(components.locator) and sends it with what builds an engine, a tokenizer or a rank."""


def as_list(seq: Sequence) -> list:
    """A token column as a list (the same one if it is one)."""
    return seq if isinstance(seq, list) else seq.tolist() if isinstance(seq, array) else list(seq)


def with_lists(record: R) -> R:
    """A copy of a record whose token columns are lists: what msgpack and json take (a checkpoint
    of the buffer), what a tokenizer decodes, what a test compares with its hand-built values."""
    arrays = {f.name: v.tolist() for f in fields(record) if isinstance(v := getattr(record, f.name), array)}
    return replace(record, **arrays) if arrays else record


def model_tokens(loss_mask: IntSeq, start: int, end: int) -> int:
    """Loss (model) tokens among response positions [start, end) under `loss_mask` (empty: all)."""
    return end - start if not loss_mask else sum(loss_mask[start:end])


def end_after(loss_mask: IntSeq, start: int, k: int) -> int:
    """The response position just past the k-th model token from `start` (k >= 1; the mask must
    hold that many): a chunk of k loss tokens that begins at `start` ends there."""
    if not loss_mask:
        return start + k
    for end in range(start, len(loss_mask)):
        k -= loss_mask[end]
        if k == 0:
            return end + 1
    raise ValueError(f"fewer than the asked model tokens after position {start}")


FINISH_REASONS = ("stop", "length", "abort")
BATCH_ROLES = ("own", "open", "continue")


@dataclass
class PromptItem:
    """One prompt, already tokenized, as handed to a rollout actor."""

    prompt_id: str
    prompt_ids: list[int]
    metadata: dict[str, Any]
    """answer / ground truth, data_source, anything a verifier needs; travels with every sample."""


class EpisodeStatus(str, Enum):
    DONE = "done"  # the environment (or the agent) ended it
    TRUNCATED = "truncated"  # env.max_turns or rollout.max_tokens used up first
    FAILED = "failed"  # a step raised, timed out or broke the protocol (or the agent did): scored env_error


TRACEBACK_CHARS = 4000


@dataclass
class EpisodeRecord:
    """What a multi-turn episode did (rollout/episode.py, rollout/agent_episode.py), beside the
    sample it made: the reward its steps gave, counters, and where each turn's tokens are."""

    env: str
    """The environment (env.type) or the agent (agent:<module>:<function>)."""
    status: EpisodeStatus = EpisodeStatus.TRUNCATED
    turns: int = 0
    """Model turns (an agent's: stitched calls)."""
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    """Seconds in the environment's steps (an agent's: its own time, the engine's left out)."""
    observation_tokens: int = 0
    reward: float | None = None
    """The steps' rewards summed (an agent's: what it returned); None: none gave one."""
    spans: list[list[Any]] = field(default_factory=list)
    """[start, end, origin] over the response: origin "model" (sampled) or "env" (an observation)."""
    calls: int = 0
    """An agent's calls served, and of them those not in the sample (it edited or forked history)."""
    unstitched_calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    """An agent's reward info, made JSON-safe."""
    error: str | None = None
    """A failed episode's error: its last line, and the traceback's end."""
    traceback: str | None = None

    def fail(self, error: BaseException) -> None:
        lines = traceback.format_exception(error)
        self.status, self.error = EpisodeStatus.FAILED, lines[-1].strip()
        self.traceback = "".join(lines)[-TRACEBACK_CHARS:]

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as msgpack and JSON carry them (and as a verifier sees them)."""
        return {**asdict(self), "status": self.status.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpisodeRecord:
        """ValueError (or TypeError) for a map that is not a record."""
        known = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or not isinstance(d.get("env"), str) or set(d) - known:
            raise ValueError(f"not an episode record: {sorted(set(d) - known) if isinstance(d, dict) else d!r}")
        return cls(**{**d, "status": EpisodeStatus(d.get("status", "truncated"))})


@dataclass
class Sample:
    """One finished response, emitted by a rollout actor the moment it finishes."""

    prompt_id: str
    group_id: str
    sample_index: int
    prompt_ids: IntSeq
    response_ids: IntSeq
    logprobs: FloatSeq
    """Behaviour-policy logprob of every response token (as sampled, after temperature)."""
    versions: IntSeq
    """Policy version that produced every response token (may change mid-sequence)."""
    finish_reason: str
    actor_id: int
    metadata: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0
    """Sampling temperature the response was drawn at (stages may change it mid-run)."""
    reward: float | None = None
    """Set when the actor scored the sample itself (reward.placement: actor), with the verifier's
    `reward_info` and the call's `reward_latency_s`; None: the driver's reward pool scores it."""
    reward_info: dict[str, Any] = field(default_factory=dict)
    reward_latency_s: float = 0.0
    loss_mask: IntSeq = field(default_factory=list)
    """1 on every response token the model sampled, 0 on the tokens an environment answered with
    (asyncrl/env); empty, as every single-turn response has it: all are the model's. An
    observation token carries logprob 0.0 and the version of the model turn before it, so the
    versions never decrease along a response and an observation is never staler than that turn."""
    episode: EpisodeRecord | None = None
    """A multi-turn episode's record (env.type set); None for a single-turn response."""
    routed_experts: bytes = b""
    """Rollout routing replay (algo.moe.routing: replay): the experts the engine routed each input
    position to, uint8 [prompt + response positions, MoE layers, top-k] in C order, 255 where the
    engine recorded none (the learner routes that position itself); empty: no routing recorded."""
    teacher_logprobs: FloatSeq = field(default_factory=list)
    """On-policy distillation (algo.distill): the teacher's logprob of every response token, set by
    the driver when the teacher has scored the sample; empty otherwise. Actors never send it (the
    codec leaves it out of their frames)."""

    @property
    def num_loss_tokens(self) -> int:
        """Response tokens the model sampled (what the buffer counts toward Phi)."""
        return len(self.response_ids) if not self.loss_mask else sum(self.loss_mask)

    def validate(self) -> None:
        """Raise ValueError if the record is inconsistent (the sender checks each sample it encodes)."""
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"sample {self.group_id}/{self.sample_index}: {n} response tokens but "
                f"{len(self.logprobs)} logprobs and {len(self.versions)} versions"
            )
        if not self.prompt_ids:
            raise ValueError(f"sample {self.group_id}/{self.sample_index}: empty prompt")
        if self.loss_mask and (len(self.loss_mask) != n or not set(self.loss_mask) <= {0, 1}):
            raise ValueError(f"sample {self.group_id}/{self.sample_index}: loss_mask must be {n} zeros and ones")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if self.sample_index < 0:
            raise ValueError(f"negative sample_index {self.sample_index}")
        if len(self.routed_experts) % (len(self.prompt_ids) + n):
            raise ValueError(f"sample {self.group_id}/{self.sample_index}: {len(self.routed_experts)} bytes of "
                             f"routing is not a whole row for each of {len(self.prompt_ids) + n} positions")
        if self.teacher_logprobs and len(self.teacher_logprobs) != n:
            raise ValueError(f"sample {self.group_id}/{self.sample_index}: {n} response tokens but "
                             f"{len(self.teacher_logprobs)} teacher logprobs")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"sample {self.group_id}/{self.sample_index}: reward {self.reward} is not finite")


@dataclass
class ScoredSample:
    """A sample with its reward (and whatever the verifier reported)."""

    sample: Sample
    reward: float
    reward_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group:
    """All n samples of one prompt, with their advantages; only complete groups reach the buffer."""

    group_id: str
    samples: list[ScoredSample]
    advantages: list[float]


@dataclass
class SequenceChunk:
    """The part of one response that a batch trains on.

    The model is fed `prompt_ids + response_ids[:loss_end]`; loss is taken on response tokens
    `loss_start <= j < loss_end`. A response split across two batches appears in both, the
    second chunk starting where the first ended (its earlier tokens are context, loss mask 0).
    """

    group_id: str
    sample_index: int
    prompt_ids: IntSeq
    response_ids: IntSeq
    """Response tokens up to loss_end (later tokens are not needed by a causal model)."""
    loss_start: int
    old_logprobs: FloatSeq
    """Behaviour logprobs of the loss tokens, len == loss_end - loss_start."""
    versions: IntSeq
    """Versions of the loss tokens."""
    advantage: float
    temperature: float = 1.0
    """The response's sampling temperature: the learner divides its logits by it."""
    response_length: int = 0
    """Length of the whole response (0: unknown, taken as loss_end), for length-bucketed metrics."""
    loss_mask: IntSeq = field(default_factory=list)
    """Sample.loss_mask over [loss_start, loss_end): an observation token there is context only;
    empty: every token of the range is a loss token. old_logprobs and versions span the range."""
    entered_at: int | None = None
    """The learner version at which the response entered training (buffer/base.py ResponseCursor);
    the orchestrator's staleness split reads it, the learner does not (not on the wire)."""
    teacher_logprobs: FloatSeq = field(default_factory=list)
    """Sample.teacher_logprobs over [loss_start, loss_end) (on-policy distillation); empty: none."""
    routed_experts: bytes = b""
    """Sample.routed_experts over the positions fed, prompt + response[:loss_end]; empty: none."""

    @property
    def loss_end(self) -> int:
        return len(self.response_ids)

    @property
    def num_loss_tokens(self) -> int:
        return len(self.response_ids) - self.loss_start if not self.loss_mask else sum(self.loss_mask)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class ResponseSpan:
    """Where a response's loss tokens sit: response tokens [loss_start, loss_start + num_tokens)."""

    group_id: str
    sample_index: int
    loss_start: int
    num_tokens: int

    @classmethod
    def of(cls, c: SequenceChunk) -> ResponseSpan:
        return cls(c.group_id, c.sample_index, c.loss_start, c.num_loss_tokens)


@dataclass
class Batch:
    """One optimizer step's data for one learner rank.

    `num_loss_tokens_global` and `num_sequences_global` count the whole step over all ranks:
    losses normalize by them (or by Φ, `token_budget`), never by local counts, so the gradient does
    not depend on how the step was split. The step's loss tokens equal Φ except when a rollout
    batch is cut into minibatches of whole groups (buffer.minibatch_prompts).
    """

    step: int
    rank: int
    chunks: list[SequenceChunk]
    num_loss_tokens_global: int
    num_sequences_global: int
    token_budget: int
    """Φ of this step (budget aggregation divides by it; training stages may change it)."""
    role: str = "own"
    """The step's place in the rollout-batch schedule (buffer/rollout_batch.py): "own" (it is its
    own rollout batch: streaming, or one step per batch), "open" (the first step of a rollout
    batch that feeds several) or "continue" (a later step of the open batch)."""
    opened: list[SequenceChunk] = field(default_factory=list)
    """With "open", when the learner needs a no-grad pass over the new rollout batch: this rank's
    share of its responses, each once, over its loss range."""
    opened_layout: list[ResponseSpan] = field(default_factory=list)
    """Every response of the new rollout batch, rank 0's share first, then rank 1's, ...; each
    rank's in the order of its `opened`."""
    opened_offset: int = 0
    """Index in `opened_layout` of this rank's first response."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(c.num_loss_tokens for c in self.chunks)


@dataclass(frozen=True)
class ReferenceReset:
    """After this step the KL reference is the current policy (ProRL's reset): why (`every_k`,
    `kl_threshold`, `requested`) and the step's mean KL before it."""

    reason: str
    kl: float
    event = "reference_reset"  # its name in events.jsonl (a class attribute, not a field)

    def fields(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.event} ({self.reason}); KL was {self.kl:.4g}"


StepEvent = ReferenceReset
"""What a learner step can report beyond its metrics, each a line in events.jsonl (one kind so far)."""


@dataclass
class StepResult:
    """What a learner returns for one optimizer step: the policy version it now holds (the
    orchestrator checks it against its own count), the step's metrics, and its events."""

    version: int
    metrics: dict[str, float]
    events: list[StepEvent] = field(default_factory=list)


class RunFailed(RuntimeError):
    """The run cannot go on and says why in one message: `asyncrl run` (asyncrl/launch.py) prints it
    and exits 1 (a learner lost, a run that makes no progress, a reward function that keeps raising)."""


Stopping = Callable[[], str | None]
"""The stop asked for so far (its reason: a signal's name), None while none is: what a run's start
checks between its waits (orchestrator/lifecycle.py)."""


class StartInterrupted(Exception):
    """A stop (SIGTERM, SIGINT) asked for while the run was starting: the start ends at its next
    wait, what started is shut down, and since no step ran there is nothing to checkpoint."""

    def __init__(self, reason: str):
        super().__init__(f"{reason} during start-up")
        self.reason = reason

    def line(self) -> str:
        """What `asyncrl run` and a study's run log say of it."""
        return f"{self}: stopped before the first step, nothing to save"


class ActorCallFailed(RuntimeError):
    """A call to a rollout actor failed: its process died or its engine failed the requests."""
