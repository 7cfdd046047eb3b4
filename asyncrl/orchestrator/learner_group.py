"""The learner ranks as Ray actors, started, called and stopped through one handle.

`learner.num_ranks` ranks are placed in one placement group (PACK: on one node where they fit;
a bundle per rank of `learner.num_cpus` CPUs and `learner.num_gpus` GPUs, so one GPU each on a
GPU cluster) and join one torch.distributed group at start (gloo on CPU, NCCL on GPU), whose
rendezvous is hosted on rank 0's node.

Each of the ranks' methods the run uses is a method here, typed. Most go to every rank, because
most are collective on a sharded learner (a step, a push, a checkpoint and the parity probe all
gather parameters); the caller gets rank 0's answer. A `GroupCall` is ready when every rank has
answered, and raises as soon as one rank fails, rather than waiting for the others to time out in
a collective the failed rank left. Only the weight-sync rendezvous and its metadata are rank 0's
alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.buffer.base import StepBatch
from asyncrl.buffer.packing import rank_batches
from asyncrl.config import AlgoConfig, Config
from asyncrl.learner.rank import LearnerRank
from asyncrl.observe.worker_logs import ENV as LOG_ENV
from asyncrl.observe.worker_logs import log_env
from asyncrl.orchestrator.components import process_env, start_failure, wait_to_start
from asyncrl.orchestrator.placement import check_placeable, rank_resources
from asyncrl.sync.wire import free_port
from asyncrl.transport.codec import encode_batch
from asyncrl.transport.zmq_stream import FrameSender
from asyncrl.types import Locate, RunFailed, Stopping


def _run_args(cfg: Config, locate: Locate | None) -> dict[str, Any]:
    """What a rank takes from the run's config besides its sections, at start and at a reset."""
    return {"dtype": cfg.model.dtype, "engine_dtype": cfg.engine_dtype, "seed": cfg.seed, "locate": locate,
            "max_response_tokens": cfg.longest_response}


class GroupCall:
    """One method called on every rank."""

    def __init__(self, refs: list[Any]):
        self.refs = refs
        self._seen: set[Any] = set()

    def ready(self) -> bool:
        """True once every rank answered; raises the first failure as soon as it is known."""
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in done:
            if ref not in self._seen:
                ray.get(ref)  # raises the rank's error
                self._seen.add(ref)
        return len(done) == len(self.refs)

    def result(self, timeout_s: float | None = None) -> Any:
        """Rank 0's answer, after every rank answered; a failed rank raises at once."""
        waiting = list(self.refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1, timeout=timeout_s)
            if not done:
                raise TimeoutError(f"learner ranks did not answer within {timeout_s}s")
            ray.get(done[0])
        return ray.get(self.refs[0])


