"""A run's parts from their start to their shutdown: what the orchestrator calls at its start,
when a learner rank dies and at its end (orchestrator.py keeps the run loop and the step's finish).

- `open_metrics`: the run directory's resolved config and metric files (rows after a resumed
  checkpoint dropped: they are written again);
- `start_run`: the sample socket, the processes and the driver (built while the engines load),
  started and given the learner's weights; what started is shut down again when a later part fails
  or a stop is asked for before the start is done;
- `start_processes`: the learner ranks and the rollout actors started cold (the engines start
  while the ranks load the model), or `take_over` those of the run before on this cluster (warm.py);
- `form_weight_sync_group`: the first weight-sync group, with the start's timeout;
- `check_parity`: after a push that replaced newer weights (taken over, or rewound by a learner
  restart), the engines' logprobs against the learner's;
- `LearnerRestarts`: a dead learner's replacement, started from a start point (the newest
  checkpoint, or where the run started), with the weight sync rebound to it and the actors pushed
  its weights; it counts the restarts against `fault.max_restarts`;
- `shut_down`: whatever a run started, in order, each part whether or not the one before failed.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError

from asyncrl.compat import hide_broken_torch_extras
from asyncrl.config import Config, write_resolved
from asyncrl.observe.metrics import MetricsWriter, Say
from asyncrl.orchestrator import checkpoint, components
from asyncrl.orchestrator.actor_pool import ActorPool
from asyncrl.orchestrator.checkpointer import Checkpointer, StartPoint
from asyncrl.orchestrator.driver import Driver, build_driver
from asyncrl.orchestrator.learner_group import LearnerGroup
from asyncrl.orchestrator.teacher_engines import TeacherEngines
from asyncrl.orchestrator.warm import Warm
from asyncrl.orchestrator.weight_sync import PushFailed, WeightSync
from asyncrl.transport.codec import decode_samples
from asyncrl.transport.zmq_stream import FrameReceiver
from asyncrl.types import Locate, RunFailed, Stopping


@dataclass(frozen=True)
class Processes:
    """What a run drives besides its own thread: the learner ranks, the rollout actors and the
    group that carries the weights from one to the other."""

    learner: LearnerGroup
    pool: ActorPool
    weight_sync: WeightSync


@dataclass(frozen=True)
class Started:
    """A run's parts once started, and what the learner holds: the policy it loaded, its version,
    and after a take-over the parity probe's gap."""

    driver: Driver
    samples: FrameReceiver
    procs: Processes
    model_path: str
    version: int
    parity: float | None


def open_metrics(cfg: Config, run_dir: Path, resume: StartPoint | None) -> MetricsWriter:
    write_resolved(cfg, run_dir)
    hide_broken_torch_extras()
    if resume:
        MetricsWriter.truncate(run_dir, resume.state["step"])  # rows after the checkpoint are rewritten
    return MetricsWriter(run_dir, cfg.observe.tensorboard, cfg.observe.wandb_project, cfg.name,
                         json.loads(cfg.model_dump_json()))


