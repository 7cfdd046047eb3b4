"""The rollout actors as one object: start them, hand them prompts, notice when one dies, replace
it, and grow or shrink the pool while the run goes on (pushing weights to them is weight_sync.py's).

Failures: an actor is dead when a call to it raises `RayActorError` (its process was killed, its
node left), when its engine failed (every request fails; `RolloutActor.failed` returns, and the
actor is killed), when it did not finish a push within `sync.timeout_s`, or when it did not answer
a ping within `fault.actor_timeout_s` (a frozen process, a blocked event loop: its groups would
count as generating, and hold the admission room, until the run stalls); the last three are
killed, so that they cannot come back into an old group. One `failed` call per actor is always
outstanding, so a death is noticed even while nothing else is pending on that actor. A
replacement starts in the background (a vLLM engine takes ~25 s) while the survivors go on; once
it is up it joins the group and receives the current weights at the next moment no step runs
(between steps, or at once when no actor was left to feed a step), and gets prompts only after
that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from asyncrl.config import Config
from asyncrl.observe.worker_logs import ENV as LOG_ENV
from asyncrl.observe.worker_logs import log_env
from asyncrl.orchestrator import components
from asyncrl.orchestrator.placement import actor_resources, check_placeable
from asyncrl.rollout.engine import EngineFailed, SamplingSpec
from asyncrl.types import ActorCallFailed, PromptItem, RunFailed, Sample, Stopping

log = logging.getLogger(__name__)

PROCESS_DIED = "actor process died"
PING_EVERY_S = 2.0  # how often a live actor is asked again once it answered


class ActorPool:
    def __init__(self, cfg: Config, model_path: str, sample_endpoint: str):
        self.cfg, self.model_path, self.endpoint = cfg, model_path, sample_endpoint
        self.actors: dict[int, Any] = {}  # live actors that hold the current weights: they get prompts
        self.starting: dict[int, tuple[Any, Any]] = {}  # id -> (handle, start ref)
        self._calls: dict[int, list[Any]] = {}  # refs of calls not yet seen to finish, per actor
        self._watch: dict[int, Any] = {}  # actor -> its outstanding `failed` call
        self._pings: dict[int, tuple[Any, float]] = {}  # actor -> (its outstanding ping or None, since when)

    @property
    def ids(self) -> list[int]:
        return sorted(self.actors)

    def spawn(self, num_actors: int) -> None:
        """Start `num_actors` actors, their engines loading in their own processes; returns at once
        (`wait_started` waits for them)."""
        check_placeable(actor_resources(self.cfg.rollout), "a rollout actor",
                        "rollout.num_cpus_per_actor, rollout.num_gpus_per_actor or rollout.resources")
        for i in range(num_actors):
            self._spawn(i)

    def wait_started(self, stopping: Stopping | None = None, say: Callable[[str], None] | None = None) -> None:
        """Wait until every spawned actor's engine is up (`say`ing how many are, now and then); they
        become members. A stop asked for meanwhile (`stopping`) ends the wait: StartInterrupted."""
        refs = [ref for _, ref in self.starting.values()]
        try:
            components.wait_to_start(refs, stopping, "rollout engines", say)
            ray.get(refs)
        except ray.exceptions.RayError as e:  # e.g. an engine that sees a GPU it did not ask for
            raise RunFailed(f"a rollout actor could not start: {components.start_failure(e)}") from None
        self.admit_started(block=True)

    def reset(self, cfg: Config, sample_endpoint: str, model_path: str) -> None:
        """The next run of a study on these actors (orchestrator/warm.py): each cancels the last
        run's requests, streams to `sample_endpoint` and takes `cfg`'s seed; the run's first push
        gives them its weights (`model_path`: the run's base model, what replacements load). An
        actor still starting is waited for first."""
        self.admit_started(block=True)
        self.cfg, self.endpoint, self.model_path = cfg, sample_endpoint, model_path
        ray.get([handle.reset.remote(sample_endpoint, cfg.sampling_seed, log_env(
            cfg.run_dir, f"actor-{i}", cfg.observe.worker_logs).get(LOG_ENV)) for i, handle in self.actors.items()])
        self._calls = {i: [] for i in self.actors}

    def _spawn(self, actor_id: int) -> None:
        handle = components.start_rollout_actor(self.cfg, self.model_path, self.endpoint, actor_id)
        self.starting[actor_id] = (handle, handle.start.remote())

    def admit_started(self, block: bool = False) -> list[int]:
        """Actors whose engines are up become members (call at a step boundary, then push: the
        push rebuilds the weight-sync group and they get the current weights before any prompt). Returns
        their ids; an actor that failed to start is tried again."""
        ready = [i for i, (_, ref) in self.starting.items() if block or ray.wait([ref], timeout=0)[0]]
        joined = []
        for i in ready:
            handle, ref = self.starting.pop(i)
            try:
                ray.get(ref)
            except RayActorError as e:
                log.warning("rollout actor %d failed to start (%s); trying again", i, e)
                self._spawn(i)
                continue
            self.actors[i] = handle
            self._watch[i] = handle.failed.remote()
            joined.append(i)
        return joined

    # -- prompts ------------------------------------------------------------------------------

    def submit(self, actor_id: int, items: list[PromptItem], spec: SamplingSpec, group_size: int) -> None:
        ref = self.actors[actor_id].submit.remote(items, spec, group_size)
        self._calls.setdefault(actor_id, []).append(ref)

    def evaluate(self, actor_id: int, prompts: list[PromptItem], spec: SamplingSpec, n: int) -> "PendingCall":
        """Generate n samples of each held-out prompt on one actor (`RolloutActor.evaluate`)."""
        return PendingCall(self.actors[actor_id].evaluate.remote(prompts, spec, n))

    # -- weights (the calls weight_sync.py waits on together: object refs, one per actor) ----------

    def init_weight_sync(self, ids: list[int], host: str, port: int, tensor_parallel_size: int, world_size: int,
                         timeout_s: float, join_timeout_s: float | None = None) -> list[Any]:
        """Actors `ids` join the weight-sync group; actor ids[r]'s engine workers take ranks
        1 + tp * r onwards (rank 0 is the learner's)."""
        return [self.actors[a].init_weight_sync.remote(host, port, 1 + tensor_parallel_size * r, world_size, timeout_s,
                                                       join_timeout_s) for r, a in enumerate(ids)]

    def update_weights(self, ids: list[int], weight_meta: dict[str, Any], version: int, rewind: bool) -> list[Any]:
        return [self.actors[a].update_weights.remote(weight_meta, version, rewind) for a in ids]

    def prompt_logprobs(self, ids: list[int], token_ids: list[int]) -> list[Any]:
        return [self.actors[a].prompt_logprobs.remote(token_ids) for a in ids]

    def find_dead(self) -> dict[int, str]:
        """Live actors that are gone or hung, with why; they are removed (cheap: no waiting)."""
        dead, now = {}, time.monotonic()
        for a in self.ids:
            refs = self._calls.get(a, [])
            finished, self._calls[a] = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
            why = next(filter(None, map(why_gone, [self._watch.get(a), *finished])), None) or self._unanswered(a, now)
            if why:
                dead[a] = why
        for a, why in dead.items():
            self.remove(a, kill=why != PROCESS_DIED)
        return dead

    def _unanswered(self, actor_id: int, now: float) -> str | None:
        """Why the actor counts as hung: its last ping unanswered for fault.actor_timeout_s (one
        ping outstanding at a time, the next PING_EVERY_S after an answer); None while it answers."""
        timeout_s = self.cfg.fault.actor_timeout_s
        if not timeout_s:
            return None
        ping, since = self._pings.get(actor_id, (None, -PING_EVERY_S))
        if ping is not None and ray.wait([ping], timeout=0)[0]:  # answered (or died: the watch says so)
            ping, since = None, now
        if ping is None and now - since >= PING_EVERY_S:
            ping, since = self.actors[actor_id].ping.remote(), now
        self._pings[actor_id] = (ping, since)
        if ping is not None and now - since > timeout_s:
            return f"no answer for {now - since:.0f}s (fault.actor_timeout_s={timeout_s:g})"
        return None

    def remove(self, actor_id: int, kill: bool = False) -> None:
        handle = self.actors.pop(actor_id, None)
        self._calls.pop(actor_id, None)
        self._watch.pop(actor_id, None)
        self._pings.pop(actor_id, None)
        if kill and handle is not None:
            ray.kill(handle, no_restart=True)

    def replace(self, actor_id: int) -> None:
        """Start a fresh actor under the same id (it joins at a step boundary, `admit_started`)."""
        self._spawn(actor_id)

    def scale_to(self, num_actors: int) -> tuple[list[int], list[int]]:
        """Start actors up to `num_actors` or stop the newest ones; returns (started, stopped)."""
        have = sorted([*self.actors, *self.starting])
        started, stopped = [], []
        next_id = max(have, default=-1) + 1
        while len(have) + len(started) - len(stopped) < num_actors:
            self._spawn(next_id)
            started.append(next_id)
            next_id += 1
        for a in reversed(have):
            if len(have) - len(stopped) <= num_actors:
                break
            if a in self.starting:
                ray.kill(self.starting.pop(a)[0], no_restart=True)
            else:
                self.remove(a, kill=True)
            stopped.append(a)
        return started, stopped  # the next push rebuilds the weight-sync group without the stopped ones

    def why_gone(self, actor_id: int) -> str | None:
        """Why its outstanding `failed` call says the actor is gone (see `why_gone`); None: alive."""
        return why_gone(self._watch.get(actor_id))

    def stats(self) -> list[dict[str, Any]]:
        return ray.get([self.actors[a].get_stats.remote() for a in self.ids])

    def stuck_episodes(self, timeout_s: float = 5.0) -> tuple[str, ...]:
        """What holds each actor's episodes up (hung environment steps, long agent episodes), for a
        stalled run's diagnosis; an actor that does not answer within `timeout_s` is said as such."""
        out = []
        for a in self.ids:
            try:
                stuck = ray.get(self.actors[a].get_stats.remote(), timeout=timeout_s).get("episodes_stuck")
            except Exception as e:  # dead or busy: the diagnosis says so rather than waiting on it
                stuck = f"no answer within {timeout_s:g}s ({type(e).__name__})"
            if stuck:
                out.append(f"actor {a}: {stuck}")
        return tuple(out)

    def shutdown(self) -> None:
        """Every actor whose engine is up shuts it down at once (each takes seconds), within 30 s in
        all; then their processes end, so their CPUs are free for another run on the same cluster.
        An actor whose engine is still loading is killed at once: its shutdown would run only once
        the engine is up (vLLM's start-up holds the actor's event loop; minutes for a large model),
        and the engine's processes end with the actor's (rollout/owner.py)."""
        loading = [i for i, (_, ref) in self.starting.items() if not ray.wait([ref], timeout=0)[0]]
        handles = {**self.actors, **{i: h for i, (h, _) in self.starting.items()}}
        calls = [(i, handles[i].shutdown.remote()) for i in handles if i not in loading]
        deadline = time.monotonic() + 30
        for i, ref in calls:
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # shutting down anyway; say what failed
                log.warning("rollout actor %d: shutdown failed: %r; killed", i, e)
        for h in handles.values():
            ray.kill(h, no_restart=True)


class PendingCall:
    """A call to an actor whose answer is polled for, not waited on (the driver's loop never blocks)."""

    def __init__(self, ref: Any):
        self.ref = ref

    def done(self) -> bool:
        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self) -> list[Sample]:
        """The answer; `ActorCallFailed` if the actor died or its engine failed the requests."""
        try:
            return ray.get(self.ref)
        except (RayActorError, RayTaskError) as e:
            raise ActorCallFailed(f"{type(e).__name__}: {e}") from e


def why_gone(ref: Any) -> str | None:
    """Why a finished call says its actor is gone: the process died (RayActorError) or the engine
    failed (`EngineFailed`, the actor's calls raise it from then on); None while the call runs,
    when it succeeded, or when it raised anything else (the actor is alive)."""
    if ref is None or not ray.wait([ref], timeout=0)[0]:
        return None
    try:
        ray.get(ref)
    except RayActorError:
        return PROCESS_DIED
    except EngineFailed as e:  # Ray's wrapper: the actor's own exception is its `cause`
        return f"its engine failed: {getattr(e, 'cause', e)}"
    except Exception:  # noqa: BLE001 - raised inside a live actor
        return None
    return None


def describe(lost: dict[int, str]) -> str:
    return "; ".join(f"rollout actor {a} ({why})" for a, why in sorted(lost.items())) or "no actor"
