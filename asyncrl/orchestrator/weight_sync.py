"""Weight sync as one owner: who is in the group, where it meets, each push, its retry and the
parity probe. It is the one holder of the learner for pushes, and stamps one version on both legs
(the learner's broadcast and every actor's receive carry the same number; a learner whose own
counter disagrees refuses the push).

Group: gloo (and NCCL) groups have a fixed membership and do not survive a member's death: a
broadcast to a group with a dead peer fails ("connection closed by peer") or times out. So the
group is rebuilt whenever membership changes: learner rank 0 and every live actor join a new
group, and the next push reaches exactly the live actors. The rendezvous is hosted by learner rank
0, so rank 0's node picks its address and port (`LearnerGroup.weight_sync_address`). Membership
changes only at step boundaries, when the learner is not training (its Ray calls run in order, so
a push queued behind a step would carry the next version).

Failures: an actor that dies during a push, or does not finish it within `sync.timeout_s`, is
removed from the pool (killed if it hung, so it cannot come back into an old group) and reported;
the push is then retried once around the survivors, on a new group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from asyncrl.config import SyncConfig
from asyncrl.orchestrator.actor_pool import PROCESS_DIED, ActorPool, describe, why_gone
from asyncrl.orchestrator.learner_group import LearnerGroup
from asyncrl.sync.protocol import WeightSyncError
from asyncrl.types import RunFailed


# per actor, added up in a push's row
SUMMED = ("sync/aborted_requests", "sync/kept_requests", "sync/verify_failures", "sync/received_bytes")


# from rank 0's push: bytes on the wire against a whole push's, the share that changed, whether whole
LEARNER_KEYS = ("sync/push_bytes", "sync/num_bytes", "sync/num_buckets", "sync/changed_frac", "sync/whole")


class PushFailed(RunFailed):
    """A push did not reach every actor, or failed on the learner; `dead` names the actors that
    caused it. Uncaught, it ends the run with its one line (RunFailed)."""

    def __init__(self, message: str, dead: list[int]):
        super().__init__(message)
        self.dead = dead


class WeightSync:
    cfg: SyncConfig
    learner: LearnerGroup
    pool: ActorPool
    members: list[int]
    """The actors in the current group, in rank order (ranks 1 + TP * r ... for members[r])."""
    pushes: int
    """Completed pushes, for sync.probe_every (saved in the run's checkpoint)."""
    before_push: list[Callable[[int], None]]
    """Called with the version before each push attempt (tracing; tools/fault_matrix.py injects faults)."""

    def __init__(self, cfg: SyncConfig, learner: LearnerGroup, pool: ActorPool, fake_engines: bool = False,
                 tensor_parallel_size: int = 1, probe_tolerance: float = 1e-4):
        self.cfg, self.learner, self.pool = cfg, learner, pool
        self.probe_tolerance = probe_tolerance  # Config.parity_tolerance: sync.probe_tolerance or the dtypes' own
        self.tensor_parallel_size = tensor_parallel_size  # each engine's workers, all in the group
        self.fake_engines = fake_engines  # fake engines load nothing: no group, no bytes
        self.members, self.pushes, self.before_push = [], 0, []
        self._weight_meta: dict[str, Any] = {}

    def rebind(self, learner: LearnerGroup) -> None:
        """Push from a new learner group (a restarted one): the next push forms a new group."""
        self.learner, self.members = learner, []

    def state_dict(self) -> dict[str, Any]:
        return {"pushes": self.pushes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The pushes made so far (sync.probe_every counts them)."""
        self.pushes = state["pushes"]

    def rebuild_group(self, join_timeout_s: float | None = None) -> None:
        """Learner rank 0 and every live actor join a fresh weight-sync group (all at once), within
        join_timeout_s (default sync.timeout_s); its collectives time out after sync.timeout_s
        whatever the join's, so that a member that hangs in a push is told from the ones that
        wait for it."""
        ids = self.pool.ids
        if self.fake_engines:
            self.members = ids
            return
        host, port = self.learner.weight_sync_address()
        join_s = join_timeout_s or self.cfg.timeout_s
        tp = self.tensor_parallel_size  # every TP worker of an engine is a member: rank offset + its TP rank
        world = 1 + tp * len(ids)
        refs = [self.learner.init_weight_sync(self.cfg.type, host, port, world, self.cfg.timeout_s,
                                              self.cfg.bucket_mb << 20, self.cfg.transfer, self.cfg.full_every,
                                              join_s)]
        refs += self.pool.init_weight_sync(ids, host, port, tp, world, self.cfg.timeout_s, join_s)
        # a group formed again mid-run (after a loss) waits sync.timeout_s: the message names the field
        # to raise; the run's first group names its own (lifecycle.form_weight_sync_group)
        within = "" if join_timeout_s else f" within sync.timeout_s={join_s:g}s"
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=join_s + 30)
        lost = self._remove_lost(ids, refs[1:], waiting)
        if lost or refs[0] in waiting:
            who = describe(lost) if lost else "learner rank 0 did not join"
            raise PushFailed(f"weight-sync group at {host}:{port} could not form{within}: {who}", sorted(lost))
        try:
            ray.get(refs[0])
        except ray.exceptions.RayTaskError as e:  # a dead rank is RayActorError: the learner's restart
            raise PushFailed(f"weight-sync group at {host}:{port} could not form{within}: learner rank 0 "
                             f"said {_cause(e)}", []) from None
        self._weight_meta = self.learner.weight_metadata()
        self.members = ids

    def push(self, version: int, step: int | None, on_lost: Callable[[list[int], str], None] | None = None,
             rewind: bool = False) -> dict[str, float]:
        """Drain push of `version` to every live actor (`rewind`: older than theirs, after a
        learner restart). Actors that die or do not finish within sync.timeout_s are removed and
        reported to `on_lost(ids, why)`; then the push is retried once around the survivors (a new
        group). Without `on_lost`, `PushFailed` is raised."""
        try:
            out = self._push_once(version, step, rewind)
        except PushFailed as e:
            if on_lost is None:
                raise
            on_lost(e.dead, str(e))
            out = self._push_once(version, step, rewind)
        if out.get("sync/verify_failures"):
            out.update(self._heal(version, step))
        return out

    def _heal(self, version: int, step: int | None) -> dict[str, float]:
        """The whole push that follows one some engine's checksums refused: every bucket again, no
        delta, to every member (one broadcast group); the engines that failed stay closed until it
        lands. A failure on a whole push means the bytes are corrupted on the way or in memory: the
        run stops rather than train on an engine that computes with other weights."""
        healed = self._push_once(version, step, whole=True)  # the same version again: no rewind needed
        if healed.get("sync/verify_failures"):
            raise RunFailed(f"weight push of version {version} (step {step}): {healed['sync/verify_failures']:g} "
                            "bucket(s) failed their checksum again on a whole push; the bytes are corrupted "
                            "between the learner and an engine")
        return {"sync/heal_s": healed["sync/push_s"], "sync/heal_bytes": healed.get("sync/push_bytes", 0.0)}

    def push_and_probe(self, version: int, step: int, probe_ids: list[int] | None,
                       on_lost: Callable[[list[int], str], None],
                       on_parity_failure: Callable[[str], None]) -> dict[str, float]:
        """`push`, then every sync.probe_every pushes the logprob-parity check, which catches a
        push that silently did not change what an engine computes: `on_parity_failure(error)`,
        then the RuntimeError is raised."""
        out = self.push(version, step, on_lost=on_lost)
        self.pushes += 1
        every = self.cfg.probe_every
        if every and self.pushes % every == 0 and probe_ids and self.pool.ids:
            try:
                out["sync/probe_max_abs_diff"] = self.check_parity(probe_ids, self.probe_tolerance, version)
            except RuntimeError as e:
                on_parity_failure(str(e))
                raise
        return out

    def _push_once(self, version: int, step: int | None, rewind: bool = False,
                   whole: bool = False) -> dict[str, float]:
        for observer in self.before_push:
            observer(version)
        t0 = time.monotonic()
        ids = self.pool.ids
        if not ids:  # every actor lost: replacements get the weights when they join
            return {"sync/push_s": 0.0, "sync/version": version}
        if ids != self.members:
            self.rebuild_group()
        refs = self.pool.update_weights(ids, self._weight_meta, version, rewind)
        learner = self.learner.push_weights(version, whole) if self._weight_meta else None
        all_refs = refs + (learner.refs if learner is not None else [])
        timeout_s = self.cfg.timeout_s
        _, waiting = ray.wait(all_refs, num_returns=len(all_refs), timeout=timeout_s)
        if waiting and learner is not None:
            # A member that never joins the collective stalls everyone in it until gloo's own
            # timeout (the same sync.timeout_s); past that the others fail, and only the culprit
            # is still waiting. (Fake engines have no collective: who is waiting is the culprit.)
            _, waiting = ray.wait(all_refs, num_returns=len(all_refs), timeout=timeout_s + 10)
        lost = self._remove_lost(ids, refs, waiting)
        if lost:
            if learner is not None:
                try:  # with its peers gone the learner's broadcast fails fast; wait it out
                    learner.result(timeout_s)
                except (WeightSyncError, ray.exceptions.RayTaskError, TimeoutError):
                    pass
            self.members = []
            raise PushFailed(f"weight push of version {version} (step {step}) lost {describe(lost)}", sorted(lost))
        try:
            finished = learner is None or learner.ready()  # raises RayActorError if a rank died
        except ray.exceptions.RayTaskError as e:
            self.members = []
            raise PushFailed(f"weight push of version {version} (step {step}) failed on the learner: "
                             f"{_cause(e)} (sync.timeout_s={timeout_s:g})", []) from None
        if not finished:
            self.members = []
            raise PushFailed(f"weight push of version {version} (step {step}) did not finish on the learner "
                             f"ranks within sync.timeout_s={timeout_s:g}", [])
        out = {"sync/push_s": time.monotonic() - t0, "sync/version": version}
        if learner is not None:  # what the sender counted: bytes on the wire, the share that changed
            sent = learner.result()
            out.update({k: sent[k] for k in LEARNER_KEYS if k in sent})
        results = []
        for actor, ref in zip(ids, refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as e:  # its receive failed (its timeout) while the send went through
                self.members = []
                raise PushFailed(f"weight push of version {version} (step {step}) failed on rollout actor {actor}: "
                                 f"{_cause(e)} (sync.timeout_s={timeout_s:g})", []) from None
        for r in results:
            for k, v in (r or {}).items():
                # counts add up; occupancy is the actors' mean; for times the slowest actor is what
                # the step waited for
                if k in SUMMED or k == "rollout/occupancy":
                    out[k] = out.get(k, 0) + (v if k in SUMMED else v / len(results))
                else:
                    out[k] = max(out.get(k, 0.0), v)
        return out

    def _remove_lost(self, ids: list[int], refs: list[Any], waiting: list[Any]) -> dict[int, str]:
        """After a collective call (`refs[i]` on actor `ids[i]`): the members it lost, with why,
        removed from the pool. Gone: see `why_gone`; hung: still `waiting`, killed, since a member
        that hangs in a collective cannot be trusted again. A call that raised inside a live actor
        (a survivor's receive, broken by a dead peer) loses nothing with gloo: the retry on a new
        group decides. With NCCL it loses the actor: vLLM's NCCL receiver leaves a failed layerwise
        reload unfinished, so that engine is replaced rather than pushed to again."""
        lost = {}
        for a, ref in zip(ids, refs):
            why = self.pool.why_gone(a) or why_gone(ref) or ("timed out" if ref in waiting else None)
            if why is None and self.cfg.type == "nccl":
                why = _raised(ref)
            if why:
                lost[a] = why
                self.pool.remove(a, kill=why != PROCESS_DIED)
        return lost

    def check_parity(self, probe_ids: list[int], tolerance: float, version: int) -> float:
        """Max |actor - learner| logprob over the probe, over all actors; raises past `tolerance`.

        This is what catches a push that silently did not change what an engine computes (tied
        embeddings and prepacked CPU weights, see sync/vllm_gloo_engine.py)."""
        want = self.learner.prompt_logprobs(probe_ids).result()
        ids = self.pool.ids
        gaps = [max(abs(a - b) for a, b in zip(got, want))
                for got in ray.get(self.pool.prompt_logprobs(ids, probe_ids))]
        for actor, gap in zip(ids, gaps):
            if gap > tolerance:
                raise RuntimeError(
                    f"after the push of version {version}, rollout actor {actor}'s logprobs differ from the "
                    f"learner's by {gap:.3g} nats (tolerance {tolerance}): the engine is not computing with "
                    "the pushed weights")
        return max(gaps, default=0.0)


def _cause(e: ray.exceptions.RayTaskError) -> str:
    """The first line of what a remote call raised, without Ray's traceback."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[-1][:200]}"


def _raised(ref: Any) -> str | None:
    """Why a finished call raised inside its (live) actor, None if it did not."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError as e:
        return f"its NCCL receive failed ({type(e.cause).__name__}: {str(e.cause)[:200]})"
    except Exception:  # not finished, or gone (why_gone's case)
        return None
    return None
