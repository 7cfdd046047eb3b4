"""A run's processes from their start to a learner's restart: what the orchestrator calls at its
start and when a learner rank dies (orchestrator.py keeps the run loop and the step's finish).

- `start_processes`: the learner ranks and the rollout actors started cold (the engines start
  while the ranks load the model), or `take_over` those of the run before on this cluster (warm.py);
- `form_weight_sync_group`: the first weight-sync group, with the start's timeout;
- `check_parity`: after a push that replaced newer weights (taken over, or rewound by a learner
  restart), the engines' logprobs against the learner's;
- `replace_learner`: a dead learner's replacement, started from a start point (the newest
  checkpoint, or where the run started), with the weight sync rebound to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.observe.metrics import Say
from asyncrl.orchestrator import checkpoint, components
from asyncrl.orchestrator.actor_pool import ActorPool
from asyncrl.orchestrator.checkpointer import StartPoint
from asyncrl.orchestrator.learner_group import LearnerGroup
from asyncrl.orchestrator.warm import Warm
from asyncrl.orchestrator.weight_sync import PushFailed, WeightSync
from asyncrl.types import RunFailed


@dataclass(frozen=True)
class Processes:
    """What a run drives besides its own thread: the learner ranks, the rollout actors and the
    group that carries the weights from one to the other."""

    learner: LearnerGroup
    pool: ActorPool
    weight_sync: WeightSync


def start_processes(cfg: Config, model_path: str, base_model: str, endpoint: str, tiny: Any, say: Say) -> Processes:
    """Learner ranks that load `model_path` (each binds on its own node, and builds the built-in
    model there if it has to: `tiny`), and actors on `base_model` streaming to `endpoint`."""
    say(f"starting {cfg.learner.num_ranks} learner rank(s) ({cfg.learner.backend}) and "
        f"{cfg.rollout.num_actors} rollout actor(s) ({cfg.rollout.engine})")
    learner = LearnerGroup(cfg, model_path, tiny=tiny)
    pool = ActorPool(cfg, base_model, endpoint)
    weight_sync = WeightSync(cfg.sync, learner, pool, fake_engines=cfg.rollout.engine == "fake",
                             tensor_parallel_size=cfg.rollout.tensor_parallel_size)
    pool.start(cfg.rollout.num_actors)  # the engines start while the ranks load the model
    return Processes(learner, pool, weight_sync)


def take_over(warm: Warm, cfg: Config, model_path: str, base_model: str, endpoint: str, tiny: Any,
              say: Say) -> Processes:
    """The learner ranks and actors of the run before, reset in place for this one (warm.py)."""
    if wrong := warm.fits(cfg):
        raise ValueError(f"these processes do not fit this run's config ({', '.join(wrong)} differ)")
    say(f"taking over {cfg.learner.num_ranks} learner rank(s) and {len(warm.pool.ids)} rollout actor(s) "
        "from the run before")
    reset = warm.learner.reset(cfg, model_path, tiny=tiny)
    warm.pool.reset(cfg, endpoint, base_model)
    reset.result()
    warm.weight_sync.load_state_dict({"pushes": 0})
    return Processes(warm.learner, warm.pool, warm.weight_sync)


def form_weight_sync_group(cfg: Config, weight_sync: WeightSync) -> None:
    """The first group, with the start's timeout (components may still be building); one that
    cannot form stops the run with a line saying which timeout to raise, not a traceback."""
    timeout_s = max(cfg.sync.start_timeout_s, cfg.sync.timeout_s)
    try:
        weight_sync.rebuild_group(timeout_s)
    except PushFailed as e:
        raise RunFailed(f"{e} within sync.start_timeout_s={timeout_s:g}s of starting. A component may still "
                        "be busy with a one-time build (DeepSpeed's first optimizer op build, on a loaded "
                        "machine); raise sync.start_timeout_s and start again") from None


def check_parity(cfg: Config, weight_sync: WeightSync, probe_ids: list[int] | None, version: int) -> float | None:
    """The logprob-parity probe on a sample's ids, after a push that replaced newer weights (one
    that silently did not apply would go on from the newer weights). With engines of another
    dtype than the learner, rounding alone gives gaps of ~1e-3, so the tolerance is wider there."""
    if not probe_ids or cfg.rollout.engine == "fake":
        return None
    same = cfg.engine_dtype == cfg.model.dtype
    return weight_sync.check_parity(probe_ids, cfg.sync.probe_tolerance if same else 0.05, version)


def replace_learner(cfg: Config, weight_sync: WeightSync, run_dir: Path, start: StartPoint,
                    model_path: str) -> tuple[LearnerGroup, int]:
    """New learner ranks on `model_path` (the start point's policy, or the base model), rebound
    into the weight sync, its group formed again; returns them and the version they hold."""
    learner = LearnerGroup(cfg, model_path, tiny=None if start.path else components.tiny_spec(cfg))
    weight_sync.rebind(learner)
    checkpoint.check_shared(run_dir, learner.answer_storage_probe)
    version = learner.load_checkpoint(str(start.learner_dir)).result() if start.path else 0
    form_weight_sync_group(cfg, weight_sync)
    return learner, version

