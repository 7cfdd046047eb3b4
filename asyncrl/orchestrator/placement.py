"""What each learner rank and rollout actor asks Ray for, and a check that some node can hold it.

Ray queues an actor whose resources no node has and waits for ever, which to a user is a start
that hangs without a word. So before anything is started the run compares each component's
resources (CPUs, GPUs, the custom resources of `learner.resources` / `rollout.resources`) with
every live node's totals, and names what is missing and what the nodes have.
"""

from __future__ import annotations

from typing import Any

import ray

from asyncrl.config import ConfigError, LearnerConfig, RolloutConfig


def rank_resources(lc: LearnerConfig) -> dict[str, float]:
    """One learner rank's bundle."""
    return {"CPU": lc.num_cpus, **({"GPU": lc.num_gpus} if lc.num_gpus else {}), **lc.resources}


def actor_resources(rc: RolloutConfig) -> dict[str, float]:
    """One rollout actor's needs."""
    return {"CPU": rc.num_cpus_per_actor, **({"GPU": rc.num_gpus_per_actor} if rc.num_gpus_per_actor else {}),
            **rc.resources}


def check_placeable(needs: dict[str, float], what: str, fields: str,
                    nodes: list[dict[str, Any]] | None = None) -> None:
    """ConfigError unless some live node has every resource of `needs` in that amount; `fields`
    names the settings behind it. `nodes`: ray.nodes() (tests pass their own)."""
    alive = [n for n in (ray.nodes() if nodes is None else nodes) if n.get("Alive")]
    wanted = {k: v for k, v in needs.items() if v > 0}
    if any(all(n["Resources"].get(k, 0) >= v for k, v in wanted.items()) for n in alive):
        return
    short = sorted({k for k in wanted if not any(n["Resources"].get(k, 0) >= wanted[k] for n in alive)})
    have = "; ".join(f"{n.get('NodeManagerAddress', '?')}: " + ", ".join(
        f"{k} {v:g}" for k, v in sorted(n["Resources"].items()) if not k.startswith(("node:", "memory",
                                                                                     "object_store_memory")))
        for n in alive) or "no live node"
    raise ConfigError(f"no Ray node can hold {what} ({_fmt(wanted)}; not enough {', '.join(short) or 'on one node'}): "
                      f"the nodes have {have}; change {fields}, or start a node with them "
                      "(`ray start --resources '{...}'`)")


def _fmt(needs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in needs.items())
