"""Runs one after another on the same processes: a study's runs share the Ray cluster, the rollout
actors (their vLLM engines stay up) and the learner ranks, instead of starting them for each run.

A run's fixed cost is mostly start-up: Ray (~5 s), a vLLM engine (~20 s), the learner ranks and
their imports, and their shutdown. A study of tens of short runs on the tiny model spent more on
that than on its steps. Here the first run starts the processes as usual; each later run whose
config agrees with it on every field that shapes a process (`PROCESS_FIELDS`) takes them over:

- the learner ranks reload the model from the run's starting point and rebuild the optimizer,
  reference and schedules in place (LearnerRank.reset; the process group and the weight-sync
  group stay);
- the actors cancel the last run's requests (vLLM aborts them), stream to the new run's socket
  and take its seed (RolloutActor.reset); the new run's first push (version 0, or the version of
  the checkpoint it resumes) gives them its weights before any prompt;
- everything else (driver, reward pool, metrics, checkpoints, run lock) is the new run's own.

A config that differs in a process-shaping field stops the old processes and starts new ones.
What a run computes does not depend on whether it started cold or warm, except that the engines'
own random state continues (every request carries a seed derived from the run's seed and the
request id, so sampling is as reproducible as in a cold start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.config import Config

PROCESS_FIELDS = {
    "model": None,  # the whole section
    "ray": None,
    "sync": None,
    "rollout": ("engine", "num_actors", "dtype", "kv_cache_gib", "max_num_seqs", "gpu_memory_utilization",
                "num_cpus_per_actor", "num_gpus_per_actor", "tensor_parallel_size", "resources", "spread",
                "enforce_eager"),
    "learner": ("backend", "num_ranks", "deepspeed", "num_threads", "num_cpus", "num_gpus", "resources",
                "param_dtype"),
    "observe": ("worker_logs", "engine_log_level"),
    "env": None,  # the actors hold the episode runner (an environment's factory, an agent's endpoint)
}
"""Config fields that shape a process (what it loads, where it runs, how it talks): two runs share
processes only when these agree. A section named with None counts whole."""


def process_key(cfg: Config) -> dict[str, Any]:
    """The values of `PROCESS_FIELDS` in `cfg` (and the reward section when actors score)."""
    key: dict[str, Any] = {}
    for section, fields in PROCESS_FIELDS.items():
        values = getattr(cfg, section).model_dump(mode="json")
        key[section] = values if fields is None else {f: values[f] for f in fields}
    key["reward.placement"] = cfg.reward.placement
    key["algo.moe_routing"] = cfg.algo.moe_routing  # the engines record routing, the learner's routers replay it
    if cfg.reward.placement == "actor":  # the actors hold the reward functions
        key["reward"] = cfg.reward.model_dump(mode="json")
    return key


def differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields where two process keys differ."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += differences(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


@dataclass
class Warm:
    """The processes one run leaves to the next (Orchestrator.release)."""

    key: dict[str, Any]
    learner: Any   # LearnerGroup
    pool: Any      # ActorPool
    weight_sync: Any  # WeightSync
    probe_ids: list[int] | None = None
    """The last run's first sample (prompt and response), for the parity probe of the next run."""

    def fits(self, cfg: Config) -> list[str]:
        """The process-shaping fields in which `cfg` differs from these processes ([]: it fits)."""
        return differences(self.key, process_key(cfg))

    def shutdown(self, say=print) -> None:
        try:
            self.learner.shutdown()
        except Exception as e:  # shutting down anyway; say what failed
            say(f"warning: learner shutdown failed: {e!r}")
        self.pool.shutdown()