def start_run(cfg: Config, run_dir: Path, resume: StartPoint | None, warm: Warm | None, metrics: MetricsWriter,
              say: Say, stopping: Stopping | None = None) -> Started:
    """The driver, the sample socket (each run its own) and the processes, started or taken over
    from `warm`, the learner loaded from `resume` and the actors given its weights. Actors always
    start from the base model and get the current weights pushed (a resumed run's checkpoint may
    be pruned before a replacement actor starts). A part that fails to start shuts down the ones
    started before it, so a failed start leaves no process behind; so does a stop asked for while
    it starts (`stopping`), checked between the parts and while it waits for the engines and the
    ranks (StartInterrupted: an engine can take minutes to load, and nothing is trained yet)."""
    t0, base_model = time.monotonic(), components.resolve_model_path(cfg, log=say)
    model_path = resume.model_path(base_model) if resume else base_model
    started: list[Callable[[], Any] | None] = []
    try:
        components.check_stop(stopping)
        teacher = TeacherEngines(cfg, say) if cfg.algo.distill.enabled else None  # they start meanwhile
        started.append(teacher and teacher.close)  # until the driver holds it
        samples = FrameReceiver(decode_samples, host=components.node_ip())
        started.append(samples.close)
        begin = start_processes if warm is None else functools.partial(take_over, warm)
        procs = begin(cfg, model_path, base_model, samples.endpoint, None if resume else components.locator(cfg), say)
        started += [procs.pool.shutdown, procs.learner.shutdown]
        # The driver (data, tokenizer, reward workers: ~3 s of dapo.yaml's start on 2 cores) is built
        # while the engines load, which is the longest part of a start.
        driver = build_driver(cfg, model_path, metrics, say, teacher=teacher)
        started[0] = driver.close  # the teacher's engines too
        procs.pool.wait_started(stopping, say)
        procs.learner.wait_started(stopping, say)
        # the storage contract (checkpoint.py), before the learner reads or writes the run directory
        checkpoint.check_shared(run_dir, procs.learner.answer_storage_probe)
        version = procs.learner.load_checkpoint(str(resume.learner_dir)).result() if resume else 0
        components.check_stop(stopping)
        if warm is None:
            form_weight_sync_group(cfg, procs.weight_sync)
        # the actors hold the base model, or the last run's; a LoRA policy's engines get their adapter
        # before any request (every request names it: rollout/vllm_engine.py)
        if version > 0 or warm is not None or (cfg.learner.lora.enabled and cfg.rollout.engine != "fake"):
            procs.weight_sync.push(version, step=None)
        parity = check_parity(cfg, procs.weight_sync, warm.probe_ids, version) if warm else None
    except BaseException:
        shut_down(say, *reversed(started))
        raise
    say(f"components ready in {time.monotonic() - t0:.1f}s; run directory {run_dir}")
    return Started(driver, samples, procs, model_path, version, parity)


def start_processes(cfg: Config, model_path: str, base_model: str, endpoint: str, locate: Locate | None,
                    say: Say) -> Processes:
    """Learner ranks that load `model_path` (each binds on its own node, and builds the built-in
    model there if it has to: `locate`), and actors on `base_model` streaming to `endpoint`,
    spawned: `pool.wait_started()` waits for their engines."""
    say(f"starting {cfg.learner.num_ranks} learner rank(s) ({cfg.learner.backend}) and "
        f"{cfg.rollout.num_actors} rollout actor(s) ({cfg.rollout.engine})")
    learner = LearnerGroup(cfg, model_path, locate=locate)
    pool = ActorPool(cfg, base_model, endpoint)
    weight_sync = WeightSync(cfg.sync, learner, pool, fake_engines=cfg.rollout.engine == "fake",
                             tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                             probe_tolerance=cfg.parity_tolerance)
    try:
        pool.spawn(cfg.rollout.num_actors)  # the engines start while the ranks load the model
    except BaseException:
        learner.shutdown()
        raise
    return Processes(learner, pool, weight_sync)


def take_over(warm: Warm, cfg: Config, model_path: str, base_model: str, endpoint: str, locate: Locate | None,
              say: Say) -> Processes:
    """The learner ranks and actors of the run before, reset in place for this one (warm.py)."""
    if wrong := warm.fits(cfg):
        raise ValueError(f"these processes do not fit this run's config ({', '.join(wrong)} differ)")
    say(f"taking over {cfg.learner.num_ranks} learner rank(s) and {len(warm.pool.ids)} rollout actor(s) "
        "from the run before")
    reset = warm.learner.reset(cfg, model_path, locate=locate)
    warm.pool.reset(cfg, endpoint, base_model)
    reset.result()
    warm.weight_sync.load_state_dict({"pushes": 0})
    return Processes(warm.learner, warm.pool, warm.weight_sync)


def form_weight_sync_group(cfg: Config, weight_sync: WeightSync) -> None:
    """The first group, with the start's timeout (components may still be building); one that
    cannot form stops the run with a line saying which timeout to raise, not a traceback."""
    timeout_s = max(cfg.sync.start_timeout_s, cfg.sync.timeout_s)
    try:
        weight_sync.rebuild_group(join_timeout_s=timeout_s)
    except PushFailed as e:
        raise RunFailed(f"{e} within sync.start_timeout_s={timeout_s:g}s of starting. A component may still "
                        "be busy with a one-time build (DeepSpeed's first optimizer op build, on a loaded "
                        "machine); raise sync.start_timeout_s and start again") from None


