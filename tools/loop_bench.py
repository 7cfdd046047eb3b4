"""One real training run (Ray, the configured engines, the learner) for benchmarks that compare
two settings of the loop: its own Ray cluster, start-up excluded from the rates."""

from __future__ import annotations

import tempfile
import time
from typing import Any


def reward_gain(rewards: list[float]) -> float:
    """Mean reward of the last fifth of the steps minus the first fifth's."""
    fifth = max(1, len(rewards) // 5)
    return sum(rewards[-fifth:]) / fifth - sum(rewards[:fifth]) / fifth


def run_loop(name: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, Any]:
    """Run `steps` steps; rates over the steps after the first `warmup`. Returns the rates, the
    median step wall time, and the orchestrator (its history and reward pool stats)."""
    import ray

    from asyncrl.compat import hide_broken_torch_extras
    from asyncrl.config import load_config
    from asyncrl.orchestrator.orchestrator import Orchestrator

    hide_broken_torch_extras()
    out = tempfile.mkdtemp(prefix="asyncrl-bench-")
    cfg = load_config(None, [*overrides, f"total_steps={steps}", "observe.console=off",
                             "observe.tensorboard=false", "save_final=false",
                             f"observe.output_dir={out}", f"name={name}"])
    ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False)
    orch = Orchestrator(cfg, log_fn=lambda _: None)
    t0 = time.monotonic()
    try:
        orch.run()
    finally:
        orch.shutdown()
        ray.shutdown()
    timed = orch.history[warmup:]
    walls = sorted(h["timing/step_wall_s"] for h in timed)
    wall = sum(walls)
    rewards = [h["reward/mean"] for h in orch.history if h.get("reward/mean") is not None]
    all_wall = sum(h["timing/step_wall_s"] for h in orch.history)
    return {
        "name": name,
        "steps_per_s": len(timed) / wall,
        "median_step_s": walls[len(walls) // 2],
        "samples_per_s": sum(h["reward/num_samples"] for h in timed) / wall,
        "trained_tokens_per_s": sum(h["learner/loss_tokens"] for h in timed) / wall,
        "reward_gain": reward_gain(rewards),
        "gain_per_s": reward_gain(rewards) / all_wall,
        "wait_for_data_s_per_step": sum(h["timing/wait_for_data_s"] for h in timed) / len(timed),
        "stale_dropped_frac": (orch.history[-1]["buffer/tokens_dropped_stale_total"]
                               / max(orch.history[-1]["buffer/tokens_in_total"], 1)),
        "reward_last_10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        "run_s": time.monotonic() - t0,
        "orchestrator": orch,
    }
