"""Rollout: the actor (actor.py) around an inference engine; the engine protocol is engine.py's,
and `engine_factory` picks the engine the config names (vLLM, or the fake one for tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from asyncrl.config import Config
from asyncrl.rollout.engine import InferenceEngine
from asyncrl.types import Locate


def engine_factory(cfg: Config, model_path: str, actor_id: int,
                   num_gpus: float | None = None, locate: Locate | None = None) -> Callable[[], InferenceEngine]:
    """What builds actor `actor_id`'s engine, `rollout.engine` of `cfg` on the model at
    `model_path`, inside the actor's process (a factory travels to the actor, not an engine).
    `num_gpus`: what the actor asked Ray for, checked against the GPUs the engine sees at start
    (None, outside a rollout actor: not checked); `locate`: where the model's files are on the
    actor's node (engine.Locate)."""
    if cfg.rollout.engine == "fake":
        from asyncrl.rollout.fake_engine import FakeEngine

        return FakeEngine
    from asyncrl.rollout.vllm_engine import VLLMEngine

    return functools.partial(
        VLLMEngine, model_path=model_path, dtype=cfg.engine_dtype, max_model_len=cfg.model.max_model_len,
        max_num_seqs=cfg.rollout.max_num_seqs, kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, sync_type=cfg.sync.type,
        bucket_bytes=cfg.sync.bucket_mb << 20, seed=cfg.sampling_seed + actor_id,
        enforce_eager=cfg.rollout.enforce_eager, num_gpus=num_gpus, locate=locate,
        tensor_parallel_size=cfg.rollout.tensor_parallel_size, lora_rank=cfg.learner.lora.rank,
        record_routing=cfg.algo.moe_routing == "replay")
