"""Admission capacity: how many more prompts the rollout loop may hand out, as pure functions.
Each buffer calls the formula that matches how it spends tokens (Buffer.admission_capacity).

Streaming (`admission_capacity`) follows AReaL's staleness control: with learner version v, bound
eta and B prompts consumed per step, at most (eta + v + 1) * B prompts may have been admitted
(accepted or still running; rejected zero-variance groups do not count). A prompt admitted now
therefore lands in a batch at most eta versions after the weights that generate it. B is not
fixed under a token budget (a step takes Phi tokens, however many prompts that is), so it is
estimated from the tokens per kept group seen so far (orchestrator/admission.py). The token
buffer enforces the bound exactly whatever the estimate (but under stale_policy ess and train,
which relax it by design); a wrong estimate only costs dropped tokens or idle time. A group whose tokens the buffer drops as stale stays counted as accepted, so
every drop tightens the bound for the rest of the run: under stale_policy discard admission
settles where little goes stale (the feedback that keeps the length bias small), at the price of
engines that run below their batch after a start that admitted too much (the twin's
`gen_occupancy`). Under stale_policy train nothing is dropped: the bound then limits admission
alone, as AReaL's does. The bound depends only on counts a checkpoint restores (v, accepted
groups), so it holds after a resume exactly as before it.
"""

from __future__ import annotations

import math


def admission_capacity(max_staleness: int, learner_version: int, prompts_per_step: float,
                       accepted_or_running: int, generating: int, starving: bool,
                       held_by_verifiers: int = 0) -> int:
    """How many more prompts may be admitted now. `accepted_or_running`: admitted groups minus
    the ones rejected (zero reward variance) or given up (lost with an actor, requeued).

    `held_by_verifiers`: generated groups whose rewards are still being computed, up to the
    number of reward workers (the most that hung verifiers can hold at once), or 0 when samples
    are queued for a worker (then the verifiers are the bottleneck and more generation would only
    pile up). They do not count against the bound: a group waiting out a hung verifier's timeout
    would otherwise keep the actors short of a step's worth for as long. At most that many
    groups are admitted beyond the bound; the buffer still drops whatever ends up too stale.

    `starving`: the buffer cannot fill a step, and not because samples are queued for the
    verifiers. With nothing generating, a too-low estimate of B would deadlock, so then one
    step's worth is admitted regardless.
    """
    cap = (math.floor((max_staleness + learner_version + 1) * prompts_per_step)
           - (accepted_or_running - held_by_verifiers))
    if starving and generating == 0:
        cap = max(cap, math.ceil(prompts_per_step))
    return max(cap, 0)


def rollout_batch_capacity(max_staleness: int, steps_until_seal: int, steps_per_batch: float,
                           batch_prompts: int, waiting: int) -> int:
    """How many more prompts may be admitted under a rollout-batch schedule (buffer.rollout_batch_prompts).

    Staleness is checked when a batch is sealed, and the next batch is sealed `steps_until_seal`
    versions from now (the steps its predecessor still feeds, counting one in progress). A prompt
    admitted now is generated at the current version or later, so it may join that batch only if
    steps_until_seal <= max_staleness; each later batch is sealed steps_per_batch versions after.
    With max_staleness 0 this is the synchronous schedule: generate D_R, train N_SGD steps, repeat.
    `waiting`: admitted prompts whose groups are not sealed yet (running or collecting).
    """
    if steps_until_seal > max_staleness:
        return 0
    batches = 1 + int((max_staleness - steps_until_seal) // max(steps_per_batch, 1.0))
    return max(batches * batch_prompts - waiting, 0)
