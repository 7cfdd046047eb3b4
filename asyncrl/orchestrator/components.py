"""Builds the run's processes: the rollout actors under Ray (the learner ranks are started by
learner_group.py; the driver's parts by driver.py).

Each gets only its own sub-config. Engines are created inside their actor's process (a factory
travels, not an engine); on CPU the vLLM KV cache is sized through the actor's environment.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from asyncrl.compat import child_env
from asyncrl.config import Config
from asyncrl.observe.worker_logs import log_env
from asyncrl.rollout import engine_factory
from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode_runners import episodes_in_actor
from asyncrl.rollout.local_rewards import LocalRewards
from asyncrl.types import Locate, StartInterrupted, Stopping

START_POLL_S = 0.5  # how often a start that waits checks whether a stop was asked for
START_PROGRESS_S = 30.0  # how often it says how far the engines and ranks are


def resolve_model_path(cfg: Config, log: Callable[[str], None] = print) -> str:
    """`builtin:tiny` builds (or reuses from the cache) the locally made tiny model, warm-started as
    `model.tiny` says."""
    if cfg.model.path.startswith("builtin:"):
        name = cfg.model.path.split(":", 1)[1]
        if name != "tiny":
            raise ValueError(f"model.path {cfg.model.path!r}: the only built-in model is 'builtin:tiny'")
        from asyncrl.tiny.build import ensure_tiny_model
        from asyncrl.tiny.spec import spec_for

        return str(ensure_tiny_model(spec_for(cfg.model.tiny), log=log))
    return cfg.model.path


# What a learner rank or an actor on another node needs from the driver's environment: Ray starts
# a remote node's workers with that node's own environment, not the driver's. Names ending in "_"
# are prefixes. (Reward modules travel by reward.import_path in the config, not by PYTHONPATH.)
FORWARDED_ENV = ("NCCL_", "TORCH_NCCL_", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HF_HOME", "HF_HUB_CACHE",
                 "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH")


def process_env(cfg: Config, log_name: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The env_vars of a learner rank's or an actor's runtime_env: FORWARDED_ENV from the driver,
    the torch-extras work-around (compat.child_env) and where its output goes (worker_logs)."""
    environ = os.environ if environ is None else environ
    forwarded = {k: v for k, v in environ.items()
                 if any(k.startswith(name) if name.endswith("_") else k == name for name in FORWARDED_ENV)}
    return {**forwarded, **child_env(), **log_env(cfg.run_dir, log_name, cfg.observe.worker_logs)}


def locator(cfg: Config) -> Locate | None:
    """Where the run's model is on each node (types.Locate): for the built-in model, each node's
    own build of it; None for a model given by path (the path is the same everywhere)."""
    spec = tiny_spec(cfg)
    if spec is None:
        return None
    from asyncrl.tiny.build import local_model_path

    return functools.partial(local_model_path, spec=spec)


def tiny_spec(cfg: Config) -> Any:
    """The built-in model's spec when the run trains it (each node builds its own copy from it:
    tiny/build.py local_model_path), else None."""
    if not cfg.model.path.startswith("builtin:"):
        return None
    from asyncrl.tiny.spec import spec_for

    return spec_for(cfg.model.tiny)


def start_failure(error: BaseException) -> str:
    """What made a learner rank or an actor fail to start, as one line (the exception its
    constructor or start raised, e.g. a GPU it sees but did not ask for), not Ray's traceback."""
    cause = getattr(error, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else repr(error)


def wait_to_start(refs: list[Any], stopping: Stopping | None, what: str = "", say: Callable[[str], None] | None = None,
                  every_s: float = START_PROGRESS_S) -> None:
    """Until every ref is ready (a failed one is too: the caller's ray.get raises its error); a stop
    asked for meanwhile ends the start with StartInterrupted rather than waiting for it to finish
    (checked every START_POLL_S). Every `every_s` of waiting, `say` how many of `what` are up: a
    large model's engines take minutes to load, and a start that says nothing looks hung."""
    t0 = last = time.monotonic()
    waiting = refs
    while waiting:
        check_stop(stopping)
        waiting = ray.wait(waiting, num_returns=len(waiting), timeout=START_POLL_S)[1]
        if waiting and say is not None and time.monotonic() - last >= every_s:
            last = time.monotonic()
            say(f"{len(refs) - len(waiting)} of {len(refs)} {what} up after {last - t0:.0f}s; waiting for the rest")


def check_stop(stopping: Stopping | None) -> None:
    """StartInterrupted when a stop was asked for: a start checks between its parts."""
    if stopping is not None and (reason := stopping()) is not None:
        raise StartInterrupted(reason)


def node_ip() -> str:
    """This node's address as Ray sees it (loopback on a single-machine cluster)."""
    return ray.util.get_node_ip_address()


def episodes_factory(cfg: Config, model_path: str) -> Callable[[], Any] | None:
    """What builds an actor's episode runner in its process (None: single-turn sampling): an
    environment's, or an agent's with its OpenAI-compatible endpoint."""
    if cfg.env.type is None:
        return None
    return functools.partial(episodes_in_actor, cfg.env, model_path, locate=locator(cfg),
                             max_model_len=cfg.model.max_model_len)


def start_rollout_actor(cfg: Config, model_path: str, sample_endpoint: str, actor_id: int) -> Any:
    """Create one actor (its engine starts with `actor.start.remote()`; the engine makes its own
    directory for vLLM's IPC sockets, on its node: vllm_engine.own_rpc_dir)."""
    spec = SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_tokens)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kv_cache_gib),
           "VLLM_LOGGING_LEVEL": cfg.observe.engine_log_level.upper(), **process_env(cfg, f"actor-{actor_id}")}
    scorer = (functools.partial(LocalRewards.build, cfg.reward, model_path, locate=locator(cfg))
              if cfg.reward.placement == "actor" else None)
    episodes = episodes_factory(cfg, model_path)
    return ray.remote(RolloutActor).options(
        num_cpus=cfg.rollout.num_cpus_per_actor, num_gpus=cfg.rollout.num_gpus_per_actor,
        resources=cfg.rollout.resources, scheduling_strategy="SPREAD" if cfg.rollout.spread else None,
        runtime_env={"env_vars": env}).remote(
        actor_id, engine_factory(cfg, model_path, actor_id, cfg.rollout.num_gpus_per_actor, locator(cfg)), spec,
        cfg.rollout.group_size, sample_endpoint,
        seed=cfg.sampling_seed, sync_mode=cfg.sync.mode, scorer=scorer, episodes=episodes,
        keep_kv=cfg.sync.keep_kv)
