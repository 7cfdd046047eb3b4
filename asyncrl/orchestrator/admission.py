"""Dispatch decisions of the rollout loop, as pure functions: how many prompts one step
consumes (the B of the admission bound, buffer/admission.py) and which actor gets them (the
ledger groups an actor's records into submits: `group_by_settings`)."""

from __future__ import annotations

import heapq


def prompts_per_step(token_budget: int, tokens_per_kept_group: float | None, group_size: int,
                     max_tokens: int) -> float:
    """Estimated prompts one step consumes: Phi over the mean loss tokens of a kept group."""
    per_group = tokens_per_kept_group or group_size * max_tokens / 2
    return max(token_budget / max(per_group, 1.0), 1.0)


def assign_prompts(num_prompts: int, in_flight: dict[int, int], max_per_actor: int) -> dict[int, int]:
    """How many of `num_prompts` each actor (id -> prompts it is generating; only live actors are
    listed) gets: always to the least-loaded (the lowest id among equals), none beyond its cap;
    actors that get none are left out. A heap of loads: the driver asks every loop turn, and a
    large cluster has hundreds of actors."""
    heap = [(load, actor) for actor, load in in_flight.items() if load < max_per_actor]
    heapq.heapify(heap)
    share: dict[int, int] = {}
    for _ in range(num_prompts):
        if not heap:
            break
        load, actor = heap[0]
        share[actor] = share.get(actor, 0) + 1
        if load + 1 < max_per_actor:
            heapq.heapreplace(heap, (load + 1, actor))
        else:
            heapq.heappop(heap)
    return share
