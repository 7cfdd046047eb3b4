"""Token-level replay buffer: every optimizer step gets exactly Phi loss tokens (Ring-lite C3PO).

Responses queue oldest policy version first, in arrival order among equals: a group that arrives
late (its rewards waited out a verifier's timeout) is trained before fresher tokens instead of
going stale behind them. A batch takes whole responses while they fit; the response
that does not fit contributes the prefix of its loss tokens that fills Phi, and the rest of it
opens the next batch (its prompt and earlier response tokens are fed again as context, with loss
mask 0). So a batch never holds more or fewer than Phi loss tokens, and every token is trained
exactly once.

Staleness: when learner version v takes a batch, a token produced by policy version w is only
trained if v - w <= max_staleness. Versions never decrease along a response, so the stale tokens
of a response are a prefix: they are skipped (counted as dropped) and the fresh rest is kept.
Admission control upstream keeps this rare; the buffer makes it a guarantee.

Accounting invariant: tokens_in == tokens_out + tokens_dropped_stale + num_loss_tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncrl.types import Group, Sample, SequenceChunk


@dataclass
class _Pending:
    sample: Sample
    advantage: float
    offset: int = 0
    """Response tokens already emitted (or dropped as stale)."""

    @property
    def remaining(self) -> int:
        return len(self.sample.response_ids) - self.offset


@dataclass
class BufferStats:
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_dropped_stale: int = 0
    responses_in: int = 0
    responses_empty: int = 0
    responses_split: int = 0
    batches_out: int = 0


class TokenBuffer:
    def __init__(self, token_budget: int, max_staleness: int):
        if token_budget <= 0:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        self.token_budget = token_budget
        self.max_staleness = max_staleness
        self.stats = BufferStats()
        self._queue: deque[_Pending] = deque()
        self._num_tokens = 0

    @property
    def num_loss_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_responses(self) -> int:
        return len(self._queue)

    def add_group(self, group: Group) -> None:
        for scored, adv in zip(group.samples, group.advantages):
            s = scored.sample
            self.stats.responses_in += 1
            if not s.response_ids:
                self.stats.responses_empty += 1
                continue
            self._insert(_Pending(s, adv))
            self._num_tokens += len(s.response_ids)
            self.stats.tokens_in += len(s.response_ids)

    def _insert(self, p: _Pending) -> None:
        """Behind every response of the same or an older first version (usually: at the end). A
        response split by the last batch keeps the head, so its rest opens the next batch."""
        version = p.sample.versions[0]
        i = len(self._queue)
        while i > 1 and self._queue[i - 1].sample.versions[0] > version:
            i -= 1
        if i == 1 and self._queue[0].offset == 0 and self._queue[0].sample.versions[0] > version:
            i = 0
        self._queue.insert(i, p)

    def drop_stale(self, learner_version: int) -> int:
        """Skip tokens older than learner_version - max_staleness; returns how many."""
        oldest_ok = learner_version - self.max_staleness
        dropped = 0
        for p in list(self._queue):
            stale = 0
            versions = p.sample.versions
            while p.offset + stale < len(versions) and versions[p.offset + stale] < oldest_ok:
                stale += 1
            if stale:
                p.offset += stale
                dropped += stale
                if p.remaining == 0:
                    self._queue.remove(p)
        self._num_tokens -= dropped
        self.stats.tokens_dropped_stale += dropped
        return dropped

    def next_batch(self, learner_version: int) -> list[SequenceChunk] | None:
        """Exactly token_budget loss tokens for learner_version, or None if not enough yet."""
        self.drop_stale(learner_version)
        if self._num_tokens < self.token_budget:
            return None
        need = self.token_budget
        chunks: list[SequenceChunk] = []
        while need:
            p = self._queue[0]
            take = min(need, p.remaining)
            start, end = p.offset, p.offset + take
            s = p.sample
            chunks.append(SequenceChunk(
                group_id=s.group_id, sample_index=s.sample_index, prompt_ids=s.prompt_ids,
                response_ids=s.response_ids[:end], loss_start=start,
                old_logprobs=s.logprobs[start:end], versions=s.versions[start:end],
                advantage=p.advantage, temperature=s.temperature))
            p.offset = end
            need -= take
            if p.remaining == 0:
                self._queue.popleft()
            else:
                self.stats.responses_split += 1
        self._num_tokens -= self.token_budget
        self.stats.tokens_out += self.token_budget
        self.stats.batches_out += 1
        return chunks
