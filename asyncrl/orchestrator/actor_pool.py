"""The rollout actors as one object: start them, hand them prompts, push weights, notice when one
dies, replace it, and grow or shrink the pool while the run goes on.

Weight sync group: gloo (and NCCL) groups have a fixed membership and do not survive a member's
death: a broadcast to a group with a dead peer fails ("connection closed by peer") or times out.
So the group is rebuilt whenever membership changes: the learner and every live actor join a new
group on a new port, and the next push reaches exactly the live actors. Membership changes only at
step boundaries, when the learner is not training (its Ray calls run in order, so a push queued
behind a step would carry the next version).

Failures: an actor is dead when a call to it raises `RayActorError` (its process was killed, its
node left), when its engine failed (every request fails; `RolloutActor.failed` returns, and the
actor is killed), or when it did not finish a push within `sync.timeout_s` (then it is killed, so
it cannot come back into an old group). One `failed` call per actor is always outstanding, so a
death is noticed even while nothing else is pending on that actor. A replacement starts in the
background (a vLLM engine takes ~25 s) while the survivors go on; once it is up it joins the group
and receives the current weights at the next moment no step runs (between steps, or at once when
no actor was left to feed a step), and gets prompts only after that.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from asyncrl.config import Config
from asyncrl.orchestrator import components
from asyncrl.rollout.engine import EngineFailed
from asyncrl.sync.gloo_sender import free_port
from asyncrl.sync.protocol import WeightSyncError

log = logging.getLogger(__name__)

PROCESS_DIED = "actor process died"


class PushFailed(RuntimeError):
    """A push did not reach every actor; `dead` names the actors that caused it."""

    def __init__(self, message: str, dead: list[int]):
        super().__init__(message)
        self.dead = dead


class ActorPool:
    def __init__(self, cfg: Config, model_path: str, sample_endpoint: str, learner: Any, host: str,
                 rpc_dir: str | None = None):
        self.cfg, self.model_path, self.endpoint, self.rpc_dir = cfg, model_path, sample_endpoint, rpc_dir
        self.learner, self.host = learner, host
        self.actors: dict[int, Any] = {}  # live actors that hold the current weights: they get prompts
        self.starting: dict[int, tuple[Any, Any]] = {}  # id -> (handle, start ref)
        self.weight_meta: dict[str, Any] = {}
        self.pushes = 0  # completed pushes, for sync.probe_every (saved in the run's checkpoint)
        self._calls: dict[int, list[Any]] = {}  # refs of calls not yet seen to finish, per actor
        self._watch: dict[int, Any] = {}  # actor -> its outstanding `failed` call
        self._group_ids: list[int] = []  # members of the current weight-sync group, in rank order

    @property
    def ids(self) -> list[int]:
        return sorted(self.actors)

    def start(self, num_actors: int, version: int) -> None:
        """Start `num_actors` actors, wait for them, form the group, and (on a resumed run, at
        version > 0) push the current weights."""
        for i in range(num_actors):
            self._spawn(i)
        ray.get([ref for _, ref in self.starting.values()])
        self.admit_started(block=True)
        self.rebuild_group()
        if version > 0:
            self.push(version, step=None)

    def _spawn(self, actor_id: int) -> None:
        handle = components.start_rollout_actor(self.cfg, self.model_path, self.endpoint, actor_id, self.rpc_dir)
        self.starting[actor_id] = (handle, handle.start.remote())

    def admit_started(self, block: bool = False) -> list[int]:
        """Actors whose engines are up become members (call at a step boundary, then push: the
        push rebuilds the group and they get the current weights before any prompt). Returns
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

    def rebuild_group(self) -> None:
        """Learner rank 0 and every live actor join a fresh weight-sync group (all at once)."""
        if self.cfg.rollout.engine == "fake":
            self._group_ids = self.ids
            return
        sync = self.cfg.sync
        port, ids = free_port(self.host), self.ids
        world = 1 + len(ids)
        refs = [self.learner.rank0("init_weight_sync", sync.type, self.host, port, world, sync.timeout_s,
                                                     sync.bucket_mb << 20)]
        refs += [self.actors[a].init_weight_sync.remote(self.host, port, r + 1, world, sync.timeout_s)
                 for r, a in enumerate(ids)]
        done, waiting = ray.wait(refs, num_returns=len(refs), timeout=sync.timeout_s + 30)
        lost = self._remove_lost(ids, refs[1:], waiting)
        if lost or refs[0] in waiting:
            raise PushFailed(f"weight-sync group on port {port} could not form: {describe(lost)}", sorted(lost))
        ray.get(refs[0])
        self.weight_meta = ray.get(self.learner.rank0("weight_metadata"))
        self._group_ids = ids

    # -- prompts ------------------------------------------------------------------------------

    def submit(self, actor_id: int, items, spec, group_size: int) -> None:
        ref = self.actors[actor_id].submit.remote(items, spec, group_size)
        self._calls.setdefault(actor_id, []).append(ref)

    def find_dead(self) -> dict[int, str]:
        """Live actors that are gone, with why; they are removed (cheap: no waiting)."""
        dead = {}
        for a in self.ids:
            refs = self._calls.get(a, [])
            finished, self._calls[a] = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
            why = next(filter(None, map(why_gone, [self._watch.get(a), *finished])), None)
            if why:
                dead[a] = why
        for a, why in dead.items():
            self.remove(a, kill=why != PROCESS_DIED)
        return dead

    def remove(self, actor_id: int, kill: bool = False) -> None:
        handle = self.actors.pop(actor_id, None)
        self._calls.pop(actor_id, None)
        self._watch.pop(actor_id, None)
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
        return started, stopped  # the next push rebuilds the group without the stopped ones

    # -- weights ------------------------------------------------------------------------------

    def push(self, version: int, step: int | None, on_lost=None) -> dict[str, float]:
        """Drain push of `version` to every live actor. Actors that die or do not finish within
        sync.timeout_s are removed and reported to `on_lost(ids, why)`; then the push is retried
        once around the survivors (a new group). Without `on_lost`, `PushFailed` is raised."""
        try:
            return self._push_once(version, step)
        except PushFailed as e:
            if on_lost is None:
                raise
            on_lost(e.dead, str(e))
            return self._push_once(version, step)

    def push_and_probe(self, version: int, step: int, probe_ids: list[int] | None, on_lost,
                       on_parity_failure) -> dict[str, float]:
        """`push`, then every sync.probe_every pushes the logprob-parity check, which catches a
        push that silently did not change what an engine computes: `on_parity_failure(error)`,
        then the RuntimeError is raised."""
        out = self.push(version, step, on_lost=on_lost)
        self.pushes += 1
        every = self.cfg.sync.probe_every
        if every and self.pushes % every == 0 and probe_ids and self.ids:
            try:
                out["sync/probe_max_abs_diff"] = self.check_parity(probe_ids, self.cfg.sync.probe_tolerance, version)
            except RuntimeError as e:
                on_parity_failure(str(e))
                raise
        return out

    def _push_once(self, version: int, step: int | None) -> dict[str, float]:
        t0 = time.monotonic()
        ids = self.ids
        if not ids:  # every actor lost: replacements get the weights when they join
            return {"sync/push_s": 0.0, "sync/version": version}
        if ids != self._group_ids:
            self.rebuild_group()
        refs = [self.actors[a].update_weights.remote(self.weight_meta, version) for a in ids]
        learner = self.learner.call("push_weights") if self.weight_meta else None
        all_refs = refs + (learner.refs if learner is not None else [])
        _, waiting = ray.wait(all_refs, num_returns=len(all_refs), timeout=self.cfg.sync.timeout_s)
        if waiting and learner is not None:
            # A member that never joins the collective stalls everyone in it until gloo's own
            # timeout (the same sync.timeout_s); past that the others fail, and only the culprit
            # is still waiting. (Fake engines have no collective: who is waiting is the culprit.)
            _, waiting = ray.wait(all_refs, num_returns=len(all_refs), timeout=self.cfg.sync.timeout_s + 10)
        lost = self._remove_lost(ids, refs, waiting)
        if lost:
            if learner is not None:
                try:  # with its peers gone the learner's broadcast fails fast; wait it out
                    learner.result(self.cfg.sync.timeout_s)
                except (WeightSyncError, ray.exceptions.RayTaskError, TimeoutError):
                    pass
            self._group_ids = []
            raise PushFailed(f"weight push of version {version} (step {step}) lost {describe(lost)}", sorted(lost))
        if learner is not None and not learner.ready():  # raises RayActorError if a rank died
            raise TimeoutError(f"weight push of version {version} (step {step}) did not finish within "
                               f"{self.cfg.sync.timeout_s}s on the learner ranks")
        out = {"sync/push_s": time.monotonic() - t0, "sync/version": version}
        for r in ray.get(refs):
            for k, v in (r or {}).items():
                # counts add up; for times the slowest actor is what the step waited for
                out[k] = out.get(k, 0) + v if k == "sync/aborted_requests" else max(out.get(k, 0.0), v)
        return out

    def _remove_lost(self, ids: list[int], refs: list[Any], waiting: list[Any]) -> dict[int, str]:
        """After a collective call (`refs[i]` on actor `ids[i]`): the members it lost, with why,
        removed from the pool. Gone: see `why_gone`; hung: still `waiting`, killed, since a member
        that hangs in a collective cannot be trusted again. A call that raised inside a live actor
        (a survivor's receive, broken by a dead peer) loses nothing: the retry on a new group decides."""
        lost = {}
        for a, ref in zip(ids, refs):
            why = why_gone(self._watch.get(a)) or why_gone(ref) or ("timed out" if ref in waiting else None)
            if why:
                lost[a] = why
                self.remove(a, kill=why != PROCESS_DIED)
        return lost

    def check_parity(self, probe_ids: list[int], tolerance: float, version: int) -> float:
        """Max |actor - learner| logprob over the probe, over all actors; raises past `tolerance`.

        This is what catches a push that silently did not change what an engine computes (tied
        embeddings and prepacked CPU weights, see sync/vllm_gloo_engine.py)."""
        want = self.learner.call("prompt_logprobs", probe_ids).result()
        ids = self.ids
        gaps = [max(abs(a - b) for a, b in zip(got, want))
                for got in ray.get([self.actors[a].prompt_logprobs.remote(probe_ids) for a in ids])]
        for actor, gap in zip(ids, gaps):
            if gap > tolerance:
                raise RuntimeError(
                    f"after the push of version {version}, rollout actor {actor}'s logprobs differ from the "
                    f"learner's by {gap:.3g} nats (tolerance {tolerance}): the engine is not computing with "
                    "the pushed weights")
        return max(gaps, default=0.0)

    def stats(self) -> list[dict[str, Any]]:
        return ray.get([self.actors[a].get_stats.remote() for a in self.ids])

    def shutdown(self) -> None:
        """Every actor shuts its engine down at once (each takes seconds), within 30 s in all; then
        their processes end, so their CPUs are free for another run on the same cluster."""
        members = [(i, h, "") for i, h in self.actors.items()]
        # a replacement still starting runs its shutdown only once its engine is up (vLLM's
        # start-up holds the actor's event loop): past the 30 s it is killed like the others
        starting = [(i, h, ", still starting") for i, (h, _) in self.starting.items()]
        calls = [(i, h, state, h.shutdown.remote()) for i, h, state in members + starting]
        deadline = time.monotonic() + 30
        for i, _, state, ref in calls:
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # shutting down anyway; say what failed
                log.warning("rollout actor %d%s: shutdown failed: %r; killed", i, state, e)
        for _, h, _, _ in calls:
            ray.kill(h, no_restart=True)


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