class LearnerGroup:
    def __init__(self, cfg: Config, model_path: str, ready_timeout_s: float = 120.0, locate: Locate | None = None):
        lc = cfg.learner
        bundle = rank_resources(lc)
        check_placeable(bundle, "a learner rank", "learner.num_cpus, learner.num_gpus or learner.resources")
        self.placement = placement_group([bundle] * lc.num_ranks, strategy="PACK")
        ready, _ = ray.wait([self.placement.ready()], timeout=ready_timeout_s)
        if not ready:
            remove_placement_group(self.placement)
            raise RunFailed(f"Ray could not place {lc.num_ranks} learner rank(s) of {bundle} within "
                            f"{ready_timeout_s:.0f}s (cluster: {ray.cluster_resources()}); lower learner.num_ranks, "
                            "learner.num_cpus or learner.num_gpus")
        address = ray.get(_rendezvous.options(scheduling_strategy=self._bundle(0)).remote())
        self.ranks = [
            ray.remote(LearnerRank).options(
                num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, resources=lc.resources, scheduling_strategy=self._bundle(r),
                runtime_env={"env_vars": process_env(cfg, _log_name(r))}
            ).remote(model_path, lc, cfg.algo, rank=r, world_size=lc.num_ranks, group_address=address,
                     **_run_args(cfg, locate))
            for r in range(lc.num_ranks)]
        # a rank's first call answers once its constructor has (its model loaded)
        self._loaded = [rank.batch_endpoint.remote() for rank in self.ranks]
        self._senders: list[FrameSender] | None = None  # created at the first step: ranks are still starting
        self._pass_over_opened = needs_rollout_batch_pass(cfg.algo)

    def wait_started(self, stopping: Stopping | None = None, say: Callable[[str], None] | None = None) -> None:
        """Wait until every rank has loaded its model (`say`ing how many have, now and then); a rank
        that could not start is a one-line RunFailed, and a stop asked for meanwhile (`stopping`)
        ends the wait: StartInterrupted."""
        try:
            wait_to_start(self._loaded, stopping, "learner ranks", say)
            ray.get(self._loaded)
        except ray.exceptions.RayError as e:
            raise RunFailed(f"a learner rank could not start: {start_failure(e)}") from None

    def reset(self, cfg: Config, model_path: str, locate: Locate | None = None) -> GroupCall:
        """Every rank starts the run of `cfg` afresh in its process (LearnerRank.reset): the next run
        of a study on the same ranks (orchestrator/warm.py)."""
        self._pass_over_opened = needs_rollout_batch_pass(cfg.algo)
        return GroupCall([rank.reset.remote(model_path, cfg.learner, cfg.algo, log_file=log_env(
            cfg.run_dir, _log_name(r), cfg.observe.worker_logs).get(LOG_ENV), **_run_args(cfg, locate))
            for r, rank in enumerate(self.ranks)])

    def _bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=index)

    def _all(self, method: str, *args, **kwargs) -> GroupCall:
        return GroupCall([getattr(r, method).remote(*args, **kwargs) for r in self.ranks])

    # -- training -------------------------------------------------------------------------------

    def train_step(self, step: int, batch: StepBatch, reset_reference: bool) -> GroupCall:
        """Stream each rank its part of the step (split by tokens), with the step's global counts
        and its role in the rollout-batch schedule (with "open", each rank's share of the opened
        batch when the learner makes a pass over it), and start the step on every rank. Its
        result is rank 0's `StepResult`."""
        if self._senders is None:
            self._senders = [FrameSender(e) for e in ray.get([r.batch_endpoint.remote() for r in self.ranks])]
        opened = batch.opened if self._pass_over_opened else None
        parts = rank_batches(step, batch.chunks, len(self.ranks), batch.token_budget, batch.role, opened)
        for rank, part in enumerate(parts):
            self._senders[rank].send(encode_batch(part))
        return self._all("train_step", step, reset_reference=reset_reference)

    # -- weights --------------------------------------------------------------------------------

    def weight_sync_address(self) -> tuple[str, int]:
        """Where the next weight-sync group meets: rank 0 hosts it, so an address and a free port
        of rank 0's node."""
        host, port = ray.get(_rendezvous.options(scheduling_strategy=self._bundle(0)).remote()).rsplit(":", 1)
        return host, int(port)

    def init_weight_sync(self, kind: str, host: str, port: int, world_size: int, timeout_s: float,
                         bucket_bytes: int, transfer: str = "full", full_every: int = 0,
                         join_timeout_s: float | None = None) -> ray.ObjectRef:
        """Rank 0 joins the weight-sync group as its rank 0 (returns once every member joined)."""
        return self.ranks[0].init_weight_sync.remote(kind, host, port, world_size, timeout_s, bucket_bytes,
                                                     transfer, full_every, join_timeout_s)

    def weight_metadata(self) -> dict[str, Any]:
        """The plan of the pushes (names, shapes, dtypes, buckets) the actors receive by."""
        return ray.get(self.ranks[0].weight_metadata.remote())

    def push_weights(self, version: int, whole: bool = False) -> GroupCall:
        """Broadcast the weights of `version` (every rank helps gather; rank 0 sends); `whole`: no
        bucket as a delta."""
        return self._all("push_weights", version, whole)

    def prompt_logprobs(self, token_ids: list[int]) -> GroupCall:
        """The parity probe: log p(token_i | tokens_<i) under the learner's weights."""
        return self._all("prompt_logprobs", token_ids)

    def param_fingerprint(self) -> GroupCall:
        return self._all("param_fingerprint")

    # -- files ----------------------------------------------------------------------------------

    def answer_storage_probe(self, probe: str, answer: str, token: str) -> list[str]:
        """Every rank copies `token` from the file `probe` to `<answer>.<rank>` if it sees it; their
        node addresses, in rank order. The run's first wait on the ranks: one that could not start
        is a one-line RunFailed here."""
        try:
            call = self._all("answer_storage_probe", probe, answer, token)
            call.result()
            return ray.get(call.refs)
        except ray.exceptions.RayError as e:
            raise RunFailed(f"a learner rank could not start: {start_failure(e)}") from None

    def save(self, path: str, merged: bool = False) -> GroupCall:
        """The policy in Hugging Face format at `path` (a LoRA policy: its adapter, and with `merged`
        the merged model under `path/merged`); its result is the path."""
        return self._all("save", path, merged)

    def save_checkpoint(self, path: str) -> GroupCall:
        """The learner's part of a checkpoint; its result holds `save_s`."""
        return self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> GroupCall:
        """Resume from the learner's part of a checkpoint; its result is the version."""
        return self._all("load_checkpoint", path)

    def owns(self, actor_id: str | None) -> bool:
        """Whether a dead actor's id (hex) is one of the ranks."""
        return actor_id in {r._actor_id.hex() for r in self.ranks}

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Every rank closes its sockets, then its process ends. Ranks still loading their model are
        killed without being asked: a rank's shutdown would run only once its load is done (minutes
        for a large model), and it has nothing open to close yet."""
        try:
            if not ray.wait(self._loaded, num_returns=len(self._loaded), timeout=0)[1]:
                self._all("shutdown").result(timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """End every rank's process now, without asking (a rank died: the others may be stuck in
        a collective it left, their calls queued behind it)."""
        for sender in self._senders or []:
            sender.close()
        self._senders = None
        for r in self.ranks:
            ray.kill(r)
        # its CPUs come back now, not when the driver leaves Ray: a driver that runs several runs
        # on one cluster (tools/fault_matrix.py), or a restarted learner, needs them
        remove_placement_group(self.placement)


@ray.remote(num_cpus=0)
def _rendezvous() -> str:
    """host:port of the learner group's rendezvous, found on rank 0's node."""
    host = ray.util.get_node_ip_address()
    return f"{host}:{free_port(host)}"


def _log_name(rank: int) -> str:
    """logs/learner.log for rank 0 (the one most runs have), learner-<r>.log for the others."""
    return "learner" if rank == 0 else f"learner-{rank}"


def needs_rollout_batch_pass(algo: AlgoConfig) -> bool:
    """Whether the learner runs a no-grad pass over each rollout batch it opens: decoupled PPO
    takes pi_prox from it (learner/proximal.py), exact entropy control the batch's e_k
    (learner/entropy_schedule.py)."""
    ec = algo.entropy_control
    return algo.decoupled or (ec.enabled and ec.measure == "exact")
