"""Builds the run's processes: the rollout actors under Ray (the learner ranks are started by
learner_group.py; the driver's parts by driver.py).

Each gets only its own sub-config. Engines are created inside their actor's process (a factory
travels, not an engine); on CPU the vLLM KV cache is sized through the actor's environment.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ray

from asyncrl.compat import child_env
from asyncrl.config import Config
from asyncrl.observe.worker_logs import log_env
from asyncrl.rollout import engine_factory
from asyncrl.rollout.actor import RolloutActor
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.local_rewards import LocalRewards


def resolve_model_path(cfg: Config, log: Callable[[str], None] = print) -> str:
    """`builtin:tiny` builds (or reuses from the cache) the locally made tiny model, warm-started as
    `model.tiny` says."""
    if cfg.model.path.startswith("builtin:"):
        name = cfg.model.path.split(":", 1)[1]
        if name != "tiny":
            raise ValueError(f"model.path {cfg.model.path!r}: the only built-in model is 'builtin:tiny'")
        from asyncrl.tiny.build import ensure_tiny_model, spec_for

        return str(ensure_tiny_model(spec_for(cfg.model.tiny), log=log))
    return cfg.model.path


def node_ip() -> str:
    """This node's address as Ray sees it (loopback on a single-machine cluster)."""
    return ray.util.get_node_ip_address()


def start_rollout_actor(cfg: Config, model_path: str, sample_endpoint: str, actor_id: int,
                        rpc_dir: str | None = None) -> Any:
    """Create one actor (its engine starts with `actor.start.remote()`). `rpc_dir` keeps vLLM's
    IPC sockets in the run's own directory, removed at shutdown, so a killed engine leaves none in /tmp."""
    spec = SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_tokens)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kv_cache_gib), **child_env(),
           "VLLM_LOGGING_LEVEL": cfg.observe.engine_log_level.upper(),
           **log_env(cfg.run_dir, f"actor-{actor_id}", cfg.observe.worker_logs)}
    if rpc_dir:
        env["VLLM_RPC_BASE_PATH"] = rpc_dir
    scorer = functools.partial(LocalRewards.build, cfg.reward, model_path) if cfg.reward.placement == "actor" else None
    return ray.remote(RolloutActor).options(
        num_cpus=cfg.rollout.num_cpus_per_actor, num_gpus=cfg.rollout.num_gpus_per_actor,
        runtime_env={"env_vars": env}).remote(
        actor_id, engine_factory(cfg, model_path, actor_id, cfg.rollout.num_gpus_per_actor), spec,
        cfg.rollout.group_size, sample_endpoint,
        seed=cfg.seed, sync_mode=cfg.sync.mode, scorer=scorer)
