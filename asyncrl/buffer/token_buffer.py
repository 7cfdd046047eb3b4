"""Token-level replay buffer: every optimizer step gets exactly Phi loss tokens (Ring-lite C3PO).

Responses queue oldest policy version first, in arrival order among equals: a group that arrives
late (its rewards waited out a verifier's timeout) is trained before fresher tokens instead of
going stale behind them. Two ways to cut a step (`cut`):
- "split" (default): whole responses while they fit; the response that does not fit contributes
  the prefix of its loss tokens that fills Phi, and the rest of it opens the next batch (its
  prompt and earlier response tokens are fed again as context, with loss mask 0). A step holds
  exactly Phi loss tokens.
- "whole": Ring-lite's greedy selection, whole responses until the step holds at least Phi
  (buffer/base.py cut_whole). No response is split; a step holds Phi to Phi + L_max - 1 tokens.

Staleness: a response enters training when learner version v first takes a chunk of it; a token
produced by policy version w is only trained if v - w <= max_staleness then. Versions never
decrease along a response, so the stale tokens of a response are a prefix: they are skipped
(counted as dropped) and the fresh rest is kept. The rest of a response split at the Phi boundary
is not judged again: it trains at the next step(s), one version later per step, so its prefix and
its ending (EOS, the answer) are both trained. A token's lag at the step that trains it is
therefore at most max_staleness plus the steps its response has been in training
(orchestrator/step_stats.py reports the two parts). Admission control upstream
(`admission_capacity`, AReaL's bound) keeps drops rare; the buffer makes the bound a guarantee.

Stale policy (buffer/stale_policy.py): "discard", "wait" and "pace" drop as above (wait and pace
act upstream, in the driver, so that little reaches the buffer stale). "ess" relaxes the bound:
only tokens more than `ess_max_lag` behind are dropped outright; a response whose first tokens are
more than max_staleness behind is judged when a cut is about to take it in, and trained whole if
the estimated ESS of the batch being cut, it included, stays >= `ess_min` (`keep_stale`), from the
learner's ratio moments (`observe_ratio_moments`); else its stale prefix is dropped as discard
would. Every cut counts its tokens that entered more than max_staleness behind
(`stats.tokens_beyond_bound`, 0 but under "ess") and estimates its ESS (`ess_estimate`).

Accounting invariant: tokens_in == tokens_out + tokens_dropped_stale + num_loss_tokens.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from dataclasses import asdict
from typing import Any

from asyncrl.algo.batch_ess import Moments, estimated_ess
from asyncrl.buffer.admission import admission_capacity
from asyncrl.buffer.base import (AdmissionView, BufferStats, ResponseCursor, cut_budget, cut_whole,
                                 stale_prefix, stats_from_state)
from asyncrl.buffer.stale_policy import STALE_POLICIES, RatioMoments, keep_stale, lag_counts
from asyncrl.types import Group, SequenceChunk, end_after, model_tokens


CUTS = ("split", "whole")


def _first_version(p: ResponseCursor) -> int:
    return p.sample.versions[0]


class TokenBuffer:
    def __init__(self, token_budget: int, max_staleness: int, cut: str = "split", stale_policy: str = "discard",
                 ess_min: float = 0.9, ess_max_lag: int | None = None):
        if token_budget <= 0:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        if cut not in CUTS:
            raise ValueError(f"unknown cut {cut!r} (allowed: {', '.join(CUTS)})")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"unknown stale_policy {stale_policy!r} (allowed: {', '.join(STALE_POLICIES)})")
        self.cut = cut
        self.token_budget = token_budget
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.ess_min = ess_min
        self.ess_max_lag = max_staleness + 4 if ess_max_lag is None else ess_max_lag
        if self.ess_max_lag < max_staleness:
            raise ValueError(f"ess_max_lag ({self.ess_max_lag}) must be >= max_staleness ({max_staleness})")
        self.moments = RatioMoments()
        self.ess_estimate: float | None = None
        """The estimated ESS of the last cut (None: a bucket of it not measured yet)."""
        self.stats = BufferStats()
        self._queue: deque[ResponseCursor] = deque()
        self._num_tokens = 0

    @property
    def num_loss_tokens(self) -> int:
        return self._num_tokens

    @property
    def batch_start_version(self) -> None:
        """None: every token is trained once, so no lag comes from reuse (buffer/base.py)."""
        return None

    def take_opening(self) -> tuple[str, list[SequenceChunk]]:
        """Every step is its own rollout batch (buffer/base.py)."""
        return "own", []

    @property
    def num_responses(self) -> int:
        return len(self._queue)

    def set_token_budget(self, token_budget: int) -> None:
        self.token_budget = token_budget

    def add_group(self, group: Group, seq: int | None = None) -> None:
        """`seq` (admission order) is not used: the queue keeps version, then arrival, order."""
        for scored, adv in zip(group.samples, group.advantages):
            s = scored.sample
            self.stats.responses_in += 1
            tokens = s.num_loss_tokens
            if not tokens:
                self.stats.responses_empty += 1
                continue
            self._insert(ResponseCursor(s, adv))
            self._num_tokens += tokens
            self.stats.tokens_in += tokens

    def _insert(self, p: ResponseCursor) -> None:
        """Behind every response of the same or an older first version (usually: at the end). A
        response split by the last batch keeps the head, so its rest opens the next batch.
        Behind the head the queue is in version order, so the place is found by bisection: with
        in-flight updates long responses finish late, behind thousands of younger ones at scale."""
        version, q = p.sample.versions[0], self._queue
        if not q or q[-1].sample.versions[0] <= version:  # in order: the usual case
            q.append(p)
            return
        i = bisect_right(q, version, 1, key=_first_version)
        if i == 1 and q[0].offset == 0 and q[0].sample.versions[0] > version:
            i = 0
        q.insert(i, p)

    def drop_stale(self, learner_version: int) -> int:
        """Skip tokens older than learner_version - max_staleness (- ess_max_lag under "ess");
        returns how many. Only the head of the queue is looked at: past its first response,
        responses are in order of their first (oldest) token's version, so the first one that is
        young enough ends the scan. The rest of a split response (at the head) entered training
        already and is kept. Under "train" nothing is dropped."""
        if self.stale_policy == "train":
            return 0
        oldest_ok = learner_version - (self.ess_max_lag if self.stale_policy == "ess" else self.max_staleness)
        dropped, emptied = 0, []
        for i, p in enumerate(self._queue):
            if i > 0 and p.sample.versions[0] >= oldest_ok:
                break
            if p.entered_at is not None or p.remaining == 0 or p.sample.versions[p.offset] >= oldest_ok:
                continue  # nothing stale left in it (the common case: checked without a call)
            stale = stale_prefix(p.sample.versions, p.offset, oldest_ok)
            if stale:
                dropped += p.skip(stale)
                if p.remaining == 0:
                    emptied.append(p)
        for p in emptied:
            self._queue.remove(p)
        self._num_tokens -= dropped
        self.stats.tokens_dropped_stale += dropped
        return dropped

    def next_batch(self, learner_version: int) -> list[SequenceChunk] | None:
        """token_budget loss tokens for learner_version (at least that many with cut "whole"),
        or None if not enough yet."""
        self.drop_stale(learner_version)
        if self.stale_policy == "ess" and self._num_tokens >= self.token_budget:
            self._judge_stale(learner_version)
        if self._num_tokens < self.token_budget:
            return None
        cut = cut_budget if self.cut == "split" else cut_whole
        chunks = cut(self._queue, self.token_budget, self.stats, learner_version)
        num_tokens = sum(c.num_loss_tokens for c in chunks)
        self._num_tokens -= num_tokens
        self.stats.tokens_out += num_tokens
        self.stats.batches_out += 1
        self._count_cut(chunks, learner_version)
        return chunks

    def _judge_stale(self, learner_version: int) -> None:
        """"ess": decide, in queue order, on each response the next cut would take in that has not
        entered training and whose first tokens are more than max_staleness behind. It is kept if
        `keep_stale` allows it given the rest of the batch the cut would then take (a response not
        decided yet counted as discard would leave it); else its stale prefix is dropped. A
        response the batch does not reach is judged at a later cut."""
        keep: dict[int, bool] = {}  # id of a response -> kept
        while True:
            window = self._window(learner_version, keep)
            cand = next((p for p, start, _ in window if start > p.offset and id(p) not in keep), None)
            if cand is None:
                break
            batch: Counter[int] = Counter()
            candidate: Counter[int] = Counter()
            for p, start, end in self._window(learner_version, {**keep, id(cand): True}):
                lag_counts(p.sample.versions, start, end, learner_version,
                           into=candidate if p is cand else batch)
            keep[id(cand)] = keep_stale(batch, candidate, self.moments.by_bucket, self.ess_min, self.ess_max_lag)
        oldest_ok, dropped = learner_version - self.max_staleness, 0
        for p in [p for p in self._queue if keep.get(id(p)) is False]:
            dropped += p.skip(stale_prefix(p.sample.versions, p.offset, oldest_ok))
            if p.remaining == 0:
                self._queue.remove(p)
        self._num_tokens -= dropped
        self.stats.tokens_dropped_stale += dropped

    def _window(self, learner_version: int, keep: dict[int, bool]) -> list[tuple[ResponseCursor, int, int]]:
        """(response, first token, end) of what the next cut would take, if the responses `keep`
        says True of are kept whole and every other one not in training yet loses its stale prefix
        (an episode's observation tokens in the span count as their turn's; ESS is an estimate)."""
        oldest_ok = learner_version - self.max_staleness
        need, out = self.token_budget, []
        for p in self._queue:
            if need <= 0:
                break
            start = p.offset
            if p.entered_at is None and not keep.get(id(p)):
                start += stale_prefix(p.sample.versions, p.offset, oldest_ok)
            mask = p.sample.loss_mask
            rest = model_tokens(mask, start, len(p.sample.response_ids))
            take = rest if self.cut == "whole" else min(rest, need)
            out.append((p, start, end_after(mask, start, take) if take else start))
            need -= take
        return out

    def _count_cut(self, chunks: list[SequenceChunk], learner_version: int) -> None:
        """Tokens that entered training more than max_staleness behind, and the cut's estimated ESS."""
        lags: Counter[int] = Counter()
        for c in chunks:
            lag_counts(c.versions, 0, len(c.versions), learner_version, into=lags)
            beyond = stale_prefix(c.versions, 0, c.entered_at - self.max_staleness)
            self.stats.tokens_beyond_bound += beyond if not c.loss_mask else model_tokens(c.loss_mask, 0, beyond)
        self.ess_estimate = estimated_ess(lags, self.moments.by_bucket)

    def observe_ratio_moments(self, moments: Moments) -> None:
        """A learner step's (mean r, mean r^2) per staleness bucket (algo/batch_ess.py)."""
        self.moments.observe(moments)

    def admission_capacity(self, view: AdmissionView) -> int:
        """AReaL's bound, (eta + v + 1) * B minus what is accepted or running (admission.py)."""
        return admission_capacity(
            self.max_staleness, view.learner_version, view.prompts_per_step, view.accepted_or_running,
            view.generating,
            starving=self.num_loss_tokens < self.token_budget and not view.verifiers_behind,
            held_by_verifiers=0 if view.verifiers_behind else view.held_by_verifiers)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "token", "token_budget": self.token_budget, "stats": asdict(self.stats),
                "queue": [p.to_state() for p in self._queue], "moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "token":
            raise ValueError(f"a {state.get('kind')!r} buffer's state cannot load into a token buffer")
        self.token_budget = state["token_budget"]
        self.stats = stats_from_state(BufferStats, state["stats"])
        self._queue = deque(ResponseCursor.from_state(p) for p in state["queue"])
        self._num_tokens = sum(p.remaining for p in self._queue)
        self.moments.load_state_dict(state.get("moments", {}))  # none in a checkpoint older than them
