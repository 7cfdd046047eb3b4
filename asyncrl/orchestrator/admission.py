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


def assign_prompts(num_prompts: int, in_flight: dict[int, int], max_per_actor: int,
                   per_prompt: int = 1) -> dict[int, int]:
    """How many of `num_prompts` each actor (id -> its load; only live actors are listed) gets:
    always to the least-loaded (the lowest id among equals), while its load is below the cap;
    actors that get none are left out. A prompt adds `per_prompt` to the load: 1 where the load
    counts prompts, the group size where it counts requests (an actor just below the cap takes one
    more prompt, so its engine is never short of work). A heap of loads: the driver asks every loop
    turn, and a large cluster has hundreds of actors."""
    heap = [(load, actor) for actor, load in in_flight.items() if load < max_per_actor]
    heapq.heapify(heap)
    share: dict[int, int] = {}
    for _ in range(num_prompts):
        if not heap:
            break
        load, actor = heap[0]
        share[actor] = share.get(actor, 0) + 1
        if load + per_prompt < max_per_actor:
            heapq.heapreplace(heap, (load + per_prompt, actor))
        else:
            heapq.heappop(heap)
    return share
