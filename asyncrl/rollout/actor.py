"""RolloutActor: owns one inference engine, generates n samples per prompt, streams each finished
sample the moment it finishes.

The orchestrator submits prompts (admission control decides how many); each prompt becomes n
independent requests so one slow sample never holds back its siblings. A weight update closes
the gate to new requests, loads the new weights once the engine is idle, then reopens. How it
gets idle is `sync_mode`:
- "drain": wait for the running requests to finish. Every token of a sample carries the version
  that was loaded when its request started; the engine idles for the longest running response.
- "inflight" (AReaL-style abort and resume): abort the running training requests, keep what
  each generated (tokens, behaviour logprobs, the version that generated them), and after the
  load resume each as a new request whose prompt is the original prompt plus that prefix, asking
  for the tokens still missing. The engine recomputes the prefix's KV under the new weights (the
  prefix cache is reset on every load), so each token's logprob is exactly that of the policy
  that sampled it, and `Sample.versions` changes value inside a response. The pause lasts as
  long as the load, not the longest response. Evaluation requests are never aborted: they drain,
  so each evaluation sample comes from one version.

With `keep_kv` (sync.keep_kv, inflight only) the running requests are not aborted: the engine
pauses them in place with their KV cache (vLLM's pause mode "keep"), loads, and they decode on
under the new weights with no prefill (PipelineRL's choice). The engine labels each token with the
weights that sampled it (vLLM's per-request weight-version spans), so versions stay exact; the
tokens after the load are sampled over keys and values the old weights wrote, a mismatch the
learner's per-token metrics measure. Evaluation requests still finish before the pause.

With `scorer` (reward.placement: actor) a finished training sample goes to the actor's own reward
pool first and leaves with its reward (rollout/local_rewards.py).

The class is plain asyncio; the orchestrator runs it as a Ray actor (`ray.remote(RolloutActor)`),
and tests can drive it directly with a fake engine and an in-memory `emit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

from asyncrl.observe.worker_logs import redirect_output
from asyncrl.rollout.engine import Completion, EngineFailed, InferenceEngine, SamplingSpec
from asyncrl.rollout.episode import Episodes
from asyncrl.rollout.routes import sample_routes
from asyncrl.types import PromptItem, Sample

log = logging.getLogger(__name__)

# How long an in-flight update waits for aborted requests to return before aborting again.
ABORT_RETRY_S = 0.05


def token_versions(labels: list[int | None] | None, start: int, num_tokens: int) -> list[int]:
    """Each token's version in a request that may have been kept across loads (keep_kv): the
    request's first stretch is the version it started with (the engine's label there may be a
    previous run's, or none), each later stretch the version of the load that began it, as the
    engine labelled it."""
    if not labels:
        return [start] * num_tokens
    return [start if v == labels[0] else v for v in labels]


class RolloutActor:
    def __init__(self, actor_id: int, engine_factory: Callable[[], InferenceEngine],
                 spec: SamplingSpec, group_size: int, emit: Callable[[Sample], None] | str,
                 seed: int = 0, sync_mode: str = "inflight",
                 scorer: Callable[[Callable[[Sample], None]], Any] | None = None,
                 episodes: Callable[[], Episodes] | None = None, keep_kv: bool = False):
        if sync_mode not in ("drain", "inflight"):
            raise ValueError(f"sync_mode must be 'drain' or 'inflight', got {sync_mode!r}")
        if keep_kv and sync_mode != "inflight":
            raise ValueError("keep_kv keeps requests across an in-flight update: it needs sync_mode 'inflight'")
        self.sync_mode, self.keep_kv = sync_mode, keep_kv
        self.actor_id = actor_id
        self._engine_factory = engine_factory
        self.engine: InferenceEngine | None = None
        self.spec = spec
        self.group_size = group_size
        self.seed = seed
        self._emit_target = emit
        self._emit: Callable[[Sample], None] | None = None
        self._scorer_factory = scorer  # emit -> LocalRewards: samples are scored here before they are sent
        self._scorer = None
        self._episodes_factory = episodes  # built in start(): it loads the tokenizer in this process
        self.episodes: Episodes | None = None
        self._deliver: asyncio.Task | None = None
        self.version = 0
        self._gate = asyncio.Event()
        self._held = False  # a load failed its checksums: the gate stays closed until the next one
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active_requests = 0
        self._occupancy = (time.monotonic(), 0.0, time.monotonic())  # last change, request-seconds, since
        self._evaluating = 0  # running evaluation requests: a keep_kv update waits for them
        self._no_evaluation = asyncio.Event()
        self._no_evaluation.set()
        self._abortable: set[str] = set()  # running training requests (evaluation ones drain)
        self._aborted: set[str] = set()    # aborted by a weight update: to be resumed
        self._tasks: set[asyncio.Task] = set()
        self._failures: list[BaseException] = []
        self._failed = asyncio.Event()  # set with the first generation failure (see `failed`)
        self.stats = {"samples": 0, "tokens": 0, "prompts": 0, "updates": 0, "resumed": 0}
        redirect_output()  # to the run's logs/ when the orchestrator asked (before the engine starts)

    async def start(self) -> dict[str, Any]:
        """Build and start the engine (in the actor's process) and the sample stream."""
        t0 = time.monotonic()
        # The verifiers' workers start (imports, a tokenizer) while the engine loads: built after it,
        # they held the first samples' rewards back 9 s on 2 cores. Their emit is the stream's, once open.
        scorer = None
        if self._scorer_factory is not None:
            scorer = asyncio.create_task(asyncio.to_thread(self._scorer_factory, lambda s: self._emit(s)))
        try:
            self.engine = self._engine_factory()
            await self.engine.start()
            if self._episodes_factory is not None:
                self.episodes = self._episodes_factory()
                start = getattr(self.episodes, "start", None)  # an agent's endpoint starts on this loop
                if start is not None:
                    await start()
        except BaseException:
            if scorer is not None:
                with contextlib.suppress(Exception):  # the engine's error is the one to tell
                    await asyncio.to_thread((await scorer).close)
            raise
        self._open_stream(None if scorer is None else await scorer)
        return {"actor_id": self.actor_id, "start_s": time.monotonic() - t0}

    def _open_stream(self, scorer=None) -> None:
        """The sample stream, and the scorer in front of it (`scorer`: one built by `start`)."""
        if isinstance(self._emit_target, str):
            from asyncrl.transport.codec import encode_samples
            from asyncrl.transport.zmq_stream import FrameSender, RecordBatcher

            self._emit = RecordBatcher(FrameSender(self._emit_target), encode_samples)
        else:
            self._emit = self._emit_target
        if self._scorer_factory is not None:
            self._scorer = scorer or self._scorer_factory(self._emit)
            self._deliver = asyncio.create_task(self._scorer.deliver())
            self._deliver.add_done_callback(self._task_done)

    async def _close_stream(self) -> None:
        if self._deliver is not None:
            self._deliver.cancel()
            self._deliver = None
        if self._scorer is not None:
            await asyncio.to_thread(self._scorer.close)
            self._scorer = None
        close = getattr(self._emit, "close", None)
        if close is not None:
            close()

    async def reset(self, emit: Callable[[Sample], None] | str, seed: int, log_file: str | None = None) -> None:
        """A fresh run in this actor (a study's next run, asyncrl/orchestrator/warm.py): every
        request of the last one is cancelled (vLLM aborts it), nothing of it is sent any more, and
        samples go to `emit` (the new run's socket), with the new `seed` and version 0; the engine
        stays up and gets the new run's first weights by the usual push."""
        self._raise_failures()
        if log_file:
            redirect_output(log_file)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._idle.wait()
        await self._close_stream()
        self._emit_target, self.seed, self.version = emit, seed, 0
        self._abortable.clear()
        self._aborted.clear()
        self.stats = dict.fromkeys(self.stats, 0)
        self._gate.set()
        self._open_stream()

    # -- generation ---------------------------------------------------------------------------

    async def submit(self, prompts: list[PromptItem], spec: SamplingSpec | None = None,
                     group_size: int | None = None) -> int:
        """Queue prompts, each sampled group_size times with spec (default: the actor's own; a
        training stage passes its own); returns how many prompts this actor has in flight."""
        self._raise_failures()
        spec, n = spec or self.spec, group_size or self.group_size
        for p in prompts:
            self.stats["prompts"] += 1
            for i in range(n):
                task = asyncio.create_task(self._generate_one(p, i, spec))
                self._tasks.add(task)
                task.add_done_callback(self._task_done)
        return self.num_in_flight_prompts()

    def num_in_flight_prompts(self) -> int:
        return (len(self._tasks) + self.group_size - 1) // self.group_size

    async def _generate_one(self, p: PromptItem, index: int, base: SamplingSpec) -> None:
        sample = await self._sample(p, index, base)
        self.stats["samples"] += 1
        self.stats["tokens"] += len(sample.response_ids)
        if self._scorer is not None:
            self._scorer.submit(sample)
        else:
            self._emit(sample)

    async def _sample(self, p: PromptItem, index: int, base: SamplingSpec, abortable: bool = True) -> Sample:
        """One sample of p: one completion, or with an environment one episode (rollout/episode.py)."""
        name = f"{p.prompt_id}-{index}-a{self.actor_id}"
        if self.episodes is not None:
            return await self.episodes.run(self, p, index, base, name, abortable)
        routes: list = []
        tokens, logprobs, versions, reason = await self.complete(p.prompt_ids, base, name, abortable, routes)
        return Sample(
            prompt_id=p.prompt_id, group_id=p.prompt_id, sample_index=index,
            prompt_ids=p.prompt_ids, response_ids=tokens, logprobs=logprobs,
            versions=versions, finish_reason=reason,
            actor_id=self.actor_id, metadata=p.metadata, temperature=base.temperature,
            routed_experts=sample_routes(routes, len(p.prompt_ids) + len(tokens)))

    async def complete(self, prompt_ids: list[int], base: SamplingSpec, name: str,
                       abortable: bool = True, routes: list | None = None
                       ) -> tuple[list[int], list[float], list[int], str]:
        """Tokens, logprobs, versions and finish reason of one completion of prompt_ids; after an
        in-flight update aborted it, resumed from its prefix. `routes` (routing replay) gets each
        request's routing rows, if the engine records them."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for attempt in itertools.count():
            request_id = name if attempt == 0 else f"{name}-r{attempt}"  # vLLM ids must be fresh
            spec = SamplingSpec(base.temperature, base.top_p, base.max_tokens - len(tokens),
                                seed=zlib.crc32(f"{self.seed}/{request_id}".encode()), stop=base.stop)
            out, version, aborted = await self._request(prompt_ids + tokens, spec, request_id, abortable)
            tokens += out.token_ids
            logprobs += out.logprobs
            if routes is not None:
                routes.append(out.routed_experts)
            versions += token_versions(out.versions, version, len(out.token_ids)) if self.keep_kv \
                else [version] * len(out.token_ids)
            if not aborted or len(tokens) >= base.max_tokens:
                break
            self.stats["resumed"] += 1
        return tokens, logprobs, versions, out.finish_reason if not aborted else "length"  # aborted at its last token

    async def _request(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str,
                       abortable: bool) -> tuple[Completion, int, bool]:
        """One engine request once the gate is open: its completion, the version that generated
        it and whether a weight update aborted it."""
        await self._gate.wait()
        self._count_occupancy()
        self._active_requests += 1
        self._idle.clear()
        if abortable:
            self._abortable.add(request_id)
        else:
            self._evaluating += 1
            self._no_evaluation.clear()
        version = self.version
        try:
            out = await self.engine.generate(prompt_ids, spec, request_id)
        finally:
            if not abortable:
                self._evaluating -= 1
                if self._evaluating == 0:
                    self._no_evaluation.set()
            self._abortable.discard(request_id)
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
            self._count_occupancy()
            self._active_requests -= 1
            if self._active_requests == 0:
                self._idle.set()
        return out, version, aborted and out.finish_reason == "abort"

    async def evaluate(self, prompts: list[PromptItem], spec: SamplingSpec, n: int) -> list[Sample]:
        """Held-out evaluation: n samples per prompt, returned together instead of streamed to
        the buffer. They share the engine with training requests; every request starts at once
        if the gate is open, so they all see one version, and a push waits for them in either
        sync mode (prompt ids must differ from training ones: they name vLLM's requests)."""
        self._raise_failures()
        return list(await asyncio.gather(*[self._sample(p, i, spec, abortable=False)
                                           for p in prompts for i in range(n)]))

    def _task_done(self, task: asyncio.Task) -> None:
        """A generation task (or the scorer's delivery, which ends only by failing) is done."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            what = "scoring" if task is self._deliver else "generation"
            log.error("%s failed on actor %d: %r", what, self.actor_id, task.exception())
            self._failures.append(task.exception())
            self._failed.set()

    async def ping(self) -> None:
        """Answers at once: the pool's proof that this actor's event loop still runs
        (fault.actor_timeout_s)."""

    async def failed(self) -> None:
        """Raises `EngineFailed` once this actor can no longer generate (its engine failed a
        request: a dead engine fails them all). The pool keeps one call of this outstanding per
        actor, so a failed engine is noticed, like a dead process (the call raises
        RayActorError then), even while no other call to the actor is pending, e.g. when its
        groups hold all the admission room."""
        await self._failed.wait()
        self._raise_failures()

    def _raise_failures(self) -> None:
        if self._failures:
            raise EngineFailed(f"actor {self.actor_id}: generation failed: {self._failures[0]!r:.300}") \
                from self._failures[0]

    # -- weights ------------------------------------------------------------------------------

    async def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                               timeout_s: float, join_timeout_s: float | None = None) -> None:
        await self.engine.init_weight_sync(host, port, rank, world_size, timeout_s, join_timeout_s)

    async def update_weights(self, metadata: dict[str, Any], version: int, rewind: bool = False) -> dict[str, float]:
        """Close the gate, get the engine idle (drain or abort, per sync_mode; with keep_kv,
        paused with its requests in place), load, reopen.

        The same version may come again: after a group rebuild every member takes part in the
        push that brings a new actor up to date. An older one only with `rewind` (a learner
        restarted from a checkpoint). A failed load leaves the gate closed (the model may hold a
        mix of two versions) until a later push succeeds."""
        self._raise_failures()
        if version < self.version and not rewind:
            raise ValueError(f"actor {self.actor_id}: push of version {version} after {self.version}")
        t0 = time.monotonic()
        self._gate.clear()
        kept = aborted = 0
        if self._held:  # the last load failed its checksums: still paused or idle
            pass
        elif self.keep_kv:
            await self._no_evaluation.wait()  # an evaluation sample comes from one version
            await self.engine.pause()
            kept = self._active_requests
        else:
            aborted = await self._abort_running() if self.sync_mode == "inflight" else 0
            await self._idle.wait()
        t1 = time.monotonic()
        stats = await self.engine.load_weights(metadata, version)
        self.version = version
        self.stats["updates"] += 1
        # weights that failed a checksum must not generate: stay closed (and paused) for the whole
        # push that follows at once (orchestrator/weight_sync.py)
        self._held = stats.get("sync/verify_failures", 0) > 0
        if not self._held:
            if self.keep_kv:
                await self.engine.resume()
            self._gate.set()
        return {**stats, "sync/pause_s": t1 - t0, "sync/aborted_requests": aborted, "sync/kept_requests": kept,
                "sync/actor_update_s": time.monotonic() - t0, **self._take_occupancy()}

    def _count_occupancy(self) -> None:
        """Request-seconds the engine ran (at most max_num_seqs at once; the rest wait in its queue)."""
        now, (last, area, since) = time.monotonic(), self._occupancy
        self._occupancy = (now, area + min(self._active_requests, self.engine.max_num_seqs) * (now - last), since)

    def _take_occupancy(self) -> dict[str, float]:
        """`rollout/occupancy` since the last update: mean requests running over max_num_seqs. Unlike
        busy time, it shows an engine that computes all the time at a fraction of its batch."""
        self._count_occupancy()
        now, area, since = self._occupancy
        self._occupancy = (now, 0.0, now)
        return {"rollout/occupancy": area / max((now - since) * self.engine.max_num_seqs, 1e-9)}

    async def _abort_running(self) -> int:
        """Abort every running training request until none is left; returns how many. A request
        that had not reached the engine when aborted is aborted again on the next round (an
        abort is idempotent); evaluation requests are left to finish."""
        aborted: set[str] = set()
        while self._abortable:
            ids = list(self._abortable)
            self._aborted.update(ids)
            aborted.update(ids)
            await self.engine.abort(ids)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), ABORT_RETRY_S)
        return len(aborted)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return await self.engine.prompt_logprobs(token_ids)

    def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "version": self.version, "in_flight_prompts": self.num_in_flight_prompts(),
                "scoring": self._scorer.num_pending if self._scorer else 0, "pid": os.getpid(),
                "episodes_stuck": self.episodes.stuck() if self.episodes is not None else None}

    async def shutdown(self) -> None:
        for t in [*self._tasks, *([self._deliver] if self._deliver else [])]:
            t.cancel()
        if self._scorer is not None:
            await asyncio.to_thread(self._scorer.close)
        if self.episodes is not None:
            close = getattr(self.episodes, "aclose", None)
            await close() if close is not None else self.episodes.close()
        if self.engine is not None:
            await self.engine.shutdown()