def check_parity(cfg: Config, weight_sync: WeightSync, probe_ids: list[int] | None, version: int) -> float | None:
    """The logprob-parity probe on a sample's ids, after a push that replaced newer weights (one
    that silently did not apply would go on from the newer weights), within the tolerance the
    dtypes allow (Config.parity_tolerance)."""
    if not probe_ids or cfg.rollout.engine == "fake":
        return None
    return weight_sync.check_parity(probe_ids, cfg.parity_tolerance, version)


@dataclass(frozen=True)
class Replacement:
    """A restarted learner: its ranks, the version they hold, where they started from (the run
    state to rewind to) and the `learner_restarted` event's fields."""

    learner: LearnerGroup
    version: int
    start: StartPoint
    event: dict[str, Any]


class LearnerRestarts:
    """Replaces a dead learner, up to `fault.max_restarts` times in a run. `started_from` is where
    a restart goes back to before the run writes its first checkpoint."""

    def __init__(self, cfg: Config, run_dir: Path, checkpoints: Checkpointer, say: Say):
        self.cfg, self.run_dir, self.checkpoints, self.say = cfg, run_dir, checkpoints, say
        self.count = 0
        self.started_from: StartPoint | None = None

    def begin_at(self, start: StartPoint) -> None:
        """Where a restart goes back to until the run writes a checkpoint (its start or resume)."""
        self.started_from = start

    @property
    def left(self) -> bool:
        return self.count < self.cfg.fault.max_restarts

    def replace(self, dead: LearnerGroup, weight_sync: WeightSync, base_model: str, error: BaseException,
                step: int, on_lost: Callable[..., Any], probe_ids: list[int] | None) -> Replacement:
        """The dead ranks killed, new ones from the newest checkpoint (or where the run started),
        and the actors (kept) pushed their weights. New ranks that die in turn are killed and
        replaced again, each a restart; past fault.max_restarts, LearnerDied."""
        if not self.left:
            raise self.checkpoints.learner_died(step + 1, error) from None
        self.checkpoints.abandon()  # the dead learner may have been writing it
        dead.kill()
        while True:
            try:
                return self._replace(weight_sync, base_model, error, step, on_lost, probe_ids)
            except RayActorError as again:
                if not self.left:
                    raise self.checkpoints.learner_died(step + 1, again) from None
                error = again

    def _replace(self, weight_sync: WeightSync, base_model: str, error: BaseException, step: int,
                 on_lost: Callable[..., Any], probe_ids: list[int] | None) -> Replacement:
        self.count += 1
        start = self.checkpoints.newest_resumable() or self.started_from
        self.say(f"step {step}: the learner died during step {step + 1} ({type(error).__name__}); restart "
                 f"{self.count} of {self.cfg.fault.max_restarts} (fault.max_restarts) from "
                 f"{start.path or 'the base model'}")
        learner = LearnerGroup(self.cfg, start.model_path(base_model),
                               locate=None if start.path else components.locator(self.cfg))
        try:
            weight_sync.rebind(learner)
            checkpoint.check_shared(self.run_dir, learner.answer_storage_probe)
            version = learner.load_checkpoint(str(start.learner_dir)).result() if start.path else 0
            form_weight_sync_group(self.cfg, weight_sync)
            weight_sync.push(version, step=None, on_lost=on_lost, rewind=True)
            parity = check_parity(self.cfg, weight_sync, probe_ids, version)
        except BaseException:
            learner.kill()
            raise
        event = {"restart": self.count, "died_at_step": step + 1,
                 "checkpoint": str(start.path) if start.path else None, "reason": str(error).splitlines()[0][:300],
                 **({"parity_max_abs_diff": parity} if parity is not None else {})}
        return Replacement(learner, version, start, event)


def shut_down(say: Say, *closers: Callable[[], Any] | None) -> None:
    """Each closer in order (None: that part never started); one that fails is said, and the rest
    still run, so a failing learner does not leave the actors, sockets or the run's lock behind."""
    for close in closers:
        if close is None:
            continue
        try:
            close()
        except Exception as e:  # shutting down anyway; say what failed
            say(f"warning: {getattr(close, '__qualname__', close)} failed: {e!r}")
